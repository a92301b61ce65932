"""Dead letters: reading ``{P}:dlq:<model>:<lane>`` and requeueing an entry as a NEW job.

An entry (written by REJECT, wire/lua/reject.lua) holds ``entry`` (the jobs-stream entry
id), ``job`` (its job id; '' when the entry named no usable one), ``reason``, ``body`` (the
first BODY_CHARS characters of the entry's body, bytes as they came), ``deliveries`` and
``at`` (the worker's clock).

Requeue rules (docs/protocol.md "Requeueing a dead letter"):

* Every job ends with exactly one result, and the dead job's final event exists: its id is
  never reopened. The stored request is submitted again as a new job ``<job>.r<k>``, k one
  more than the dead job's own ``.r<k>`` suffix (1 if it has none), or the next k whose id
  is not taken by another request.
* It goes through SUBMIT (``Client.submit_request``): validation, lanes, caps, counters
  and idempotency as for any job.
* Its metadata says where it came from: ``pagedq.requeued_from`` = the dead job's id,
  ``pagedq.dlq_entry`` = ``<model>:<lane>:<DLQ entry id>``. This makes the body, so its
  req_hash, unique to the DLQ entry: a requeue cut off between its SUBMIT and its XDEL,
  run again, meets its own job (``exists``) and goes on to the XDEL: never a second job.
* The DLQ entry is XDELed only after SUBMIT accepted the new job.
* Nothing is submitted and the entry stays when the stored request is not complete and
  valid (truncated, not UTF-8, not JSON, invalid, naming another job, model or lane) or
  cannot carry the origin (metadata full, derived id over 128 characters).
"""
from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis
from pydantic import ValidationError

from pagedq.wire.connection import connect
from pagedq.wire.errors import InvalidRequest, JobConflict, PagedqError
from pagedq.wire.keys import JOB_ID_RE, Keys, check_job_id
from pagedq.wire.schema import JobRequest, describe
from pagedq.wire.settings import Settings

# The worker keeps this many characters of a dead-lettered body (worker/admission.py
# DLQ_BODY_CHARS; tests/test_inspect.py checks that they agree).
BODY_CHARS = 4096
REQUEUED_FROM = "pagedq.requeued_from"
DLQ_ENTRY = "pagedq.dlq_entry"
ID_TRIES = 16  # derived ids tried (.r<k>, .r<k+1>, ...) before giving up
ENTRY_ID_RE = re.compile(r"^\d+-\d+$")
_SUFFIX_RE = re.compile(r"^(.+)\.r(\d+)$")


class NotRequeueable(InvalidRequest):
    """The entry's stored request cannot be submitted again as it is; ``code`` names why
    (no_job, not_utf8, truncated, not_json, invalid, mismatch, metadata_full,
    id_too_long, ids_taken)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class DeadEntryNotFound(PagedqError, KeyError):
    """No DLQ entry has that entry id or job id (in the streams looked at)."""


def admin_redis(settings: Settings, url: str) -> redis.Redis:
    """A connection (the settings' credentials and TLS) for reading DLQ and jobs streams:
    bodies that are not UTF-8 arrive with surrogate escapes (as the worker reads them)
    instead of failing the reply."""
    return connect(settings, url, decode_responses=True, encoding_errors="surrogateescape",
                   socket_timeout=30)


def redis_now(r: redis.Redis) -> float:
    sec, usec = r.time()
    return sec + usec / 1e6


def clean(s: str) -> str:
    """Text safe to print: undecodable bytes (surrogate escapes) become U+FFFD."""
    return s.encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _float(x: str | None) -> float | None:
    try:
        return float(x) if x else None
    except ValueError:
        return None


@dataclass(frozen=True, slots=True)
class DeadEntry:
    model: str
    lane: str
    id: str  # the DLQ stream entry id
    job: str
    reason: str
    body: str
    deliveries: int | None
    at: float | None
    entry: str  # its id in the jobs stream it came from
    partition: int = 0  # the key space of its DLQ stream (wire/keys.py)

    @classmethod
    def of(cls, model: str, lane: str, eid: str, f: dict[str, str],
           partition: int = 0) -> DeadEntry:
        d = _float(f.get("deliveries"))
        return cls(model, lane, eid, f.get("job", ""), f.get("reason", ""), f.get("body", ""),
                   None if d is None else int(d), _float(f.get("at")), f.get("entry", ""),
                   partition)

    def problem(self) -> NotRequeueable | None:
        try:
            request_of(self)
        except NotRequeueable as e:
            return e
        return None

    def to_json(self, now: float, body: bool = False) -> dict[str, Any]:
        p = self.problem()
        out = {"model": self.model, "lane": self.lane, "id": self.id, "job": clean(self.job),
               "reason": clean(self.reason), "deliveries": self.deliveries,
               "age_s": None if self.at is None else round(now - self.at, 3),
               "entry": self.entry, "requeueable": p is None,
               "problem": None if p is None else p.code}
        if self.partition:  # (absent: partition 0, the only one of most deployments)
            out["partition"] = self.partition
        if body:
            out["body"] = clean(self.body)
        return out


def read(r: redis.Redis, keys: Keys, model: str, lane: str,
         count: int | None = None) -> list[DeadEntry]:
    """Newest first; ``count``: at most that many (of ``keys``' partition)."""
    return [DeadEntry.of(model, lane, eid, f, keys.partition)
            for eid, f in r.xrevrange(keys.dlq(model, lane), count=count)]


def _all(r: redis.Redis, keys: Keys, model: str, lane: str) -> Iterator[DeadEntry]:
    """Every entry, oldest first, in pages (a DLQ is bounded by its retention only)."""
    start = "-"
    while page := r.xrange(keys.dlq(model, lane), start, "+", count=1000):
        for eid, f in page:
            yield DeadEntry.of(model, lane, eid, f, keys.partition)
        start = "(" + page[-1][0]


def find(r: redis.Redis, keys: Keys | tuple[Keys, ...], streams: list[tuple[str, str]],
         ident: str) -> DeadEntry:
    """The one entry ``ident`` names among the DLQ streams ``streams`` ((model, lane)) of
    ``keys`` (a key space, or several: every partition): read as a DLQ entry id when it
    has that form (``<ms>-<seq>``, as ``dlq list`` prints) and such an entry exists, else
    as a job id. Several matches: InvalidRequest (narrow with --model/--lane, or give the
    entry id)."""
    spaces = (keys,) if isinstance(keys, Keys) else keys
    if ENTRY_ID_RE.match(ident):
        hits = [DeadEntry.of(m, lane, eid, f, k.partition) for k in spaces for m, lane in streams
                for eid, f in r.xrange(k.dlq(m, lane), ident, ident)]
        if len(hits) == 1:
            return hits[0]
        if len(hits) > 1:
            where = ", ".join(f"{h.model}:{h.lane}" for h in hits)
            raise InvalidRequest(f"DLQ entry {ident} is in several DLQ streams ({where}); "
                                 "choose with --model/--lane")
    elif not JOB_ID_RE.match(ident):
        check_job_id(ident)  # ValueError: neither an entry id nor a job id
    hits = [e for k in spaces for m, lane in streams for e in _all(r, k, m, lane)
            if e.job == ident]
    if not hits:
        raise DeadEntryNotFound(f"no dead-letter entry with entry id or job id {ident}")
    if len(hits) > 1:
        ids = ", ".join(f"{h.id} ({h.model}:{h.lane})" for h in hits)
        raise InvalidRequest(f"job {ident} has {len(hits)} dead-letter entries: {ids}; "
                             "give the entry id")
    return hits[0]


def request_of(e: DeadEntry) -> dict[str, Any]:
    """The request to submit again (without its new id), or NotRequeueable."""
    if not e.job or not JOB_ID_RE.match(e.job):
        raise NotRequeueable("no_job", "the dead entry names no usable job id: there is no "
                                       "job to requeue")
    try:
        e.body.encode("utf-8")
    except UnicodeEncodeError:
        raise NotRequeueable("not_utf8", "the stored body is not valid UTF-8") from None
    try:
        data = json.loads(e.body)
    except (json.JSONDecodeError, RecursionError):
        if len(e.body) >= BODY_CHARS:
            raise NotRequeueable("truncated", f"the stored body is incomplete (the DLQ keeps "
                                 f"its first {BODY_CHARS} characters): submit the job again "
                                 "from its source") from None
        raise NotRequeueable("not_json", "the stored body is not JSON") from None
    if not isinstance(data, dict):
        raise NotRequeueable("not_json", "the stored body is not a JSON object")
    try:
        req = JobRequest.model_validate(data)
    except ValidationError as err:
        raise NotRequeueable("invalid", "the stored request is invalid: "
                             + describe(err, 3)) from None
    if req.id is not None and req.id != e.job:
        raise NotRequeueable("mismatch", f"the stored body names job {req.id}, the entry "
                                         f"job {e.job}")
    # as the worker reads an entry (worker/jobs.py parse_entry): a body without a lane
    # belongs to the stream's lane, and the new job is submitted to that lane
    if req.model != e.model or req.lane not in (None, e.lane):
        raise NotRequeueable("mismatch", f"the stored body is for {req.model}:"
                             f"{req.lane or e.lane}, not this DLQ's {e.model}:{e.lane}")
    out = req.model_dump(exclude_none=True)
    out["lane"] = e.lane
    meta = {**out.get("metadata", {}), REQUEUED_FROM: e.job,
            DLQ_ENTRY: f"{e.model}:{e.lane}:{e.id}"}
    limit = next(m.max_length for m in JobRequest.model_fields["metadata"].metadata
                 if hasattr(m, "max_length"))
    if len(meta) > limit:
        raise NotRequeueable("metadata_full", f"its metadata has no room for {REQUEUED_FROM} "
                             f"and {DLQ_ENTRY} (at most {limit} entries)")
    out["metadata"] = meta
    next(new_ids(e.job))  # NotRequeueable when even the first is too long
    return out


def new_ids(job_id: str) -> Iterator[str]:
    """The ids a requeue of ``job_id`` tries, in order: ``<base>.r<k+1>``, ... where
    ``job_id`` is ``<base>.r<k>`` (k = 0 and base = job_id without such a suffix)."""
    m = _SUFFIX_RE.match(job_id)
    base, k = (m[1], int(m[2])) if m else (job_id, 0)
    for i in range(k + 1, k + 1 + ID_TRIES):
        new = f"{base}.r{i}"
        if len(new) > 128:
            raise NotRequeueable("id_too_long", f"job id {job_id} is too long to derive a "
                                                f"requeue id from ({new}: over 128 characters)")
        yield new


def requeue(client: Any, r: redis.Redis, keys: Keys, e: DeadEntry) -> str:
    """Submit the entry's request as a new job through ``client`` (a producer Client),
    then delete the entry; returns the new job id (see the module docstring)."""
    try:
        req = request_of(e)
    except NotRequeueable as err:  # the message names the entry (one line per ID)
        raise NotRequeueable(err.code, f"DLQ entry {e.id} ({e.model}:{e.lane}, job "
                                       f"{clean(e.job) or '-'}) not requeued: {err}") from None
    for new_id in new_ids(e.job):
        try:
            client.submit_request({**req, "id": new_id})
        except JobConflict:  # that id belongs to another request: try the next one
            continue
        # 0 if a concurrent requeue got there first
        r.xdel(keys.part(e.partition).dlq(e.model, e.lane), e.id)
        return new_id
    raise NotRequeueable("ids_taken", f"job ids {e.job}.r<k> are taken by other requests "
                                      f"({ID_TRIES} tried)")
