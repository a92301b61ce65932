"""The batch record's scripts (wire/lua/batch_*.lua: KEYS, ARGV and replies in each file's
header) as calls, for batch/store.py. Each takes the batch's record key (and its done list
where the script trims or drops it), in the partition the batch id names (wire/keys.py).
Every write of the control plane is one of them (atomic, fenced by a lease where it must
be), so each step may be repeated after a crash."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .script import ScriptCall


def _flat(pairs: dict[str, Any]) -> list[str]:
    return [str(x) for kv in pairs.items() for x in kv]


@dataclass(frozen=True, slots=True)
class CreateBatch(ScriptCall):
    """The record, and its entry in the batches index when ``index`` (the index's key) is in
    the record's partition -> Redis's time of creation; ValueError if it exists."""

    SCRIPT = "batch_create"
    record: str
    batch_id: str
    window_s: int
    fields: dict[str, Any]
    index: str | None = None

    def keys_args(self) -> tuple[list[str], list[Any]]:
        return ([self.record, *([self.index] if self.index else [])],
                [self.batch_id, str(self.window_s), *_flat(self.fields)])

    def parse(self, reply: Any) -> float:
        if reply[0] != "created":
            raise ValueError(f"batch {self.batch_id} exists already")
        return float(reply[1])


@dataclass(frozen=True, slots=True)
class Lease(ScriptCall):
    """Take or refresh the lease in hash field ``lease`` for ``token``, and set ``fields``
    with it -> 1 held by us now, 0 held by another token, -1 no such batch."""

    SCRIPT = "batch_lease"
    record: str
    lease: str
    token: str
    ttl_s: float
    fields: dict[str, Any] = field(default_factory=dict)

    def keys_args(self) -> tuple[list[str], list[Any]]:
        return [self.record], [self.lease, self.token, str(self.ttl_s), *_flat(self.fields)]

    def parse(self, reply: Any) -> int:
        return int(reply)


@dataclass(frozen=True, slots=True)
class Release(ScriptCall):
    """Drop the lease in field ``lease`` if ``token`` holds it."""

    SCRIPT = "batch_release"
    record: str
    lease: str
    token: str

    def keys_args(self) -> tuple[list[str], list[Any]]:
        return [self.record], [self.lease, self.token]


@dataclass(frozen=True, slots=True)
class Commit(ScriptCall):
    """The collector's commit of ``n`` written items (``cut`` of them cut by the window;
    the output lines among them used ``usage``: (input, output) tokens) -> False if it no
    longer holds the tick lease."""

    SCRIPT = "batch_commit"
    record: str
    done: str
    token: str
    n: int
    cut: int
    usage: tuple[int, int] = (0, 0)

    def keys_args(self) -> tuple[list[str], list[Any]]:
        return [self.record, self.done], [self.token, str(self.n), str(self.cut),
                                          str(self.usage[0]), str(self.usage[1])]

    def parse(self, reply: Any) -> bool:
        return bool(reply)


@dataclass(frozen=True, slots=True)
class Transition(ScriptCall):
    """Status ``frm`` (one of) -> ``to``, ``fields`` set with it; a terminal one gets the
    TTL ``ttl_s`` (0: none) -> (done, the status now or "")."""

    SCRIPT = "batch_transition"
    record: str
    done: str
    frm: tuple[str, ...]
    to: str
    ttl_s: int = 0
    fields: dict[str, Any] = field(default_factory=dict)

    def keys_args(self) -> tuple[list[str], list[Any]]:
        return ([self.record, self.done],
                [",".join(self.frm), self.to, str(self.ttl_s), *_flat(self.fields)])

    def parse(self, reply: Any) -> tuple[bool, str]:
        ok, status = reply
        return ok == "ok", status


@dataclass(frozen=True, slots=True)
class Clock(ScriptCall):
    """-> (Redis's time now, until when the lease in field ``lease`` is held: 0 if not)."""

    SCRIPT = "batch_clock"
    record: str
    lease: str

    def keys_args(self) -> tuple[list[str], list[Any]]:
        return [self.record], [self.lease]

    def parse(self, reply: Any) -> tuple[float, float]:
        now, until = reply
        return float(now), float(until)


@dataclass(frozen=True, slots=True)
class Rearm(ScriptCall):
    """A new tick chain ``chain`` if the batch (of rq queue ``queue``) runs and its chain
    showed no life for ``stale_s`` -> whether it was re-armed."""

    SCRIPT = "batch_rearm"
    record: str
    chain: str
    stale_s: float
    queue: str

    def keys_args(self) -> tuple[list[str], list[Any]]:
        return [self.record], [self.chain, str(self.stale_s), self.queue]

    def parse(self, reply: Any) -> bool:
        return bool(reply)
