"""A job's event log (``{P}:out:{id}``) as a sequence: event k at entry id ``0-(k+1)``
(docs/protocol.md). What every reader of a log shares: the clients' reading protocol
(producer/reader.py) reads on from a ``Cursor``; a worker taking a job over ``replay``s what
earlier attempts published (worker/admission.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .keys import index_of_entry_id
from .schema import Event, FinalEvent, TokenEvent, parse_event

Entries = list[tuple[str, dict[str, str]]]


def entries_of(resp: Any) -> Entries:
    """XREAD reply of one key -> its entries (RESP2 list or RESP3 dict shape)."""
    if not resp:
        return []
    if isinstance(resp, dict):
        batches = list(resp.values())
        return list(batches[0][0]) if batches and batches[0] else []
    return list(resp[0][1])


class Cursor:
    """The next event index a reader expects. XREAD from ``0-idx`` returns index idx on."""

    __slots__ = ("idx",)

    def __init__(self, idx: int) -> None:
        if idx < 0:
            raise ValueError("from_index must be >= 0")
        self.idx = idx

    @property
    def xid(self) -> str:
        return f"0-{self.idx}"

    def take(self, entries: Entries) -> tuple[list[Event], bool]:
        """Events continuing the cursor, and whether the log skips past the next index
        (its head was trimmed) before the batch ends."""
        out: list[Event] = []
        for eid, fields in entries:
            if index_of_entry_id(eid) != self.idx:
                return out, True
            ev = parse_event(fields)
            out.append(ev)
            self.idx += 1
            if isinstance(ev, FinalEvent):
                break
        return out, False


@dataclass(slots=True)
class ChoiceReplay:
    token_ids: list[int] = field(default_factory=list)
    deltas: list[str] = field(default_factory=list)
    finish_reason: str | None = None


def replay(entries: Entries, num_choices: int) -> tuple[list[ChoiceReplay], int]:
    """What earlier attempts of a job published, for a worker that takes it over: each
    choice's tokens, text and end, and the next event index. Reads events in order from
    index 0 and stops at the first it cannot continue from (a gap, a final event, an entry
    it cannot parse, a choice out of range): the events after it are written again."""
    choices = [ChoiceReplay() for _ in range(num_choices)]
    cur = Cursor(0)
    for entry in entries:
        try:
            evs, gap = cur.take([entry])
        except (ValueError, KeyError, TypeError):  # pydantic's ValidationError is a ValueError
            break
        if gap:
            break
        ev = evs[0]
        if not isinstance(ev, TokenEvent) or not 0 <= ev.choice < num_choices:
            cur.idx -= 1  # not taken
            break
        c = choices[ev.choice]
        c.token_ids.extend(ev.token_ids)
        c.deltas.append(ev.delta)
        c.finish_reason = ev.finish_reason or c.finish_reason
    return choices, cur.idx
