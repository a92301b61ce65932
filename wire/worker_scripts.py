"""KEYS and ARGV of the worker's scripts (wire/lua/{start,publish,finish,reject,refresh,
expire_unserved}.lua), built in one place with typed arguments, so the worker never
lists them inline and a script's contract is written next to its header only once more.

Each function returns a ``Call`` (KEYS, ARGV) for ``pagedq.worker.lua.Script(...)(*call)``. Like
the producer's calls (wire/scripts.py), keys come from wire/keys.py.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any, NamedTuple

from .keys import GROUP, Keys


class Call(NamedTuple):
    keys: list[str]
    args: list[Any]


def start(keys: Keys, job_id: str, model: str, lane: str, worker_id: str,
          max_deliveries: int) -> Call:
    return Call([keys.job(job_id), keys.queued_tokens(model, lane),
                 keys.queued_jobs(model, lane)], [worker_id, model, max_deliveries])


@dataclass(frozen=True, slots=True)
class Started:
    """START's reply: ``kind`` ok | terminal | poison."""

    kind: str
    attempt: int = 0
    deadline: float | None = None
    status: str = ""  # terminal: the job's status; ok: the status it was started from
    queue_wait_s: float = 0.0
    attempts: int = 0  # poison: how often it was started

    @classmethod
    def parse(cls, reply: list[Any]) -> Started:
        kind = reply[0]
        if kind == "ok":
            return cls(kind, int(reply[1]), float(reply[2]) if reply[2] else None, reply[3],
                       float(reply[4]))
        if kind == "poison":
            return cls(kind, attempts=int(reply[1]))
        return cls(kind, status=reply[1])


def finish(keys: Keys, job_id: str, stream: str, entry_id: str, attempt: int, status: str,
           finish_reason: str, text: str, error: str, prompt_tokens: int,
           completion_tokens: int, index: int, now: float, result_ttl_s: int, maxlen: int,
           choices: list[dict[str, Any]] | None) -> Call:
    return Call([keys.job(job_id), keys.out(job_id), stream, keys.cancel],
                [attempt, status, finish_reason, text, error, prompt_tokens, completion_tokens,
                 index, result_ttl_s, entry_id, GROUP, job_id, keys.chan(job_id),
                 f"{now:.6f}", maxlen, json.dumps(choices) if choices else ""])


def reject(keys: Keys, model: str, lane: str, entry_id: str, reason: str, job_id: str,
           body: bytes, now: float, result_ttl_s: int, deliveries: int, dlq_ttl_s: int) -> Call:
    """``job_id`` '' when the entry names no usable job (no record is touched then)."""
    j = job_id or "_"
    return Call([keys.jobs(model, lane), keys.dlq(model, lane), keys.job(j), keys.out(j),
                 keys.queued_tokens(model, lane), keys.queued_jobs(model, lane)],
                [GROUP, entry_id, reason, job_id, body, f"{now:.6f}", result_ttl_s,
                 keys.chan(j), deliveries, dlq_ttl_s])


def refresh(keys: Keys, stream: str, worker_id: str,
            owned: list[tuple[str, str, int]]) -> Call:
    """``owned``: (job id, entry id, attempt) of the worker's jobs on ``stream``."""
    ks, args = [stream], [GROUP, worker_id]
    for job_id, entry_id, attempt in owned:
        ks.append(keys.job(job_id))
        args += [entry_id, attempt]
    return Call(ks, args)


def expire_unserved(keys: Keys, model: str, lane: str, unserved_timeout_s: float,
                    result_ttl_s: int, max_entries: int) -> Call:
    return Call([keys.jobs(model, lane), keys.serving(model), keys.queued_tokens(model, lane),
                 keys.queued_jobs(model, lane), keys.cancel],
                [keys.base, unserved_timeout_s, result_ttl_s, max_entries])


def event_keys(k: Keys, job_id: str) -> tuple[str, str, str]:
    """The names a job's token events touch: its record, its out stream, its channel."""
    return k.job(job_id), k.out(job_id), k.chan(job_id)


@dataclass(slots=True)
class Publish:
    """One PUBLISH call, built event by event: ``add`` one event per (job, choice), each
    with its job's keys (the jobs of one call may belong to several tenants' prefixes)."""

    maxlen: int
    idle_ttl_s: int
    call: Call = field(init=False)

    def __post_init__(self) -> None:
        self.call = Call([], [self.maxlen, self.idle_ttl_s])

    def add(self, k: Keys, job_id: str, attempt: int, index: int, delta: str,
            token_ids: list[int], logprobs: list[Any] | None, choice: int | None,
            finish_reason: str | None) -> None:
        self.add_named(event_keys(k, job_id), attempt, index, delta, token_ids, logprobs,
                       choice, finish_reason)

    def add_named(self, names: tuple[str, str, str], attempt: int, index: int, delta: str,
                  token_ids: list[int], logprobs: list[Any] | None, choice: int | None,
                  finish_reason: str | None) -> None:
        """``add`` with the job's ``event_keys`` built once by the caller (the publisher
        adds an event of every running job at every round)."""
        job_key, out_key, chan = names
        self.call.keys.extend((job_key, out_key))
        self.call.args.extend((attempt, index, delta, ",".join(map(str, token_ids)),
                               json.dumps(logprobs) if logprobs else "", chan,
                               "" if choice is None else choice, finish_reason or ""))

    def lost(self, reply: list[Any]) -> list[int]:
        """Positions (in ``add`` order) of the events whose job is no longer ours."""
        return [int(pos) for pos in reply[1]]
