"""What the control plane runs with: a pagedq Client, the batch record store, the batch
settings and the rq queue (JSON serializer, never pickle), plus the enqueue helpers.

rq is imported only here and only when a queue is made, so ``import producer`` (and the
pagedq worker) does not need rq. rq jobs carry only strings (prefix, batch id, a token);
the Redis URL comes from the process: ``pagedq batch worker --redis-url`` (``configure``)
or $PAGEDQ_REDIS_URL. The rq queue lives in the same Redis as the jobs.
"""
from __future__ import annotations

import threading
import uuid
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from pagedq.producer.client import Client
from pagedq.wire.keys import Keys
from pagedq.wire.settings import Settings

from .rq_redis import connect_rq
from .settings import BatchSettings
from .store import BatchStore

# dotted names of the rq job functions (batch/jobs.py)
INGEST_FUNC = "pagedq.batch.jobs.ingest"
TICK_FUNC = "pagedq.batch.jobs.tick"
FAILURE_TTL_S = 86400
# set when this process is asked to stop (``pagedq batch worker``'s SIGTERM): a job that
# could run on for long (an ingest waiting on backpressure) hands the rest of its work to
# a continuation job instead of holding the stop up (rq's warm shutdown waits for the job)
stopping = threading.Event()


def make_queue(redis_url: str, name: str, settings: Settings) -> Any:
    """The rq queue ``name`` on its own (never a cluster) connection to ``redis_url`` (see
    BatchSettings.rq_url), with the settings' credentials and TLS (rq hands that
    connection's class and arguments on to its scheduler process); rq's Lua runs as
    functions (batch/rq_redis.py)."""
    from rq import Queue
    from rq.serializers import JSONSerializer

    return Queue(name, connection=connect_rq(settings, redis_url), serializer=JSONSerializer)


def new_token() -> str:
    return uuid.uuid4().hex


def _rq_safe(batch_id: str) -> str:
    """A batch id inside an rq job id, which allows only [A-Za-z0-9_-] (a partitioned
    batch id has ``.p<k>``)."""
    return batch_id.replace(".", "-")


@dataclass
class Runtime:
    """A batch's jobs go to the rq queue named in its record (``queue``): the queue the
    batch was created for; ``bs.batch_queue`` is the one this process creates for."""

    client: Client
    store: BatchStore
    bs: BatchSettings
    redis_url: str  # the Redis of ``client``, where the rq queues live too
    queues: dict[str, Any] = field(default_factory=dict)  # name -> rq.Queue

    @classmethod
    def build(cls, redis_url: str, client: Client, bs: BatchSettings) -> Runtime:
        return cls(client, BatchStore(client.redis, client.keys, client.settings.partitions),
                   bs, redis_url)

    @property
    def keys(self) -> Keys:
        """Partition 0's keys (the batches index); a batch's own: ``bkeys``."""
        return self.client.keys

    def bkeys(self, batch_id: str) -> Keys:
        """The keys of the partition of batch ``batch_id``: its record, done list and
        jobs (``<batch id>.<line>`` name the same partition: wire/keys.py)."""
        return self.client.keys_of(batch_id)

    @property
    def settings(self) -> Settings:
        return self.client.settings

    @property
    def r(self) -> Any:
        return self.client.redis

    def queue(self, name: str | None = None) -> Any:
        name = name or self.bs.batch_queue
        if name not in self.queues:
            url = self.bs.rq_url(self.redis_url, self.settings.redis_cluster)
            self.queues[name] = make_queue(url, name, self.settings)
        return self.queues[name]

    def enqueue_ingest(self, queue: str, batch_id: str, token: str) -> None:
        self.queue(queue).enqueue_call(
            INGEST_FUNC, args=(self.keys.prefix, batch_id, token),
            job_id=f"pagedq-ingest-{_rq_safe(batch_id)}-{new_token()[:12]}",
            timeout=int(self.bs.batch_ingest_slice_s) + 600, result_ttl=3600,
            failure_ttl=FAILURE_TTL_S, description=f"ingest {batch_id}")

    def enqueue_tick(self, queue: str, batch_id: str, chain: str,
                     delay_s: float | None = None) -> None:
        """A tick now, or after ``delay_s`` through rq's scheduler. Ticks keep no result."""
        args = (self.keys.prefix, batch_id, chain)
        kw = dict(job_id=f"pagedq-tick-{_rq_safe(batch_id)}-{new_token()[:12]}", result_ttl=0,
                  failure_ttl=FAILURE_TTL_S, description=f"tick {batch_id}")
        if delay_s is None:
            self.queue(queue).enqueue_call(TICK_FUNC, args=args, timeout=600, **kw)
        else:
            self.queue(queue).enqueue_in(timedelta(seconds=delay_s), TICK_FUNC, *args,
                                         job_timeout=600, **kw)

    def close(self) -> None:
        self.client.close()
        for q in self.queues.values():
            q.connection.close()


_lock = threading.Lock()
_defaults: dict[str, Any] = {}
_runtimes: dict[str, Runtime] = {}


def configure(redis_url: str | None, settings: Settings | None = None,
              bs: BatchSettings | None = None) -> None:
    """Set this process's Redis URL and settings for the jobs it runs (the batch worker)."""
    with _lock:
        _defaults.update(redis_url=redis_url, settings=settings, bs=bs)
        _runtimes.clear()


def runtime(prefix: str) -> Runtime:
    """The runtime of ``prefix`` in this process (built once)."""
    with _lock:
        rt = _runtimes.get(prefix)
        if rt is None:
            settings = _defaults.get("settings") or Settings()
            url = _defaults.get("redis_url") or settings.redis_url
            client = Client(url, prefix=prefix, settings=settings)
            rt = _runtimes[prefix] = Runtime.build(url, client,
                                                   _defaults.get("bs") or BatchSettings())
        return rt
