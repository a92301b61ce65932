"""The one way pagedq runs a server-side script (wire/lua/), on any redis-py client: sync or
asyncio, a single Redis or a cluster, directly or queued on a pipeline.

A script's arguments are a ``ScriptCall``: a dataclass per script (its fields are the
script's inputs, named and typed) that builds its own KEYS and ARGV (``keys_args``) and
parses its own reply (``parse``). The calls live beside the scripts' contract: wire/scripts.py
(the clients'), wire/worker_scripts.py, wire/batch_scripts.py, wire/gateway_scripts.py.

Every call is a plain EVALSHA of the script's text (its sharded text on a cluster: SPUBLISH,
pagedq.wire.lua.sharded). Called directly (``run``, ``run_async``), a NOSCRIPT reply (Redis
restarted, flushed its script cache, or a new cluster master) loads the script and sends it
again. Queued on a pipeline (``queue``), the NOSCRIPT reply is the caller's: ``noscript``
tells it, ``load`` loads the scripts, and the caller sends its pipeline again (``pipelined``
does all of that for a pipeline of calls alone). Every pagedq script may be sent again: each
is fenced (attempt, lease) or idempotent (by job id and body, by status). redis-py's own
Script objects are not used: they send SCRIPT EXISTS before every pipeline that runs one,
one more round trip, and a cluster pipeline refuses them.
"""
from __future__ import annotations

from collections.abc import Iterable
from typing import Any, ClassVar

import redis
import redis.asyncio

from . import lua
from .connection import RETRYABLE, is_cluster


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
    cluster = is_cluster(r)
    keys, args = call.keys_args()
    try:
        reply = r.evalsha(lua.sha(call.SCRIPT, cluster), len(keys), *keys, *args)
    except redis.exceptions.NoScriptError:
        r.script_load(lua.text(call.SCRIPT, cluster))
        reply = r.evalsha(lua.sha(call.SCRIPT, cluster), len(keys), *keys, *args)
    return call.parse(reply)


async def run_async(r: Any, call: ScriptCall) -> Any:
    """``run`` on an asyncio client."""
    cluster = is_cluster(r)
    keys, args = call.keys_args()
    try:
        reply = await r.evalsha(lua.sha(call.SCRIPT, cluster), len(keys), *keys, *args)
    except redis.exceptions.NoScriptError:
        await r.script_load(lua.text(call.SCRIPT, cluster))
        reply = await r.evalsha(lua.sha(call.SCRIPT, cluster), len(keys), *keys, *args)
    return call.parse(reply)


def queue(pipe: Any, call: ScriptCall) -> None:
    """Queue ``call`` on a pipeline (sync or asyncio, plain or cluster) as a bare EVALSHA.
    Its reply comes back with the pipeline's (``call.parse`` it, or ``results``). Nothing
    to await: on an asyncio cluster pipeline, awaiting would empty its queue."""
    keys, args = call.keys_args()
    pipe.execute_command("EVALSHA", lua.sha(call.SCRIPT, _cluster_pipe(pipe)), len(keys),
                         *keys, *args)


def results(calls: Iterable[ScriptCall], replies: list[Any]) -> list[Any]:
    """Each call's parsed reply, in order; an exception in its place where Redis answered an
    error or the reply stands for one (``parse`` raised it)."""
    out: list[Any] = []
    for call, reply in zip(calls, replies, strict=True):
        if isinstance(reply, Exception):
            out.append(reply)
            continue
        try:
            out.append(call.parse(reply))
        except Exception as e:  # noqa: BLE001 - handed back in the reply's place
            out.append(e)
    return out


def noscript(replies: list[Any]) -> bool:
    """Did a pipeline (executed with raise_on_error=False) meet an unloaded script?"""
    return any(isinstance(x, redis.exceptions.NoScriptError) for x in replies)


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
    """SCRIPT LOAD the scripts ``names`` on the sync client ``r`` (on a cluster: on every
    master, where redis-py sends SCRIPT LOAD; a replica promoted by a failover may lack
    them)."""
    cluster = is_cluster(r)
    texts = [lua.text(n, cluster) for n in dict.fromkeys(names)]
    if cluster:
        for t in texts:
            r.script_load(t)
        return
    pipe = r.pipeline(transaction=False)
    for t in texts:
        pipe.script_load(t)
    pipe.execute()


def pipelined(r: Any, calls: list[ScriptCall]) -> list[Any]:
    """``calls`` in one pipeline on a sync client: ``results``. After a NOSCRIPT reply the
    scripts are loaded and the pipeline sent again; a connection-level failure is raised
    (the caller's retry loop sends it all again)."""
    for _ in range(2):
        with r.pipeline(transaction=False) as pipe:
            for call in calls:
                queue(pipe, call)
            replies = pipe.execute(raise_on_error=False)
        if not noscript(replies):
            break
        load(r, (c.SCRIPT for c in calls))
    raise_retryable(replies)
    return results(calls, replies)


async def pipelined_async(r: Any, calls: list[ScriptCall]) -> list[Any]:
    """``pipelined`` on an asyncio client."""
    cluster = is_cluster(r)
    for _ in range(2):
        async with r.pipeline(transaction=False) as pipe:
            for call in calls:
                queue(pipe, call)
            replies = await pipe.execute(raise_on_error=False)
        if not noscript(replies):
            break
        for name in dict.fromkeys(c.SCRIPT for c in calls):
            await r.script_load(lua.text(name, cluster))
    raise_retryable(replies)
    return results(calls, replies)
