"""Every Redis key and name pagedq uses, built in one place.

A deployment's keys are split into ``PAGEDQ_PARTITIONS`` key spaces (partitions), each
one Redis Cluster hash tag, so each is one slot and every script touches one slot:
partition 0 is ``{prefix}`` (a deployment of one partition is exactly the original
scheme), partition k > 0 is ``{prefix:pk}``. ``:`` is outside the prefix alphabet, so no
prefix's partition can be spelled as another prefix (``{a:p1}`` is never tenant ``a:p1``)
and the ACL pattern ``{a:p*}`` matches only tenant ``a``'s partitions. A partition holds
its jobs streams, counters, job records, event logs, cancel set, DLQ and its own copy of
the serving sets and models set (so SUBMIT's require_worker check and the unserved sweep
stay inside one slot); the workers registry, worker hashes and the batches index live in
partition 0. A job's partition is a function of its id alone (``partition_of``): a client
holding only the id finds its keys (docs/protocol.md "Partitions").
"""
from __future__ import annotations

import itertools
import re
import uuid
import zlib
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


MAX_PARTITIONS = 1024
_PARTITION_PART = re.compile(r"^p(0|[1-9][0-9]{0,3})$")


def partition_of(job_id: str, partitions: int) -> int:
    """The partition holding job ``job_id`` among ``partitions`` (docs/protocol.md
    "Partitions"): 0 when there is one; else, if a ``.``-separated part of the id after
    its first reads ``p<k>`` (k decimal, no leading zero), the first such part names it
    when k < partitions; otherwise CRC-32 (IEEE, as zlib's) of the id's bytes modulo
    ``partitions``. Generated ids end in ``.p<k>`` (``new_job_id``), so they name their
    partition; a caller-chosen id is hashed. Also a batch's partition, by its id, and so
    its jobs' (``<batch id>.<line>``)."""
    if partitions <= 1:
        return 0
    for part in job_id.split(".")[1:]:
        m = _PARTITION_PART.match(part)
        if m:
            k = int(m[1])
            if k < partitions:
                return k
            break
    return zlib.crc32(job_id.encode()) % partitions


# the partition of the next generated id, round robin from a random start per process
# (itertools.count's next() is atomic under the GIL: threads share it safely)
_NEXT_PARTITION = itertools.count(uuid.uuid4().int % MAX_PARTITIONS)


# how long a model stays "served recently" after its last worker's heartbeat ran out (or
# it stopped); members older than this are pruned from the serving sets
SERVED_WINDOW_S = 3600.0


def new_job_id(partitions: int, partition: int | None = None, stem: str = "") -> str:
    """A new unique id (``stem`` + uuid4 hex): as it always was for one partition; with
    more, ``.p<k>`` appended for ``partition`` (default: the next one, round robin over
    every id this process makes), so producers spread new jobs evenly and the id names
    where it lives."""
    base = stem + uuid.uuid4().hex
    if partitions <= 1:
        return base
    k = next(_NEXT_PARTITION) % partitions if partition is None else partition
    return f"{base}.p{k}"


@dataclass(frozen=True, slots=True)
class Keys:
    """The key names of one key space: a tenant ``prefix`` and one of its partitions."""

    prefix: str = "pagedq"
    partition: int = 0

    def __post_init__(self) -> None:
        check_name("prefix", self.prefix)
        if not isinstance(self.partition, int) or not 0 <= self.partition < MAX_PARTITIONS:
            raise ValueError(f"invalid partition {self.partition!r}: 0..{MAX_PARTITIONS - 1}")

    @property
    def base(self) -> str:
        """The hash tag: ``{prefix}`` for partition 0, ``{prefix:p<k>}`` for k > 0."""
        if self.partition == 0:
            return "{" + self.prefix + "}"
        return "{" + self.prefix + ":p" + str(self.partition) + "}"

    def part(self, partition: int) -> Keys:
        """The same tenant's keys of another partition."""
        return self if partition == self.partition else Keys(self.prefix, partition)

    @property
    def home(self) -> Keys:
        """Partition 0: the workers registry, worker hashes, the batches index."""
        return self.part(0)

    def of_job(self, job_id: str, partitions: int) -> Keys:
        """The keys of the partition holding ``job_id`` (or batch ``job_id``)."""
        return self.part(partition_of(job_id, partitions))

    def spaces(self, partitions: int) -> tuple[Keys, ...]:
        """Every partition's keys, 0 first."""
        return tuple(self.part(k) for k in range(partitions))

    def jobs(self, model: str, lane: str = DEFAULT_LANE) -> str:
        """The jobs stream of one lane of a model: written by workers only (MOVE)."""
        return f"{self.base}:jobs:{model}:{lane}"

    def inbox(self, model: str, lane: str = DEFAULT_LANE) -> str:
        """List: the jobs SUBMIT queued on a lane and no worker has yet moved into its jobs
        stream, oldest first (one item each: ``<job id>\\n<version>\\n<body>``). Producers
        may only append to it (RPUSH): they can neither read nor trim the queue."""
        return f"{self.base}:inbox:{model}:{lane}"

    def wake(self, model: str) -> str:
        """List: one item per SUBMIT of the model (capped), popped by idle workers'
        blocking read (BLPOP): a doorbell, no data."""
        return f"{self.base}:wake:{model}"

    @property
    def vocab(self) -> str:
        """Hash: model -> its vocabulary size, written by the workers serving it (the
        gateway refuses token ids outside it)."""
        return f"{self.base}:vocab"

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
        (a member whose score is in the past is dead; one stopped cleanly is scored with
        its stop time). A model whose best score is within ``SERVED_WINDOW_S`` of now was
        served recently: a request for it waits for a worker (503), it is no unknown model
        (404)."""
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

    # -- the HTTP gateway's (gateway/): API keys and rate windows live under the gateway's
    # own prefix, uploaded files' records under each tenant's

    @property
    def apikeys(self) -> str:
        """Hash: API key SHA-256 -> its record (JSON)."""
        return f"{self.base}:apikeys"

    def ratelimit(self, key_hash: str, minute: int | str) -> str:
        """Hash of one key's one-minute window (``r`` requests, ``t`` tokens); gateway/
        apikeys.py's ADMIT script builds the same name from the base."""
        return f"{self.base}:ratelimit:{key_hash}:{minute}"

    def file(self, file_id: str) -> str:
        """Hash: an uploaded batch input file's record (its bytes are in the batch folder)."""
        return f"{self.base}:file:{file_id}"

    @property
    def files(self) -> str:
        """Sorted set of uploaded file ids scored by upload time."""
        return f"{self.base}:files"


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
