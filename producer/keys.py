"""Every Redis key and name pagedq uses, built in one place.

All keys of one deployment share the hash tag ``{prefix}`` so that the per-step Lua
scripts (publish, finish, reclaim) may touch any job's keys on a Redis Cluster too:
one prefix = one slot. To spread load over a cluster, give each model its own prefix.
(The first design asked for one slot per *model*; job ids do not carry the model, so a
client holding only a job id could not find its keys. See docs/design.md, docs/protocol.md.)
"""
from __future__ import annotations

import re
from dataclasses import dataclass

GROUP = "workers"  # the consumer group on every jobs stream
# A lane is one jobs stream of a model (interactive, batch, or any priority class); workers
# take from the lanes in the order their settings list them (docs/design.md "Lanes").
DEFAULT_LANE = "interactive"
LANE_RE = re.compile(r"^[a-z0-9_\-]{1,32}$")

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
JOB_ID_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")


def check_name(kind: str, value: str) -> str:
    """Model names and prefixes end up inside keys: keep them to a safe alphabet."""
    if not isinstance(value, str) or not _NAME_RE.match(value):
        raise ValueError(f"invalid {kind} {value!r}: use 1-128 of [A-Za-z0-9_.-]")
    return value


def check_lane(lane: str) -> str:
    if not isinstance(lane, str) or not LANE_RE.match(lane):
        raise ValueError(f"invalid lane {lane!r}: use 1-32 of [a-z0-9_-]")
    return lane


def check_job_id(job_id: str) -> str:
    if not isinstance(job_id, str) or not JOB_ID_RE.match(job_id):
        raise ValueError(f"invalid job id {job_id!r}: use 1-128 of [A-Za-z0-9_.:-]")
    return job_id


@dataclass(frozen=True, slots=True)
class Keys:
    prefix: str = "pagedq"

    def __post_init__(self) -> None:
        check_name("prefix", self.prefix)

    @property
    def base(self) -> str:
        return "{" + self.prefix + "}"

    def jobs(self, model: str, lane: str = DEFAULT_LANE) -> str:
        """The jobs stream of one lane of a model."""
        return f"{self.base}:jobs:{model}:{lane}"

    def dlq(self, model: str, lane: str = DEFAULT_LANE) -> str:
        return f"{self.base}:dlq:{model}:{lane}"

    def job(self, job_id: str) -> str:
        return f"{self.base}:job:{job_id}"

    def out(self, job_id: str) -> str:
        return f"{self.base}:out:{job_id}"

    def chan(self, job_id: str) -> str:
        return f"{self.base}:chan:{job_id}"

    @property
    def cancel(self) -> str:
        return f"{self.base}:cancel"

    def worker(self, worker_id: str) -> str:
        return f"{self.base}:worker:{worker_id}"

    @property
    def workers(self) -> str:
        """Sorted set of worker ids scored by last heartbeat time."""
        return f"{self.base}:workers"

    def serving(self, model: str) -> str:
        """Sorted set of the worker ids serving ``model``, scored by heartbeat expiry time
        (a member whose score is in the past is dead)."""
        return f"{self.base}:serving:{model}"

    @property
    def models(self) -> str:
        """Set of the model names jobs were ever submitted for (the expiry sweep's list)."""
        return f"{self.base}:models"

    def queued_tokens(self, model: str, lane: str = DEFAULT_LANE) -> str:
        """Approximate prompt+max tokens of a lane's jobs queued but not started
        (backpressure)."""
        return f"{self.queued_tokens_prefix}{model}:{lane}"

    def queued_jobs(self, model: str, lane: str = DEFAULT_LANE) -> str:
        """Exact count of a lane's jobs submitted and not yet taken out of 'queued'."""
        return f"{self.queued_jobs_prefix}{model}:{lane}"

    @property
    def queued_tokens_prefix(self) -> str:
        """What CANCEL appends '<model>:<lane>' to (it reads them from the job's record)."""
        return f"{self.base}:qtokens:"

    @property
    def queued_jobs_prefix(self) -> str:
        return f"{self.base}:qjobs:"

    def batch(self, batch_id: str) -> str:
        """Hash: a bulk batch's record (status, request_counts, timestamps, files)."""
        return f"{self.base}:batch:{batch_id}"

    def batch_done(self, batch_id: str) -> str:
        """List: ``item`` of each of the batch's jobs as it ends (pushed by the script that
        makes it terminal; drained by the batch collector)."""
        return f"{self.base}:batchdone:{batch_id}"

    @property
    def batches(self) -> str:
        """Sorted set of batch ids scored by creation time."""
        return f"{self.base}:batches"


def out_entry_id(index: int) -> str:
    """Event ``index`` of a job lives at stream id ``0-(index+1)``.

    Explicit ids make the out stream idempotent: re-adding an index that exists fails,
    so a resumed or stale writer can never duplicate an event, and a reader resumes
    from index k with XREAD ... ``0-k`` (ids strictly greater).
    """
    return f"0-{index + 1}"


def index_of_entry_id(entry_id: str | bytes) -> int:
    if isinstance(entry_id, bytes):
        entry_id = entry_id.decode()
    return int(entry_id.split("-", 1)[1]) - 1
