"""``pagedq batch worker``: a real rq worker (JSON serializer, with rq's scheduler) on the
control-plane queue, plus a watchdog thread that keeps every running batch's tick chain
alive.

Why the watchdog: ticks schedule their successors through rq's scheduler, which runs in a
child process of one worker and holds a lock for ~60 s after it dies. A worker killed
with its scheduler (a crashed machine, an OOM kill) leaves scheduled ticks waiting for
that lock; the watchdog sees a batch whose ``beat`` is older than ``batch_lease_s`` and
starts a new chain with an immediate tick (the old chain stops at its next tick).

Jobs run in the worker process (rq's SimpleWorker: no fork per job), so killing the
worker stops an ingest at once; every job is safe to run again. The worker killed alone,
its scheduler child ends with it (``die_with_parent``) and gives its lock up.
"""
from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading

import redis

from pagedq.wire.connection import probe
from pagedq.wire.settings import Settings

from .rq_redis import connect_rq
from .runtime import Runtime, configure, new_token, runtime, stopping
from .settings import MAX_WINDOW_S, BatchSettings

PR_SET_PDEATHSIG = 1  # linux/prctl.h
EXIT_WATCHDOG_FAULT = 71  # as a pagedq worker's fault in a thread (worker/fatal.py)
PUBSUB_POLL_S = 1.0  # rq's pub/sub thread's wait for a command (a shutdown waits for it)
PUBSUB_STOP_S = 2.0  # the longest a shutdown waits for that thread (a daemon: it dies with us)


def rearm_stale(rt: Runtime) -> int:
    """New tick chains for this worker's queue's running batches whose chain went silent;
    returns how many."""
    secs, _ = rt.r.time()
    n = 0
    for batch_id in rt.store.recent_ids(secs - MAX_WINDOW_S - 86400):
        chain = new_token()
        if rt.store.rearm(batch_id, chain, rt.bs.batch_lease_s, rt.bs.batch_queue):
            rt.enqueue_tick(rt.bs.batch_queue, batch_id, chain)
            n += 1
    return n


class Watchdog(threading.Thread):
    def __init__(self, rt: Runtime, log) -> None:
        super().__init__(name="pagedq-batch-watchdog", daemon=True)
        self.rt, self.log = rt, log
        self.stopping = threading.Event()

    def run(self) -> None:
        every = max(0.2, self.rt.bs.batch_lease_s / 2)
        while not self.stopping.wait(every):
            try:
                n = rearm_stale(self.rt)
                if n:
                    self.log.warning("pagedq batch watchdog: restarted %d stalled batch(es)", n)
            except (redis.RedisError, ValueError, KeyError) as e:  # Redis away, a bad record
                self.log.warning("pagedq batch watchdog: %s: %s", type(e).__name__, e)
            except Exception:  # a bug: end the process rather than run without a watchdog
                self.log.critical("pagedq batch watchdog failed", exc_info=True)
                os._exit(EXIT_WATCHDOG_FAULT)


def die_with_parent() -> None:
    """Make the children this process forks (rq's scheduler: jobs run in the process) get
    SIGTERM when it dies, even by SIGKILL: rq's scheduler then stops at its next round and
    gives its lock up, so a restarted worker's scheduler takes over at once (left alone it
    stayed for minutes, holding the lock). Linux only (prctl); elsewhere, the lock's TTL."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getpid()

    def in_child() -> None:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        if os.getppid() != parent:  # the parent died before prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    os.register_at_fork(after_in_child=in_child)


def run_worker(redis_url: str, prefix: str, settings: Settings, bs: BatchSettings, *,
               name: str | None = None, burst: bool = False, log_level: str = "INFO") -> bool:
    """Run the rq worker until stopped (SIGTERM/SIGINT: rq's warm shutdown)."""
    from rq import SimpleWorker
    from rq.serializers import JSONSerializer

    class _Worker(SimpleWorker):
        def subscribe(self) -> None:
            """rq's, with its pub/sub thread waking every PUBSUB_POLL_S, not every 60 s: a
            warm shutdown stops that thread, and redis-py >= 8's stop() waits for it to
            wake (rq's own join has a timeout; that one has none), so a SIGTERM could take
            a minute to end the process."""
            self.log.info("Worker %s: subscribing to channel %s", self.name,
                          self.pubsub_channel_name)
            self.pubsub = self.connection.pubsub()
            self.pubsub.subscribe(**{self.pubsub_channel_name: self.handle_payload})
            self.pubsub_thread = self.pubsub.run_in_thread(
                sleep_time=PUBSUB_POLL_S, daemon=True,
                exception_handler=getattr(self, "_pubsub_exception_handler", None))

        def unsubscribe(self) -> None:
            """rq's, with the wait for the pub/sub thread bounded (redis-py's stop() has
            none by default) and the connection left to that thread, which closes it on
            its way out: a thread stuck reconnecting to a Redis that went away does not
            hold the exit. UNSUBSCRIBE's reply wakes the thread's read at once."""
            if self.pubsub_thread:
                self.log.info("Worker %s: unsubscribing from channel %s", self.name,
                              self.pubsub_channel_name)
                try:
                    self.pubsub.unsubscribe()
                except redis.RedisError:  # Redis away: the thread's poll ends it anyway
                    pass
                self.pubsub_thread.stop(timeout=PUBSUB_STOP_S)

        metrics = None  # batch/metrics.py's, when --metrics-port is set

        def perform_job(self, job, queue, execution) -> bool:
            """rq's, counted and timed by function (ingest, tick) and outcome."""
            if self.metrics is None:
                return super().perform_job(job, queue, execution)
            from .metrics import timed

            return timed(self.metrics, job.func_name,
                         lambda: super(_Worker, self).perform_job(job, queue, execution))

        def handle_warm_shutdown_request(self) -> None:
            """SIGTERM/SIGINT: a running ingest hands over at once (batch/ingest.py), so
            rq's warm shutdown, which waits for the job, ends in a moment."""
            stopping.set()
            super().handle_warm_shutdown_request()

    configure(redis_url, settings, bs)
    rt = runtime(prefix)
    # fail here, with one line, if Redis refuses the credentials or the TLS set-up
    # (RedisUnusable: "cannot use Redis at ..."), or is not there (a ConnectionError)
    rq_url = bs.rq_url(redis_url, settings.redis_cluster)
    probe(settings, rq_url)
    rt.r.ping()
    rearm_stale(rt)
    worker = _Worker([bs.batch_queue], connection=connect_rq(settings, rq_url),
                     serializer=JSONSerializer, name=name,
                     maintenance_interval=int(max(10, bs.batch_lease_s)))
    die_with_parent()
    if bs.batch_metrics_port:
        from .metrics import BatchMetrics

        worker.metrics = BatchMetrics(rt)
        worker.metrics.serve(bs.batch_metrics_port, bs.batch_metrics_host)
    dog = Watchdog(rt, worker.log)
    dog.start()
    try:
        return worker.work(burst=burst, with_scheduler=True, logging_level=log_level)
    finally:
        dog.stopping.set()
