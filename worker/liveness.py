"""Heartbeat, lease refresh, queue metrics and the step watchdog.

Heartbeats and lease refreshes are queued FROM the engine loop (the publisher thread
only carries them): if the loop dies or wedges they stop, the heartbeat key expires and
the loop's entries go idle, so other workers reclaim its jobs.
"""
from __future__ import annotations

import os
import threading
import time
from typing import TYPE_CHECKING

import structlog

from producer.keys import GROUP

if TYPE_CHECKING:
    from worker.service import Worker

log = structlog.get_logger("pagedq.liveness")


def beat(w: Worker) -> None:
    """Queue one heartbeat + lease refresh + queue-metrics read (from the engine loop)."""
    now = time.time()
    wk, ttl = w.keys.worker(w.worker_id), int(w.s.heartbeat_ttl_s) + 1
    eng = w.engine
    state = {"model": w.model, "running": len(w.jobs), "at": f"{now:.3f}",
             "kv_usage": f"{eng.kv_cache_usage:.4f}"}
    owned = list(w.jobs.values())
    refresh_keys = [w.stream] + [w.keys.job(j.job_id) for j in owned]
    refresh_args: list = [GROUP, w.worker_id]
    for j in owned:
        refresh_args += [j.entry_id, j.attempt]
    m = w.metrics
    m.running.set(eng.num_running)
    m.waiting.set(eng.num_waiting)
    m.kv_usage.set(eng.kv_cache_usage)
    preempted = eng.scheduler.num_preemptions_total
    if preempted > w.preemptions_seen:
        m.preemptions.inc(preempted - w.preemptions_seen)
        w.preemptions_seen = preempted

    def write(pipe) -> None:
        pipe.hset(wk, mapping=state)
        pipe.expire(wk, ttl)
        pipe.zadd(w.keys.workers, {w.worker_id: now})
        if owned:
            w.refresh_script(keys=refresh_keys, args=refresh_args, client=pipe)

    w.publisher.call(write)


def read_queue_metrics(w: Worker) -> None:
    """Stream length, pending, oldest pending age, DLQ size (one round trip)."""
    try:
        pipe = w.r.pipeline(transaction=False)
        pipe.xlen(w.stream)
        pipe.xpending(w.stream, GROUP)
        pipe.xlen(w.keys.dlq(w.model))
        pipe.xpending_range(w.stream, GROUP, min="-", max="+", count=1)
        length, pend, dlq, oldest = pipe.execute()
    except Exception as e:  # metrics must never take the worker down
        log.warning("queue_metrics_failed", error=str(e))
        return
    w.metrics.stream_length.set(length)
    w.metrics.pending.set(pend["pending"] if isinstance(pend, dict) else 0)
    w.metrics.dlq_size.set(dlq)
    w.metrics.oldest_pending.set(oldest[0]["time_since_delivered"] / 1000 if oldest else 0)


class Watchdog:
    """Fails a wedged engine step instead of hanging forever: if one step runs longer
    than ``limit_s`` the process exits (code 70) so its supervisor restarts it; its jobs
    go back to the queue through lease expiry and count a delivery each, so a job that
    wedges every worker ends in the DLQ after max_deliveries."""

    def __init__(self, limit_s: float, worker_id: str) -> None:
        self.limit_s = limit_s
        self.worker_id = worker_id
        self._step_started: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="pagedq-watchdog", daemon=True)

    def start(self) -> Watchdog:
        self._thread.start()
        return self

    def step_begins(self) -> None:
        self._step_started = time.monotonic()

    def step_ends(self) -> None:
        self._step_started = None

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(min(1.0, self.limit_s / 4)):
            t = self._step_started
            if t is not None and time.monotonic() - t > self.limit_s:
                log.error("step_wedged", worker_id=self.worker_id, limit_s=self.limit_s)
                os._exit(70)
