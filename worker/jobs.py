"""Turning a jobs-stream entry into engine input (validation at the boundary), and the
state of a job this worker owns.

A job of ``n`` choices runs as n engine requests: ``uid`` when n == 1, else ``uid#k``
for choice k (the engine aborts ``uid`` and every ``uid#k`` together); a job's uid is its
record's key, ``{prefix}:job:<id>`` (job ids are unique only within a tenant's prefix).
"""
from __future__ import annotations

import io
import json
from dataclasses import dataclass, field
from typing import Any

import redis
from pydantic import ValidationError

from pagedq.engine.outputs import FinishReason as EngineReason
from pagedq.engine.sampling_params import SamplingParams
from pagedq.wire.connection import is_cluster
from pagedq.wire.guided import GuidedSpec
from pagedq.wire.keys import JOB_ID_RE, Keys
from pagedq.wire.sampling import fan_out, sample_id
from pagedq.wire.schema import (
    SCHEMA_VERSION,
    FinishReason,
    JobRequest,
    clean_logprob,
    describe,
)
from pagedq.wire.settings import Settings


@dataclass(frozen=True, slots=True)
class WorkerIdentity:
    """What every part of a worker knows of it: its Redis, the key spaces it serves
    (``tenants``: every partition of every tenant prefix, prefix by prefix, partition 0
    first; ``keys`` is the first), settings, the model it serves, its lanes (highest
    first) and its consumer name. Its jobs streams: one per key space and lane. A
    single-prefix worker of one partition is the case of one key space."""

    r: redis.Redis
    keys: Keys
    settings: Settings
    model: str
    worker_id: str
    tenants: tuple[Keys, ...] = ()  # () = (keys,)

    def __post_init__(self) -> None:
        if not self.tenants:
            object.__setattr__(self, "tenants", (self.keys,))

    @property
    def lanes(self) -> tuple[str, ...]:
        return self.settings.lanes

    @property
    def cluster(self) -> bool:
        """On a Redis Cluster no command may name keys of two key spaces (two slots)."""
        return is_cluster(self.r)

    def stream(self, lane: str, keys: Keys) -> str:
        return keys.jobs(self.model, lane)

    @property
    def streams(self) -> list[str]:
        """Every jobs stream served, lane by lane (highest first), tenants in order."""
        return [k.jobs(self.model, lane) for lane in self.lanes for k in self.tenants]


class BadEntry(ValueError):
    """An entry that can never run; ``job_id`` is set when it names a usable job id."""

    def __init__(self, reason: str, job_id: str = "") -> None:
        super().__init__(reason)
        self.job_id = job_id


@dataclass(slots=True)
class ChoiceState:
    # the text so far: a buffer, not a list of deltas (the garbage collector would visit
    # every element of every running job's list at each full collection: engine/sequence.py)
    text: io.StringIO = field(default_factory=io.StringIO)
    num_tokens: int = 0  # resumed + generated
    resumed_ids: list[int] = field(default_factory=list)  # replayed from an earlier attempt
    finish_reason: FinishReason | str | None = None  # a replayed one: as an attempt wrote it


@dataclass(slots=True)
class Job:
    """A job this worker owns (running in the engine). ``keys``: its tenant's key scheme;
    job ids are unique only within a tenant, so the worker knows a job by ``uid``."""

    job_id: str
    entry_id: str
    attempt: int
    n: int  # choices (JobRequest.n); the request is not kept past admission (engine/sequence.py)
    lane: str
    keys: Keys
    deadline: float | None = None
    prompt_tokens: int = 0
    choices: list[ChoiceState] = field(default_factory=list)
    admitted_at: float = 0.0  # time.monotonic() at admission
    queue_wait_s: float = 0.0  # submission to admission (Redis clock)
    first_token_at: float | None = None  # time.monotonic() of its first token
    last_token_at: float | None = None

    def __post_init__(self) -> None:
        if not self.choices:
            self.choices = [ChoiceState() for _ in range(self.n)]

    @property
    def seats(self) -> int:
        """Engine requests this job holds now (its unfinished choices)."""
        return sum(c.finish_reason is None for c in self.choices)

    @property
    def uid(self) -> str:
        """The job's name inside the worker (its table of jobs, engine request ids, the
        publisher): its record's key, unique across tenants."""
        return self.keys.job(self.job_id)

    def request_id(self, k: int) -> str:
        """Choice k's engine request id (``fan_out``'s)."""
        return sample_id(self.uid, k, self.n)

    @property
    def done(self) -> bool:
        return all(c.finish_reason is not None for c in self.choices)

    @property
    def completion_tokens(self) -> int:
        return sum(c.num_tokens for c in self.choices)

    @property
    def text(self) -> str:
        return self.choices[0].text.getvalue()

    def finish_reason(self) -> FinishReason:
        return self.choices[0].finish_reason or FinishReason.stop

    def choices_json(self) -> list[dict[str, Any]] | None:
        """The final event's ``choices`` (n > 1 only)."""
        if self.n == 1:
            return None
        return [{"index": k, "text": c.text.getvalue(), "finish_reason": c.finish_reason or "",
                 "completion_tokens": c.num_tokens} for k, c in enumerate(self.choices)]


# the engine's reasons (engine/outputs.py) as the wire's: the same words, and an aborted
# request (never reported by the engine's step) would be a cancelled one
_WIRE_REASON = {EngineReason.stop: FinishReason.stop, EngineReason.length: FinishReason.length,
                EngineReason.abort: FinishReason.cancelled}


def finish_reason_of(engine_reason: EngineReason | None) -> FinishReason:
    """The wire's finish reason of an engine request that ended (stop when unsaid)."""
    return _WIRE_REASON.get(engine_reason, FinishReason.stop)


def parse_entry(fields: dict[str, str], model: str, lane: str) -> JobRequest:
    """Validate a raw stream entry. Raises BadEntry with a reason a user can act on.

    The worker's connection decodes with ``surrogateescape``: bytes that are not UTF-8
    arrive as lone surrogates, so an undecodable entry is refused here, never raised."""
    job_id = fields.get("job", "")
    if not (isinstance(job_id, str) and JOB_ID_RE.match(job_id)):
        job_id = ""
    body = fields.get("body")
    if body is None:
        raise BadEntry("malformed entry: no 'body' field", job_id)
    version = fields.get("v")  # (an entry without it: version 1, as before it was written)
    if version is not None and version != str(SCHEMA_VERSION):
        raise BadEntry(f"unknown schema version {version[:32]!r}: this worker reads version "
                       f"{SCHEMA_VERSION}", job_id)
    try:
        body.encode("utf-8")
    except UnicodeEncodeError:
        raise BadEntry("malformed entry: body is not valid UTF-8", job_id) from None
    try:
        data = json.loads(body)
    except json.JSONDecodeError as e:
        raise BadEntry(f"malformed entry: body is not JSON ({e.msg})", job_id) from None
    except RecursionError:
        raise BadEntry("malformed entry: body is nested too deeply", job_id) from None
    if not isinstance(data, dict):
        raise BadEntry("malformed entry: body is not a JSON object", job_id)
    try:
        req = JobRequest.model_validate(data)
    except ValidationError as e:
        raise BadEntry(f"invalid request: {describe(e, 5)}", job_id) from None
    if not job_id:
        raise BadEntry("malformed entry: missing or invalid 'job' id", "")
    if req.id is not None and req.id != job_id:
        raise BadEntry("malformed entry: body id differs from the entry's job id", job_id)
    if req.model != model:
        raise BadEntry(f"malformed entry: body model {req.model!r} differs from the stream's "
                       f"model {model!r}", job_id)
    if req.lane is not None and req.lane != lane:
        raise BadEntry(f"malformed entry: body lane {req.lane!r} differs from the stream's "
                       f"lane {lane!r}", job_id)
    return req


def engine_requests(job: Job, req: JobRequest,
                    guided: GuidedSpec | None = None) -> list[tuple[str, SamplingParams]]:
    """The engine requests of a job's choices (``fan_out``: ids, n = 1 each, choice k of a
    seeded job drawing from ``sample_seed(seed, k)``, as the offline engine's samples): the
    request's sampling fields (one declaration, wire/sampling.py; validated with the
    request). ``guided``: the job's output spec (``req.output_spec()``: its own, or its
    tools'), made once per job and compiled by the engine at add_request (a ValueError there
    fails the job)."""
    return fan_out(job.uid, SamplingParams.of_request(req, guided=guided))


def logprobs_json(lps: list[Any], token_text) -> list[dict[str, Any]]:
    """Engine TokenLogprobs -> the wire's ``lp`` (and ``plp``) entries (docs/protocol.md):
    ``{"id", "token", "logprob", "rank", "top": [{"id", "token", "logprob"}]}``; a prompt's
    first token has ``logprob`` and ``rank`` null (engine/prompt_logprobs.py)."""
    return [{"id": lp.token_id, "token": token_text(lp.token_id),
             "logprob": None if lp.logprob is None else clean_logprob(lp.logprob),
             "rank": lp.rank,
             "top": [{"id": t, "token": token_text(t), "logprob": clean_logprob(v)}
                     for t, v in lp.top]} for lp in lps]
