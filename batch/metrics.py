"""The batch worker's Prometheus metrics (``PAGEDQ_BATCH_METRICS_PORT``, off by default):
its rq jobs (ingest, tick) by outcome with their durations, the batches of its prefix by
status and the requests of the running ones, and the process's CPU, RSS and open fds.

The batch figures are read from Redis when Prometheus scrapes (one pipelined HMGET of the
batches created in the last 8 days, the index's horizon), so every batch worker of a
prefix reports the same values: take their max, as for the queue gauges.
"""
from __future__ import annotations

import time
from collections.abc import Iterator

import redis
from prometheus_client import (
    CollectorRegistry,
    Counter,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily

from .record import BATCH_TERMINAL, BatchStatus
from .runtime import Runtime
from .settings import MAX_WINDOW_S

JOBS = ("ingest", "tick")  # the rq job functions (batch/jobs.py)
_LAT = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 600)


class BatchCollector:
    """``pagedq:batches{status}`` and ``pagedq:batch_requests{state}`` (total, completed,
    failed: summed over the batches not yet ended), read at each scrape."""

    def __init__(self, rt: Runtime) -> None:
        self.rt = rt

    def collect(self) -> Iterator[GaugeMetricFamily]:
        batches = GaugeMetricFamily("pagedq:batches", "Batches of the prefix created in the "
                                    "last 8 days, by status", labels=["status"])
        requests = GaugeMetricFamily("pagedq:batch_requests", "Requests of the batches not "
                                     "ended yet: their total, completed and failed",
                                     labels=["state"])
        counts = dict.fromkeys(BatchStatus, 0)
        sums = {"total": 0, "completed": 0, "failed": 0}
        try:
            secs, _ = self.rt.r.time()
            ids = self.rt.store.recent_ids(secs - MAX_WINDOW_S - 86400)
            with self.rt.r.pipeline(transaction=False) as pipe:
                for bid in ids:
                    pipe.hmget(self.rt.bkeys(bid).batch(bid), "status", *sums)
                rows = pipe.execute()
        except redis.RedisError:  # Redis away: no sample rather than a failed scrape
            return
        for status, *nums in rows:
            if status in counts:
                counts[status] += 1
                if status not in BATCH_TERMINAL:
                    for key, n in zip(sums, nums, strict=True):
                        sums[key] += int(n or 0)
        for status, n in counts.items():
            batches.add_metric([status], n)
        for key, n in sums.items():
            requests.add_metric([key], n)
        yield batches
        yield requests


class BatchMetrics:
    def __init__(self, rt: Runtime) -> None:
        self.registry = reg = CollectorRegistry()
        ProcessCollector(registry=reg)
        PlatformCollector(registry=reg)
        reg.register(BatchCollector(rt))
        self.jobs = Counter("pagedq:batch_rq_jobs", "rq jobs run, by function and outcome",
                            ["function", "outcome"], registry=reg)
        self.durations = Histogram("pagedq:batch_rq_job_duration_seconds",
                                   "Run time of each rq job, by function", ["function"],
                                   buckets=_LAT, registry=reg)
        for fn in JOBS:  # every series at 0 from the start
            self.durations.labels(fn)
            for outcome in ("ok", "failed"):
                self.jobs.labels(fn, outcome)

    def ran(self, func_name: str, ok: bool, seconds: float) -> None:
        fn = func_name.rpartition(".")[2]
        self.jobs.labels(fn, "ok" if ok else "failed").inc()
        self.durations.labels(fn).observe(seconds)

    def serve(self, port: int, host: str) -> None:
        start_http_server(port, host, registry=self.registry)


def timed(metrics: BatchMetrics | None, func_name: str, run) -> bool:
    """``run()`` (rq's perform_job), counted and timed."""
    t0 = time.perf_counter()
    ok = run()
    if metrics is not None:
        metrics.ran(func_name, bool(ok), time.perf_counter() - t0)
    return ok
