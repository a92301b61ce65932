"""How a worker shares one lane's free seats among the tenants (key prefixes) it serves:
fair shares, so that one tenant's flood cannot starve another's jobs (docs/security.md
"Tenants"). Lanes keep their order (worker/lanes.py decides each lane's room); this splits
one lane's room. No I/O of its own: the reads are the caller's callback.
"""
from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeVar

T = TypeVar("T")


def rotated(items: Sequence[T], turn: int) -> list[T]:
    """``items`` starting at ``turn`` (mod len): who goes first changes every turn."""
    if not items:
        return []
    i = turn % len(items)
    return [*items[i:], *items[:i]]


def fair_take(room: int, order: Sequence[T],
              read: Callable[[dict[T, int]], dict[T, list[Any]]]) -> dict[T, list[Any]]:
    """Up to ``room`` entries from the tenants in ``order``, in rounds. Each round splits
    the room left evenly among the tenants not known to be dry (the remainder to the first
    in order), reads them with one ``read({tenant: count})`` call, and drops each tenant
    that returned fewer than it was asked for. So every tenant with work gets an equal
    share, and a share a tenant cannot use goes to the others in the next round. A round
    either fills the room or drops a tenant: at most len(order) + 1 rounds; one tenant
    reads once, exactly as a single-tenant worker would."""
    got: dict[T, list[Any]] = {t: [] for t in order}
    live = list(order)
    while room > 0 and live:
        q, rem = divmod(room, len(live))
        ask = {t: q + (i < rem) for i, t in enumerate(live) if q + (i < rem) > 0}
        res = read(ask)
        for t, n in ask.items():
            entries = res.get(t, [])
            got[t].extend(entries)
            room -= len(entries)
            if len(entries) < n:
                live.remove(t)
        # those not asked this round (the room was smaller than the tenants) go first next
        live = [t for t in live if t not in ask] + [t for t in live if t in ask]
    return got
