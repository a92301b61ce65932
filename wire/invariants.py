"""The queue counters' invariant, checked in one atomic snapshot.

For each lane, ``{P}:qjobs:{model}:{lane}`` must equal the number of jobs in the lane's jobs
stream whose record is ``queued`` and was counted (not ``raw``), and
``{P}:qtokens:{model}:{lane}`` the sum of their ``qtok``. Every path that moves a job out of ``queued`` (worker start, cancel, reject,
expiry) keeps it; tests call ``queue_counters`` after every kind of traffic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import lua
from .keys import DEFAULT_LANE, Keys

SNAPSHOT_LUA = lua.source("queue_snapshot")


@dataclass(frozen=True, slots=True)
class QueueCounters:
    queued_jobs: int  # the counter
    queued_tokens: int  # the counter
    expected_jobs: int  # queued, counted jobs found in the stream
    expected_tokens: int

    @property
    def ok(self) -> bool:
        return (self.queued_jobs, self.queued_tokens) == (self.expected_jobs,
                                                          self.expected_tokens)


def queue_counters(r: Any, keys: Keys, model: str, lane: str = DEFAULT_LANE) -> QueueCounters:
    """One atomic snapshot of a lane's queue counters and what they should be (sync
    redis client)."""
    jobs, tokens, qjobs, qtokens = r.eval(SNAPSHOT_LUA, 3, keys.jobs(model, lane),
                                          keys.queued_tokens(model, lane),
                                          keys.queued_jobs(model, lane), keys.base)
    return QueueCounters(int(qjobs), int(qtokens), int(jobs), int(tokens))
