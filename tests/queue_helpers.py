"""A lane's queue as tests look at it: SUBMIT puts jobs on the lane's inbox, workers move
them into its jobs stream (MOVE) and read them there (docs/protocol.md "Submitting")."""
from __future__ import annotations

from typing import Any

from pagedq.wire import script
from pagedq.wire.keys import DEFAULT_LANE, Keys
from pagedq.wire.worker_scripts import Move


def inbox(r: Any, keys: Keys, model: str, lane: str = DEFAULT_LANE) -> list[dict[str, str]]:
    """The jobs waiting on a lane's inbox, oldest first, as stream entries' fields."""
    out = []
    for item in r.lrange(keys.inbox(model, lane), 0, -1):
        job, v, body = item.split("\n", 2)
        out.append({"job": job, "body": body, "v": v})
    return out


def queued(r: Any, keys: Keys, model: str, lane: str = DEFAULT_LANE) -> list[dict[str, str]]:
    """Every job of a lane not yet finished: its inbox's, then its jobs stream's entries."""
    return inbox(r, keys, model, lane) + [f for _id, f in r.xrange(keys.jobs(model, lane))]


def move(r: Any, keys: Keys, model: str, lane: str = DEFAULT_LANE, count: int = 1000) -> int:
    """What a worker's read does first: the inbox's jobs into the jobs stream (MOVE)."""
    return script.run(r, Move(keys, model, lane, count))[0]
