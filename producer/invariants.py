"""The queue counters' invariant, checked in one atomic snapshot.

``{P}:qjobs:{model}`` must equal the number of jobs in the model's jobs stream whose record
is ``queued`` and was counted (not ``raw``), and ``{P}:qtokens:{model}`` the sum of their
``qtok``. Every path that moves a job out of ``queued`` (worker start, cancel, reject,
expiry) keeps it; tests call ``queue_counters`` after every kind of traffic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import lua
from .keys import Keys

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


def queue_counters(r: Any, keys: Keys, model: str) -> QueueCounters:
    """One atomic snapshot of a model's queue counters and what they should be (sync
    redis client)."""
    jobs, tokens, qjobs, qtokens = r.eval(SNAPSHOT_LUA, 3, keys.jobs(model),
                                          keys.queued_tokens(model), keys.queued_jobs(model),
                                          keys.base)
    return QueueCounters(int(qjobs), int(qtokens), int(jobs), int(tokens))
