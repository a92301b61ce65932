"""The one way pagedq runs a server-side script (wire/lua/), on any redis-py client: sync or
asyncio, a single Redis or a cluster, directly or queued on a pipeline.

A script's arguments are a ``ScriptCall``: a dataclass per script (its fields are the
script's inputs, named and typed) that builds its own KEYS and ARGV (``keys_args``) and
parses its own reply (``parse``). The calls live beside the scripts' contract: wire/scripts.py
(the clients'), wire/worker_scripts.py, wire/batch_scripts.py, wire/gateway_scripts.py.

How a call goes out depends on the server, found once per connection pool (``prepare``:
``HELLO``, which every user may send): on Redis >= 7 an FCALL (FCALL_RO for a read-only
script) of the function library (pagedq.wire.lua.library), on Redis 6.2 a plain EVALSHA of
the script's text (its sharded text on a cluster: SPUBLISH, pagedq.wire.lua.sharded).
Called directly (``run``, ``run_async``), a missing script (NOSCRIPT: Redis restarted,
flushed its script cache, a new cluster master) or function library ("Function not
found": a Redis that lost its data) is loaded and the call sent again; a user that may not
load the library (the ACL roles but the worker's) gets ``LibraryMissing``, a
ConnectionError that the clients' retry loops wait out while a worker loads it again.
Queued on a pipeline (``queue``), that reply is the caller's: ``noscript`` tells it,
``load`` loads, and the caller sends its pipeline again (``pipelined`` does all of that
for a pipeline of calls alone). Every pagedq script may be sent again: each is fenced
(attempt, lease) or idempotent (by job id and body, by status). A script call that Redis
refused for memory (a full Redis past ``maxmemory``) is ``StorageFull`` (``results``,
``run``); ``is_oom`` tells such a reply. redis-py's own Script objects are not used: they
send SCRIPT EXISTS before every pipeline that runs one, one more round trip, and a cluster
pipeline refuses them.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import redis
import redis.asyncio
import redis.asyncio.cluster
import redis.cluster

from . import lua
from .connection import is_cluster
from .errors import StorageFull
from .lua import rq_scripts
from .redis_errors import RETRYABLE


class LibraryMissing(redis.ConnectionError):
    """Redis (>= 7) lacks pagedq's function library (it lost its data, or nobody loaded
    it) and this user may not load it: a worker loads it at its start and when it finds it
    gone, ``pagedq functions load`` at deploy. A ConnectionError, so the clients retry it
    for PAGEDQ_CLIENT_RETRY_S as an outage."""


_MODE = "_pagedq_functions"  # attribute of a connection pool: FCALL or not
_CLUSTER_PIPES = (redis.cluster.ClusterPipeline, redis.asyncio.cluster.ClusterPipeline)


def _owner(x: Any) -> Any:
    """What a client and its pipelines share: the connection pool."""
    return getattr(x, "connection_pool", None) or x


def _known(x: Any) -> bool | None:
    if is_cluster(x) or isinstance(x, _CLUSTER_PIPES):  # a Redis Cluster of pagedq is >= 7
        return True
    return getattr(_owner(x), _MODE, None)


def _remember(x: Any, version: str) -> bool:
    major = int(str(version).split(".", 1)[0] or 0)
    setattr(_owner(x), _MODE, major >= 7)
    return major >= 7


def _version_of(hello: Any) -> str:
    if isinstance(hello, dict):
        v = hello.get("version", hello.get(b"version", "0"))
    else:  # RESP2 without a callback: a flat list of names and values
        items = list(hello or [])
        pairs = dict(zip(items[::2], items[1::2], strict=False))
        v = pairs.get("version", pairs.get(b"version", "0"))
    return v.decode() if isinstance(v, bytes) else str(v)


def prepare(r: Any) -> bool:
    """Find out (once per connection pool) whether Redis runs functions (>= 7): True for
    FCALL, False for EVALSHA. ``queue`` needs it known: a client whose calls go only
    through pipelines calls this first (the worker does at start)."""
    known = _known(r)
    if known is None:
        known = _remember(r, _version_of(r.execute_command("HELLO")))
    return known


async def prepare_async(r: Any) -> bool:
    known = _known(r)
    if known is None:
        known = _remember(r, _version_of(await r.execute_command("HELLO")))
    return known


def _command(call: ScriptCall, functions: bool, cluster: bool) -> list[Any]:
    """The call's command and arguments: FCALL[_RO] of its function, or EVALSHA."""
    keys, args = call.keys_args()
    declared = lua.SCRIPTS[call.SCRIPT]
    if functions:
        head = ["FCALL_RO" if declared.read_only else "FCALL", declared.function]
    else:
        head = ["EVALSHA", lua.sha(call.SCRIPT, cluster)]
    return [*head, len(keys), *keys, *args]


def missing(e: BaseException) -> bool:
    """A reply saying the script or the function library is not loaded."""
    return isinstance(e, redis.exceptions.NoScriptError) or (
        isinstance(e, redis.ResponseError) and "Function not found" in str(e))


def is_oom(e: Any) -> bool:
    """A reply (or an error raised) saying Redis refused a write for memory: past
    ``maxmemory`` with ``noeviction`` (redis-py's OutOfMemoryError, an OOM error raised in a
    script, or ``StorageFull``)."""
    if isinstance(e, StorageFull | redis.exceptions.OutOfMemoryError):
        return True
    return isinstance(e, redis.ResponseError) and "OOM command not allowed" in str(e)


def storage_full(e: BaseException) -> StorageFull:
    """The typed error of a reply ``is_oom`` tells."""
    return StorageFull(f"Redis is full (maxmemory reached): nothing was written; retry later "
                       f"({str(e).split('.', 1)[0]})")


def _raise_typed(e: redis.ResponseError) -> None:
    if is_oom(e):
        raise storage_full(e) from e


class ScriptCall:
    """The arguments of one call of script ``SCRIPT`` (a name in wire/lua's SCRIPTS).
    Subclasses are dataclasses; the KEYS they build share one partition's hash tag (one
    Redis Cluster slot), as wire/keys.py builds them."""

    __slots__ = ()
    SCRIPT: ClassVar[str]

    def keys_args(self) -> tuple[list[str], list[Any]]:
        raise NotImplementedError

    def parse(self, reply: Any) -> Any:
        """The script's reply as its caller wants it (raising the typed error a reply
        stands for); by default the reply as it came."""
        return reply


def _cluster_pipe(pipe: Any) -> bool:
    return not isinstance(pipe, redis.client.Pipeline | redis.asyncio.client.Pipeline)


def run(r: Any, call: ScriptCall) -> Any:
    """Run ``call`` on the sync client ``r``; its parsed reply."""
    cmd = _command(call, prepare(r), is_cluster(r))
    try:
        try:
            reply = r.execute_command(*cmd)
        except redis.ResponseError as e:
            if not missing(e):
                raise
            load(r, (call.SCRIPT,))
            reply = r.execute_command(*cmd)
    except redis.ResponseError as e:
        _raise_typed(e)
        raise
    return call.parse(reply)


async def run_async(r: Any, call: ScriptCall) -> Any:
    """``run`` on an asyncio client."""
    cmd = _command(call, await prepare_async(r), is_cluster(r))
    try:
        try:
            reply = await r.execute_command(*cmd)
        except redis.ResponseError as e:
            if not missing(e):
                raise
            await load_async(r, (call.SCRIPT,))
            reply = await r.execute_command(*cmd)
    except redis.ResponseError as e:
        _raise_typed(e)
        raise
    return call.parse(reply)


def queue(pipe: Any, call: ScriptCall) -> None:
    """Queue ``call`` on a pipeline (sync or asyncio, plain or cluster) as a bare FCALL or
    EVALSHA (``prepare`` the client first; never prepared: EVALSHA). Its reply comes back
    with the pipeline's (``call.parse`` it, or ``results``). Nothing to await: on an
    asyncio cluster pipeline, awaiting would empty its queue."""
    pipe.execute_command(*_command(call, bool(_known(pipe)), _cluster_pipe(pipe)))


def results(calls: Iterable[ScriptCall], replies: list[Any]) -> list[Any]:
    """Each call's parsed reply, in order; an exception in its place where Redis answered an
    error or the reply stands for one (``parse`` raised it)."""
    out: list[Any] = []
    for call, reply in zip(calls, replies, strict=True):
        if isinstance(reply, Exception):
            out.append(storage_full(reply) if is_oom(reply) else reply)
            continue
        try:
            out.append(call.parse(reply))
        except Exception as e:  # noqa: BLE001 - handed back in the reply's place
            out.append(e)
    return out


def noscript(replies: list[Any]) -> bool:
    """Did a pipeline (executed with raise_on_error=False) meet an unloaded script or a
    missing function library?"""
    return any(missing(x) for x in replies if isinstance(x, Exception))


def failed(replies: list[Any]) -> Exception | None:
    """The first connection-level failure among a pipeline's replies (a cluster pipeline
    executed with raise_on_error=False returns them, where a plain one raises), or None."""
    return next((x for x in replies if isinstance(x, RETRYABLE)), None)


def raise_retryable(replies: list[Any]) -> None:
    """Raise ``failed(replies)`` if there is one: the caller's retry loop sends the whole
    pipeline again (every call in it may be repeated)."""
    if (down := failed(replies)) is not None:
        raise down


def load(r: Any, names: Iterable[str]) -> None:
    """Make the scripts ``names`` runnable on the sync client ``r``: on Redis >= 7 the
    function library (``load_library``), else SCRIPT LOAD of each (on a cluster: on every
    master, where redis-py sends SCRIPT LOAD; a replica promoted by a failover may lack
    them)."""
    cluster = is_cluster(r)
    if prepare(r):
        load_library(r)
        return
    texts = [lua.text(n, cluster) for n in dict.fromkeys(names)]
    if cluster:
        for t in texts:
            r.script_load(t)
        return
    pipe = r.pipeline(transaction=False)
    for t in texts:
        pipe.script_load(t)
    pipe.execute()


async def load_async(r: Any, names: Iterable[str]) -> None:
    """``load`` on an asyncio client."""
    cluster = is_cluster(r)
    if await prepare_async(r):
        try:
            await r.function_load(lua.library(cluster), replace=True)
        except redis.exceptions.NoPermissionError as e:
            raise _library_missing(e) from e
        return
    for name in dict.fromkeys(names):
        await r.script_load(lua.text(name, cluster))


def _library_missing(e: BaseException) -> LibraryMissing:
    return LibraryMissing("pagedq's function library is not loaded on this Redis and this "
                          f"user may not load it ({e}): a worker loads it when it starts, "
                          "or run `pagedq functions load` as admin")


def installed_version(r: Any, function: str = lua.VERSION_FUNCTION) -> str | None:
    """The version of the library Redis holds (its version function: ``pagedq_version``,
    or rq's ``pagedq_rq_version``), None if none."""
    try:
        v = r.execute_command("FCALL_RO", function, 0)
    except redis.ResponseError as e:
        if missing(e):
            return None
        raise
    return v.decode() if isinstance(v, bytes) else str(v)


def _libraries(r: Any) -> list[tuple[str, str, str]]:
    """(text, version, version function) of the libraries to load: pagedq's, and rq's
    scripts' when rq is installed (pagedq.wire.lua.rq_scripts)."""
    cluster = is_cluster(r)
    libs = [(lua.library(cluster), lua.library_version(cluster), lua.VERSION_FUNCTION)]
    if not cluster and (text := rq_scripts.library()) is not None:  # (rq: no cluster)
        libs.append((text, rq_scripts.version(), rq_scripts.VERSION_FUNCTION))
    return libs


def load_library(r: Any) -> None:
    """FUNCTION LOAD REPLACE of the libraries (Redis >= 7); LibraryMissing when this user
    may not (on a cluster redis-py sends it to every master)."""
    try:
        for text, _version, _fn in _libraries(r):
            r.function_load(text, replace=True)
    except redis.exceptions.NoPermissionError as e:
        raise _library_missing(e) from e


def ensure_library(r: Any) -> str | None:
    """Redis >= 7: load the libraries unless Redis holds these versions of them (an older
    or newer one is replaced: an upgrade in place). Returns what was found before when it
    loaded (the versions, "" for none), None when nothing was done (the same versions, or
    Redis 6.2)."""
    if not prepare(r):
        return None
    found = [installed_version(r, fn) for _text, _v, fn in _libraries(r)]
    if found == [v for _text, v, _fn in _libraries(r)]:
        return None
    load_library(r)
    return ",".join(v or "" for v in found if v)


def pipelined(r: Any, calls: list[ScriptCall]) -> list[Any]:
    """``calls`` in one pipeline on a sync client: ``results``. After a NOSCRIPT reply the
    scripts are loaded and the pipeline sent again; a connection-level failure is raised
    (the caller's retry loop sends it all again)."""
    prepare(r)
    for _ in range(2):
        with r.pipeline(transaction=False) as pipe:
            for call in calls:
                queue(pipe, call)
            replies = pipe.execute(raise_on_error=False)
        if not noscript(replies):
            break
        load(r, [c.SCRIPT for c in calls])
    raise_retryable(replies)
    return results(calls, replies)


async def pipelined_async(r: Any, calls: list[ScriptCall]) -> list[Any]:
    """``pipelined`` on an asyncio client."""
    await prepare_async(r)
    for _ in range(2):
        async with r.pipeline(transaction=False) as pipe:
            for call in calls:
                queue(pipe, call)
            replies = await pipe.execute(raise_on_error=False)
        if not noscript(replies):
            break
        await load_async(r, [c.SCRIPT for c in calls])
    raise_retryable(replies)
    return results(calls, replies)


# ---- rq's Lua (the batch control plane's rq connection: batch/rq_redis.py) ---------------

class _RqFunction:
    """What ``RqRedis.register_script`` returns, called as redis-py's Script is (``keys``,
    ``args``, ``client``: a pipeline queues the call): rq's script text runs as its function
    of the ``pagedq_rq`` library (pagedq.wire.lua.rq_scripts) on Redis >= 7, else (6.2, or
    a text the library does not hold) as redis-py's Script (EVALSHA)."""

    def __init__(self, registered_client: redis.Redis, text: str | bytes) -> None:
        self.registered_client, self.script = registered_client, text
        name = rq_scripts.function_name(text)
        self.function = name if name in rq_scripts.texts() else None
        self._script = redis.commands.core.Script(registered_client, text)

    def __call__(self, keys: list | None = None, args: list | None = None,
                 client: Any = None) -> Any:
        keys, args = list(keys or []), list(args or [])
        client = client if client is not None else self.registered_client
        if self.function is None or not prepare(self.registered_client):
            return self._script(keys, args, client)
        try:
            return client.fcall(self.function, len(keys), *keys, *args)
        except redis.ResponseError as e:
            if not missing(e):
                raise
            load_library(self.registered_client)  # LibraryMissing when it may not
            return client.fcall(self.function, len(keys), *keys, *args)


class RqRedis(redis.Redis):
    """A redis.Redis whose ``register_script`` runs rq's scripts as functions, so that the
    batch and gateway users need neither EVAL, EVALSHA nor SCRIPT (docs/security.md)."""

    def register_script(self, script: str | bytes) -> _RqFunction:  # type: ignore[override]
        return _RqFunction(self, script)
