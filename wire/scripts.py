"""The producer's side of the wire: the Lua scripts it runs (their KEYS/ARGV contract and
reply decoding) and request preparation, shared by Client and AsyncClient.

Both clients (sync and asyncio) call these scripts through redis-py ``Script`` objects
(EVALSHA with a NOSCRIPT fallback). The scripts live in wire/lua/ (one loader); a
non-Python producer EVALs the same text with the same KEYS/ARGV (docs/protocol.md).

All KEYS of one call share one partition's hash tag (wire/keys.py): a job's call is
built with the keys of the partition its id names (``partition_of``), so each script
touches one Redis Cluster slot. CANCEL derives the queued-tokens key from the job's
stored model (``ARGV[4] .. model``); it is in the same slot as the declared keys.

On a cluster client a pipeline is split per node and redis-py's Script objects cannot
queue on it: ``queue_script`` sends a plain EVALSHA there, and ``pipelined`` loads the
script and sends the pipeline again after a NOSCRIPT reply (every producer script may be
repeated: SUBMIT is idempotent by id and body, CANCEL by status).
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio

from . import lua
from .connection import RETRYABLE, is_cluster
from .errors import InvalidRequest, JobConflict, JobNotFound, NoWorker, Overloaded
from .keys import DEFAULT_LANE, GROUP, Keys, partition_of
from .schema import SCHEMA_VERSION, JobRequest
from .settings import Settings

# The scripts' text: wire/lua/*.lua (KEYS, ARGV and replies in each file's header).
SUBMIT_LUA = lua.source("submit")
CANCEL_LUA = lua.source("cancel")
SERVED_LUA = lua.source("served")


@dataclass(frozen=True, slots=True)
class Scripts:
    submit: Any  # redis.commands.core.Script or AsyncScript
    cancel: Any
    served: Any


def register(r: Any) -> Scripts:
    """Register the scripts on a sync or asyncio redis client (no round trip); on a
    cluster client their sharded texts (SPUBLISH: pagedq.wire.lua.sharded)."""
    text = lua.sharded if is_cluster(r) else str
    return Scripts(submit=r.register_script(text(SUBMIT_LUA)),
                   cancel=r.register_script(text(CANCEL_LUA)),
                   served=r.register_script(text(SERVED_LUA)))


def queue_script(pipe: Any, script: Any, keys: list[str], args: list[str]) -> Any:
    """Queue ``script`` (a redis-py Script or AsyncScript) on ``pipe``: through the Script
    on a plain pipeline (it loads missing scripts before executing), as a bare EVALSHA on
    a cluster pipeline (redis-py refuses Script objects there). Returns what the
    pipeline's call returns on a plain pipeline (an awaitable on an asyncio one: await
    it), None on a cluster pipeline: its call returns the pipeline itself, and awaiting
    an asyncio cluster pipeline empties its queue (nothing would be sent)."""
    if isinstance(pipe, redis.client.Pipeline | redis.asyncio.client.Pipeline):
        return script(keys, args, client=pipe)
    pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *args)
    return None


def noscript(replies: list[Any]) -> bool:
    return any(isinstance(x, redis.exceptions.NoScriptError) for x in replies)


def pipelined(r: Any, script: Any, calls: list[tuple[list[str], list[str]]]) -> list[Any]:
    """One pipeline of ``script`` calls on a sync client (KEYS, ARGV each), replies in
    order (errors as exceptions); after a NOSCRIPT reply (a cluster node without the
    script: a new or restarted master) the script is loaded and the pipeline sent again."""
    for _ in range(2):
        with r.pipeline(transaction=False) as pipe:
            for keys, args in calls:
                queue_script(pipe, script, keys, args)
            replies = pipe.execute(raise_on_error=False)
        if not noscript(replies):
            break
        r.script_load(script.script)
    raise_retryable(replies)
    return replies


def raise_retryable(replies: list[Any]) -> None:
    """Raise the first connection-level failure among a pipeline's replies: a cluster
    pipeline run with raise_on_error=False returns them where a plain one raises, and the
    caller's retry loop resends the whole pipeline (every call in it may be repeated)."""
    for x in replies:
        if isinstance(x, RETRYABLE):
            raise x


def served_call(keys: Keys) -> tuple[list[str], list[str]]:
    """Partition 0's models and serving sets (the workers' heartbeats write every
    partition's, so one is enough)."""
    keys = keys.home
    return [keys.models], [keys.base]


def served_reply(reply: Any) -> dict[str, int]:
    pairs = list(reply or [])
    return {_s(m): int(n) for m, n in zip(pairs[::2], pairs[1::2], strict=True) if int(n) > 0}


def req_hash(body: str) -> str:
    return hashlib.sha256(body.encode()).hexdigest()


def queued_tokens_of(req: JobRequest) -> int:
    """The backpressure weight of a job: prompt chars / 4 (rough tokens) + max_tokens."""
    if isinstance(req.prompt, list):
        return len(req.prompt) + req.max_tokens
    chars = len(req.prompt) if req.prompt is not None else sum(
        len(m.content) for m in req.messages or [])
    return chars // 4 + req.max_tokens


def lane_of(req: JobRequest, settings: Settings) -> str:
    """The request's lane; InvalidRequest unless the deployment has it (settings.lanes):
    a job on a lane no worker reads would wait for ever."""
    lane = req.lane or DEFAULT_LANE
    if lane not in settings.lanes:
        raise InvalidRequest(f"lane {lane!r} is not one of this deployment's lanes "
                             f"({','.join(settings.lanes)}; PAGEDQ_LANES)")
    return lane


def submit_call(keys: Keys, req: JobRequest, settings: Settings, require_worker: bool = False,
                batch: tuple[str, str] | None = None) -> tuple[list[str], list[str]]:
    """KEYS and ARGV of SUBMIT_LUA for a validated request that has an id, in the
    partition its id names (``keys``: any partition of the tenant). ``batch`` = (batch
    id, item): the job counts itself on that batch's record as it ends and pushes
    ``item`` on the batch's done list (wire/lua/common.lua, count_in_batch); the
    batch's record must be in the job's partition (ValueError otherwise)."""
    if req.id is None:
        raise ValueError("submit_call needs a request with an id")
    n = settings.partitions
    keys = keys.of_job(req.id, n)
    if batch is not None and partition_of(batch[0], n) != keys.partition:
        raise ValueError(f"job {req.id} is not in the partition of its batch {batch[0]}")
    lane = lane_of(req, settings)
    body = req.body_json()
    m = req.model
    ks = [keys.job(req.id), keys.jobs(m, lane), keys.queued_tokens(m, lane), keys.out(req.id),
          keys.queued_jobs(m, lane), keys.serving(m), keys.models]
    args = [req.id, body, req_hash(body), m, str(queued_tokens_of(req)),
            "" if req.timeout_s is None else str(float(req.timeout_s)),
            str(settings.max_queued_jobs), str(settings.max_queued_tokens), GROUP,
            str(SCHEMA_VERSION), "1" if require_worker else "0", lane]
    if batch is not None:
        ks += [keys.batch(batch[0]), keys.batch_done(batch[0])]
        args.append(batch[1])
    return ks, args


def check_submit_reply(reply: Any, job_id: str) -> str:
    """Return the job id, or raise the typed error the script's reply stands for."""
    kind = _s(reply[0])
    if kind in ("queued", "exists"):
        return job_id
    if kind == "conflict":
        raise JobConflict(f"job id {job_id!r} already exists with a different request body")
    if kind == "overloaded":
        cap, limit, cur = (_s(x) for x in reply[1:4])
        raise Overloaded(f"queue is full: {cap}={limit} (currently {cur}); retry later")
    if kind == "invalid":
        raise InvalidRequest(f"submit refused: {_s(reply[1])}")
    if kind == "no_worker":
        raise NoWorker(f"no live worker serves model {_s(reply[1])!r}; nothing was enqueued")
    raise RuntimeError(f"unexpected submit script reply {reply!r}")


def cancel_call(keys: Keys, job_id: str, settings: Settings) -> tuple[list[str], list[str]]:
    keys = keys.of_job(job_id, settings.partitions)
    return ([keys.job(job_id), keys.out(job_id), keys.cancel],
            [job_id, str(settings.result_ttl_s), keys.chan(job_id), keys.queued_tokens_prefix,
             keys.queued_jobs_prefix])


def check_cancel_reply(reply: Any, job_id: str) -> bool:
    kind = _s(reply)
    if kind == "missing":
        raise JobNotFound(job_id)
    return kind in ("cancelled", "requested")


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)
