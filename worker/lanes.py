"""How a worker shares its seats among lanes (docs/design.md "Lanes"): pure arithmetic,
no I/O, so that the policy is stated and tested in one place.

Lanes are ranked, highest first (``settings.lanes``). A seat is one engine request.
- A lane may take seats held by lower lanes: its jobs enter the engine with a higher
  priority, and the engine's priority policy preempts (recompute) a lower one for them.
- Each lane below the first keeps ``floor`` seats while it holds or wants them: higher
  lanes never count those as theirs to take, and a lane under its floor may admit up to it
  even when no seat is free (its job then takes the next seat that frees, ahead of the
  higher lanes' next jobs, which were not admitted). So a lane's oldest job waits at most
  about one job's run time of this worker, whatever the higher lanes send.
- The last lane only uses seats nobody holds: batch work fills what interactive leaves.
"""
from __future__ import annotations

import math

PRIORITY_STRIDE = 10_000  # > the range of a request's priority (-1000..1000)


def floor_seats(max_num_seqs: int, min_share: float) -> int:
    """Seats each lane below the first keeps while it has work."""
    return min(max_num_seqs, math.ceil(min_share * max_num_seqs)) if min_share > 0 else 0


def engine_priority(rank: int, num_lanes: int, priority: int) -> int:
    """A job's engine priority: its lane first, its own ``priority`` inside the lane."""
    return (num_lanes - 1 - rank) * PRIORITY_STRIDE + priority


def rooms(max_num_seqs: int, held: list[int], floor: int, kv_room: bool) -> list[int]:
    """How many more seats each lane (highest first) may admit now. ``held``: seats held
    per lane (running or waiting in the engine); ``kv_room``: the engine has free KV
    blocks for one more request (without it, a lane only takes from lower lanes)."""
    n = len(held)
    out = []
    for i in range(n):
        kept_below = sum(min(h, floor) for h in held[i + 1:])
        room = max_num_seqs - sum(held[:i + 1]) - kept_below
        if not kv_room:  # only what it can take from lower lanes above their floors
            room = min(room, sum(max(0, h - floor) for h in held[i + 1:]))
        if i > 0:
            room = max(room, floor - held[i])
        out.append(max(0, room))
    return out
