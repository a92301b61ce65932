"""The clients' scripts (submit, cancel, served: wire/lua/*.lua, KEYS/ARGV and replies in
each file's header) as calls, and what a submit computes from a request. Shared by Client,
AsyncClient, the batch ingest and the gateway; run through pagedq.wire.script. A producer
in another language EVALs the same text with the same KEYS/ARGV (docs/protocol.md).

All KEYS of one call share one partition's hash tag (wire/keys.py): a job's call is
built with the keys of the partition its id names (``partition_of``), so each script
touches one Redis Cluster slot. CANCEL derives the queued-tokens key from the job's
stored model (``ARGV[4] .. model``); it is in the same slot as the declared keys. Every
one of them may be sent again: SUBMIT is idempotent by id and body, CANCEL by status.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any

from .errors import InvalidRequest, JobConflict, JobNotFound, NoWorker, Overloaded
from .keys import DEFAULT_LANE, GROUP, Keys, partition_of
from .schema import SCHEMA_VERSION, JobRequest
from .script import ScriptCall
from .settings import Settings


@dataclass(frozen=True, slots=True)
class Served(ScriptCall):
    """SERVED: partition 0's models and serving sets (the workers' heartbeats write every
    partition's, so one is enough) -> {model: live workers}, models with none left out."""

    SCRIPT = "served"
    keys: Keys

    def keys_args(self) -> tuple[list[str], list[Any]]:
        home = self.keys.home
        return [home.models], [home.base]

    def parse(self, reply: Any) -> dict[str, int]:
        pairs = list(reply or [])
        return {_s(m): int(n) for m, n in zip(pairs[::2], pairs[1::2], strict=True)
                if int(n) > 0}


def req_hash(body: str) -> str:
    """The request hash SUBMIT stores and checks: the hex SHA-1 of the body's bytes (what
    the script itself computes, ``redis.sha1hex``: a Lua SHA-256 would stall Redis on a
    megabyte body)."""
    return hashlib.sha1(body.encode()).hexdigest()


def queued_tokens_of(req: JobRequest) -> int:
    """The backpressure weight of a job: prompt chars / 4 (rough tokens) + max_tokens; a
    chat's characters are its contents', its tool calls' arguments' and its tools' JSON."""
    if isinstance(req.prompt, list):
        return len(req.prompt) + req.max_tokens
    if req.prompt is not None:
        return len(req.prompt) // 4 + req.max_tokens
    chars = sum(len(m.text) + sum(len(c.function.arguments) for c in m.tool_calls or ())
                for m in req.messages or [])
    if req.tools:
        chars += sum(len(t.model_dump_json(exclude_none=True)) for t in req.tools)
    return chars // 4 + req.max_tokens


def lane_of(req: JobRequest, settings: Settings) -> str:
    """The request's lane; InvalidRequest unless the deployment has it (settings.lanes):
    a job on a lane no worker reads would wait for ever."""
    lane = req.lane or DEFAULT_LANE
    if lane not in settings.lanes:
        raise InvalidRequest(f"lane {lane!r} is not one of this deployment's lanes "
                             f"({','.join(settings.lanes)}; PAGEDQ_LANES)")
    return lane


@dataclass(frozen=True, slots=True)
class Submit(ScriptCall):
    """SUBMIT of a validated request that has an id, in the partition its id names
    (``keys``: any partition of the tenant) -> the job id, or the typed error its reply
    stands for. ``batch`` = (batch id, item): the job counts itself on that batch's record
    as it ends and pushes ``item`` on the batch's done list (wire/lua/common.lua,
    count_in_batch); the batch's record must be in the job's partition (ValueError)."""

    SCRIPT = "submit"
    keys: Keys
    req: JobRequest
    settings: Settings
    require_worker: bool = False
    batch: tuple[str, str] | None = None

    def __post_init__(self) -> None:  # refused before anything is sent
        if self.req.id is None:
            raise ValueError("a submit needs a request with an id")
        n = self.settings.partitions
        if self.batch is not None and partition_of(self.batch[0], n) != partition_of(
                self.req.id, n):
            raise ValueError(f"job {self.req.id} is not in the partition of its batch "
                             f"{self.batch[0]}")
        lane_of(self.req, self.settings)

    def keys_args(self) -> tuple[list[str], list[Any]]:
        req, settings = self.req, self.settings
        keys = self.keys.of_job(req.id, settings.partitions)
        lane = lane_of(req, settings)
        body = req.body_json()
        m = req.model
        ks = [keys.job(req.id), keys.inbox(m, lane), keys.queued_tokens(m, lane),
              keys.out(req.id), keys.queued_jobs(m, lane), keys.serving(m), keys.models,
              keys.wake(m)]
        args = [req.id, body, req_hash(body), m, str(queued_tokens_of(req)),
                "" if req.timeout_s is None else str(float(req.timeout_s)),
                str(settings.max_queued_jobs), str(settings.max_queued_tokens), GROUP,
                str(SCHEMA_VERSION), "1" if self.require_worker else "0", lane]
        if self.batch is not None:
            ks += [keys.batch(self.batch[0]), keys.batch_done(self.batch[0])]
            args.append(self.batch[1])
        return ks, args

    def parse(self, reply: Any) -> str:
        job_id = self.req.id
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


@dataclass(frozen=True, slots=True)
class Cancel(ScriptCall):
    """CANCEL -> True if cancelled (queued) or asked to stop (running), False if the job
    had already ended; JobNotFound if there is no such job."""

    SCRIPT = "cancel"
    keys: Keys
    job_id: str
    settings: Settings

    def keys_args(self) -> tuple[list[str], list[Any]]:
        keys = self.keys.of_job(self.job_id, self.settings.partitions)
        return ([keys.job(self.job_id), keys.out(self.job_id), keys.cancel],
                [self.job_id, str(self.settings.cancelled_ttl_s), keys.chan(self.job_id),
                 keys.queued_tokens_prefix, keys.queued_jobs_prefix])

    def parse(self, reply: Any) -> bool:
        kind = _s(reply)
        if kind == "missing":
            raise JobNotFound(self.job_id)
        return kind in ("cancelled", "requested")


def _s(x: Any) -> str:
    return x.decode() if isinstance(x, bytes) else str(x)
