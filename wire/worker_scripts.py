"""The worker's scripts (wire/lua/{move,start,publish,finish,reject,refresh,expire_unserved}.lua:
KEYS, ARGV and replies in each file's header) as calls: each script's arguments named and
typed, its KEYS and ARGV built in one place (keys from wire/keys.py), its reply parsed.
They run through pagedq.wire.script, queued on the worker's pipelines (a NOSCRIPT reply:
``script.load(r, NAMES)`` and the round again: every one of them is fenced or idempotent).
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from . import lua
from .keys import GROUP, Keys
from .schema import FinishReason, Status
from .script import ScriptCall

NAMES = tuple(n for n, s in lua.SCRIPTS.items() if "worker" in s.roles)  # what a worker runs


@dataclass(frozen=True, slots=True)
class Move(ScriptCall):
    """MOVE: up to ``count`` submitted jobs of a lane's inbox into its jobs stream ->
    (entries added, whether the stream had to be made: it had vanished)."""

    SCRIPT = "move"
    keys: Keys
    model: str
    lane: str
    count: int

    def keys_args(self) -> tuple[list[str], list[Any]]:
        k = self.keys
        return ([k.inbox(self.model, self.lane), k.jobs(self.model, self.lane)],
                [k.base, self.count, GROUP])

    def parse(self, reply: Any) -> tuple[int, bool]:
        return int(reply[0]), bool(int(reply[1]))


@dataclass(frozen=True, slots=True)
class Start(ScriptCall):
    """START: make this worker the job's owner -> ``Started``."""

    SCRIPT = "start"
    keys: Keys
    job_id: str
    model: str
    lane: str
    worker_id: str
    max_deliveries: int

    def keys_args(self) -> tuple[list[str], list[Any]]:
        k = self.keys
        return ([k.job(self.job_id), k.queued_tokens(self.model, self.lane),
                 k.queued_jobs(self.model, self.lane)],
                [self.worker_id, self.model, self.max_deliveries])

    def parse(self, reply: Any) -> Started:
        return Started.parse(reply)


class StartKind(StrEnum):
    """What START made of a job: ours now (``ok``), already ended (``terminal``), started
    max_deliveries times without a result (``poison``)."""

    ok = "ok"
    terminal = "terminal"
    poison = "poison"


def _status(x: str) -> Status | str:
    """A record's status; a value no pagedq writes (a hostile write) stays as it came."""
    return Status(x) if x in Status.__members__ else x


@dataclass(frozen=True, slots=True)
class Started:
    """START's reply."""

    kind: StartKind
    attempt: int = 0
    deadline: float | None = None
    # terminal: the job's status; ok: the status it was started from (queued or running)
    status: Status | str = ""
    queue_wait_s: float = 0.0
    attempts: int = 0  # poison: how often it was started

    @classmethod
    def parse(cls, reply: list[Any]) -> Started:
        kind = StartKind(reply[0])
        if kind is StartKind.ok:
            return cls(kind, int(reply[1]), float(reply[2]) if reply[2] else None,
                       _status(reply[3]), float(reply[4]))
        if kind is StartKind.poison:
            return cls(kind, attempts=int(reply[1]))
        return cls(kind, status=_status(reply[1]))


class Verdict(StrEnum):
    """FINISH's reply: written (``ok``), already terminal under our attempt, just acked
    (``dup``), not ours (``fenced``), nothing written because the job's log lacks events
    before the final's index (``behind``: its round failed in part; sent again)."""

    ok = "ok"
    dup = "dup"
    fenced = "fenced"
    behind = "behind"


@dataclass(frozen=True, slots=True)
class Finish(ScriptCall):
    """FINISH: the terminal record, the final event (at ``index``) and the ack of the
    job's entry, fenced by ``attempt`` -> 'ok' | 'dup' (already terminal under our attempt:
    just acked) | 'fenced' (not ours)."""

    SCRIPT = "finish"
    keys: Keys  # the job's tenant's
    job_id: str
    stream: str  # the jobs stream holding its entry
    entry_id: str
    attempt: int
    status: Status
    finish_reason: FinishReason
    text: str
    error: str
    prompt_tokens: int
    completion_tokens: int
    index: int
    now: float
    result_ttl_s: int
    maxlen: int
    choices: list[dict[str, Any]] | None = None  # n > 1 only

    def keys_args(self) -> tuple[list[str], list[Any]]:
        k, job_id = self.keys, self.job_id
        return ([k.job(job_id), k.out(job_id), self.stream, k.cancel],
                [self.attempt, self.status, self.finish_reason, self.text, self.error,
                 self.prompt_tokens, self.completion_tokens, self.index, self.result_ttl_s,
                 self.entry_id, GROUP, job_id, k.chan(job_id), f"{self.now:.6f}",
                 self.maxlen, json.dumps(self.choices) if self.choices else ""])

    def parse(self, reply: Any) -> Verdict:
        return Verdict(reply)


@dataclass(frozen=True, slots=True)
class Reject(ScriptCall):
    """REJECT: dead-letter an entry that can never run, fail its job. ``job_id`` '' when
    the entry names no usable job (no record is touched then)."""

    SCRIPT = "reject"
    keys: Keys
    model: str
    lane: str
    entry_id: str
    reason: str
    job_id: str
    body: bytes
    now: float
    result_ttl_s: int
    deliveries: int
    dlq_ttl_s: int

    def keys_args(self) -> tuple[list[str], list[Any]]:
        k, j = self.keys, self.job_id or "_"
        return ([k.jobs(self.model, self.lane), k.dlq(self.model, self.lane), k.job(j),
                 k.out(j), k.queued_tokens(self.model, self.lane),
                 k.queued_jobs(self.model, self.lane)],
                [GROUP, self.entry_id, self.reason, self.job_id, self.body,
                 f"{self.now:.6f}", self.result_ttl_s, k.chan(j), self.deliveries,
                 self.dlq_ttl_s])


@dataclass(frozen=True, slots=True)
class Refresh(ScriptCall):
    """REFRESH: reset the idle time of the worker's entries on ``stream`` whose job is still
    its own. ``owned``: (job id, entry id, attempt) of each."""

    SCRIPT = "refresh"
    keys: Keys
    stream: str
    worker_id: str
    owned: list[tuple[str, str, int]]

    def keys_args(self) -> tuple[list[str], list[Any]]:
        ks, args = [self.stream], [GROUP, self.worker_id]
        for job_id, entry_id, attempt in self.owned:
            ks.append(self.keys.job(job_id))
            args += [entry_id, attempt]
        return ks, args


@dataclass(frozen=True, slots=True)
class ExpireUnserved(ScriptCall):
    """EXPIRE_UNSERVED of a model's lane -> how many jobs it expired."""

    SCRIPT = "expire_unserved"
    keys: Keys
    model: str
    lane: str
    unserved_timeout_s: float
    result_ttl_s: int
    max_entries: int

    def keys_args(self) -> tuple[list[str], list[Any]]:
        k = self.keys
        return ([k.jobs(self.model, self.lane), k.serving(self.model),
                 k.queued_tokens(self.model, self.lane), k.queued_jobs(self.model, self.lane),
                 k.cancel, k.inbox(self.model, self.lane)],
                [k.base, self.unserved_timeout_s, self.result_ttl_s, self.max_entries])

    def parse(self, reply: Any) -> int:
        return int(reply)


def event_keys(k: Keys, job_id: str) -> tuple[str, str, str]:
    """The names a job's token events touch: its record, its out stream, its channel."""
    return k.job(job_id), k.out(job_id), k.chan(job_id)


# what a job's event 0 carries besides its tokens: (the prompt's token count, its prompt
# logprobs' entries, or None when not asked for): the ``pt`` and ``plp`` fields
EventHead = tuple[int, "list[Any] | None"]


@dataclass(slots=True)
class Publish(ScriptCall):
    """One PUBLISH call, built event by event: ``add`` one event per (job, choice), each
    with its job's keys (the jobs of one call may belong to several tenants' prefixes) ->
    the positions (in ``add`` order) of the events whose job is no longer ours."""

    SCRIPT = "publish"
    maxlen: int
    idle_ttl_s: int
    _keys: list[str] = field(init=False, default_factory=list)
    _args: list[Any] = field(init=False, default_factory=list)

    def keys_args(self) -> tuple[list[str], list[Any]]:
        return self._keys, [self.maxlen, self.idle_ttl_s, *self._args]

    def add(self, k: Keys, job_id: str, attempt: int, index: int, delta: str,
            token_ids: list[int], logprobs: list[Any] | None, choice: int | None,
            finish_reason: str | None, head: EventHead | None = None) -> None:
        self.add_named(event_keys(k, job_id), attempt, index, delta, token_ids, logprobs,
                       choice, finish_reason, head)

    def add_named(self, names: tuple[str, str, str], attempt: int, index: int, delta: str,
                  token_ids: list[int], logprobs: list[Any] | None, choice: int | None,
                  finish_reason: str | None, head: EventHead | None = None) -> None:
        """``add`` with the job's ``event_keys`` built once by the caller (the publisher
        adds an event of every running job at every round). ``head``: what a job's event
        0 carries besides its tokens (written with index 0 only)."""
        job_key, out_key, chan = names
        self._keys.extend((job_key, out_key))
        pt, plp = head if head is not None and index == 0 else ("", None)
        self._args.extend((attempt, index, delta, ",".join(map(str, token_ids)),
                           json.dumps(logprobs) if logprobs else "", chan,
                           "" if choice is None else choice, finish_reason or "", pt,
                           "" if plp is None else json.dumps(plp)))

    def parse(self, reply: Any) -> list[int]:
        return [int(pos) for pos in reply[1]]
