"""The queue counters' invariant, checked in one atomic snapshot.

For each lane, ``{P}:qjobs:{model}:{lane}`` must equal the number of jobs in the lane's inbox
and jobs stream whose record is ``queued`` and was counted (not ``raw``), and
``{P}:qtokens:{model}:{lane}`` the sum of their ``qtok``. Every path that moves a job out of ``queued`` (worker start, cancel, reject,
expiry) keeps it; tests call ``queue_counters`` after every kind of traffic.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from . import script
from .keys import DEFAULT_LANE, Keys
from .script import ScriptCall


@dataclass(frozen=True, slots=True)
class QueueCounters:
    queued_jobs: int  # the counter
    queued_tokens: int  # the counter
    expected_jobs: int  # queued, counted jobs found in the inbox and the stream
    expected_tokens: int

    @property
    def ok(self) -> bool:
        return (self.queued_jobs, self.queued_tokens) == (self.expected_jobs,
                                                          self.expected_tokens)


@dataclass(frozen=True, slots=True)
class QueueSnapshot(ScriptCall):
    """QUEUE_SNAPSHOT of a lane (wire/lua/queue_snapshot.lua) -> QueueCounters."""

    SCRIPT = "queue_snapshot"
    keys: Keys
    model: str
    lane: str

    def keys_args(self) -> tuple[list[str], list[Any]]:
        k = self.keys
        return ([k.jobs(self.model, self.lane), k.queued_tokens(self.model, self.lane),
                 k.queued_jobs(self.model, self.lane), k.inbox(self.model, self.lane)],
                [k.base])

    def parse(self, reply: Any) -> QueueCounters:
        jobs, tokens, qjobs, qtokens = reply
        return QueueCounters(int(qjobs), int(qtokens), int(jobs), int(tokens))


def queue_counters(r: Any, keys: Keys, model: str, lane: str = DEFAULT_LANE) -> QueueCounters:
    """One atomic snapshot of a lane's queue counters and what they should be (sync
    redis client)."""
    return script.run(r, QueueSnapshot(keys, model, lane))
