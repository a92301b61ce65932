"""Heartbeat, lease refresh, queue metrics and the step watchdog: parts of a worker with
declared inputs (worker/service.py composes them).

Heartbeats and lease refreshes are queued FROM the engine loop (the publisher thread
only carries them): if the loop dies or wedges they stop, the heartbeat key expires and
the loop's entries go idle, so other workers reclaim its jobs.
"""
from __future__ import annotations

import threading
import time
from collections.abc import Callable

import redis
import structlog

from pagedq.wire import script
from pagedq.wire.keys import GROUP, SERVED_WINDOW_S, Keys
from pagedq.wire.worker_scripts import Refresh
from pagedq.worker import fatal, faults
from pagedq.worker.jobs import Job, WorkerIdentity
from pagedq.worker.metrics import Metrics
from pagedq.worker.publisher import Publisher

log = structlog.get_logger("pagedq.liveness")
# a worker silent this long leaves {P}:workers and {P}:serving:* (the window in which its
# model counts as served recently: wire/keys.py)
PRUNE_AFTER_S = SERVED_WINDOW_S
# the heartbeat's ``jobs`` field lists at most this many running job ids (``running`` is the
# full count): bounded hash size whatever the batch (docs/protocol.md, pagedq inspect)
HEARTBEAT_JOB_IDS = 32


class Heartbeat:
    """The worker's heartbeat and lease refresh, queued on the publisher's next round trip
    (from the engine loop, or from the watchdog while a step runs within its limit). The
    worker's entry in ``{P}:serving:{model}`` is scored by its heartbeat's expiry time;
    members silent for PRUNE_AFTER_S are pruned there and in ``{P}:workers``.
    ``device`` and ``max_num_seqs`` describe the engine for ``pagedq inspect``;
    ``vocab_size`` (announced in ``{P}:vocab``) lets the gateway refuse token ids outside
    the model's vocabulary."""

    def __init__(self, ident: WorkerIdentity, publisher: Publisher, *, device: str = "",
                 max_num_seqs: int = 0, vocab_size: int = 0) -> None:
        self.ident, self.publisher = ident, publisher
        self._static = {"device": device, "max_num_seqs": max_num_seqs,
                        "started_at": f"{time.time():.3f}"}
        self.vocab_size = vocab_size

    def beat(self, jobs: list[Job], kv_usage: float) -> None:
        """``jobs``: the jobs the worker owns now (their leases are refreshed). Its hash
        and ``{P}:workers`` entry are written under every tenant's prefix it serves (in
        partition 0): ``running`` counts all its jobs (its load), ``jobs`` lists only that
        tenant's. The serving set and models set are written in every partition (SUBMIT's
        require_worker and the unserved sweep read their own partition's)."""
        ident = self.ident
        faults.maybe_raise("heartbeat", [j.uid for j in jobs])
        now = time.time()
        ttl = int(ident.settings.heartbeat_ttl_s) + 1
        prune_before = now - PRUNE_AFTER_S
        owned: dict[tuple[Keys, str], list[tuple[str, str, int]]] = {}  # per (space, lane)
        for j in jobs:
            owned.setdefault((j.keys, j.lane), []).append((j.job_id, j.entry_id, j.attempt))
        writes = []
        for keys in ident.tenants:
            state = None
            if keys.partition == 0:
                mine = [j.job_id for j in jobs if j.keys.prefix == keys.prefix]
                state = {"model": ident.model, "running": len(jobs), "at": f"{now:.3f}",
                         "kv_usage": f"{kv_usage:.4f}", **self._static,
                         "jobs": ",".join(mine[:HEARTBEAT_JOB_IDS])}
            refresh = [Refresh(keys, ident.stream(lane, keys), ident.worker_id, owned[keys, lane])
                       for lane in ident.lanes if (keys, lane) in owned]
            writes.append((keys, state, refresh))

        def write(pipe) -> None:
            for keys, state, refresh in writes:
                serving = keys.serving(ident.model)
                if state is not None:
                    wk = keys.worker(ident.worker_id)
                    pipe.hset(wk, mapping=state)
                    pipe.expire(wk, ttl)
                    pipe.zadd(keys.workers, {ident.worker_id: now})
                    pipe.zremrangebyscore(keys.workers, "-inf", prune_before)
                    if self.vocab_size:
                        pipe.hset(keys.vocab, ident.model, self.vocab_size)
                pipe.zadd(serving, {ident.worker_id: now + ttl})
                pipe.sadd(keys.models, ident.model)
                pipe.zremrangebyscore(serving, "-inf", prune_before)
                for call in refresh:
                    script.queue(pipe, call)

        self.publisher.call(write)

    def leave(self) -> None:
        """A clean stop: no longer serving (clients asking require_worker see it), its
        entry in the serving set scored with now, so its model stays "served recently"
        (a rolling restart: 503, not an unknown model) until pruned."""
        ident = self.ident
        try:
            pipe = ident.r.pipeline(transaction=False)
            now = time.time()
            for keys in ident.tenants:
                pipe.zadd(keys.serving(ident.model), {ident.worker_id: now}, xx=True)
                if keys.partition == 0:
                    pipe.zrem(keys.workers, ident.worker_id)
                    pipe.delete(keys.worker(ident.worker_id))
            pipe.execute()
        except redis.RedisError as e:
            log.warning("leave_failed", error=str(e))


def live_workers(ident: WorkerIdentity) -> dict[tuple[str, str], int]:
    """(prefix, model) -> live workers, for every model ever served under each prefix the
    worker serves: the entries of its serving set whose heartbeat has not expired (scores
    are expiry times; partition 0's set, as every worker writes each partition's). Two
    round trips; 0 says jobs of that model have no worker."""
    homes = [k for k in ident.tenants if k.partition == 0]
    pipe = ident.r.pipeline(transaction=False)
    for k in homes:
        pipe.smembers(k.models)
    seen = [(k, m) for k, ms in zip(homes, pipe.execute(), strict=True) for m in sorted(ms)]
    now = time.time()
    pipe = ident.r.pipeline(transaction=False)
    for k, m in seen:
        pipe.zcount(k.serving(m), now, "+inf")
    return {(k.prefix, m): n for (k, m), n in zip(seen, pipe.execute(), strict=True)}


def read_queue_metrics(ident: WorkerIdentity, metrics: Metrics) -> None:
    """Stream length, pending, oldest pending age, DLQ size of each lane of each tenant the
    worker serves (one round trip): one series per (prefix, model, lane), the queue the
    labels name. Every worker of that queue reports the same values: dashboards take their
    max per series, then sum across prefixes (deploy/grafana/dashboards/pagedq.json)."""
    where = [(k, lane) for lane in ident.lanes for k in ident.tenants]
    try:
        pipe = ident.r.pipeline(transaction=False)
        for k, lane in where:
            stream = ident.stream(lane, k)
            pipe.xlen(stream)
            pipe.xpending(stream, GROUP)
            pipe.xlen(k.dlq(ident.model, lane))
            pipe.xpending_range(stream, GROUP, min="-", max="+", count=1)
            pipe.llen(k.inbox(ident.model, lane))
        res = pipe.execute()
        live = live_workers(ident)
    except Exception as e:  # noqa: BLE001 - metrics must never take the worker down
        log.warning("queue_metrics_failed", error=str(e))
        return
    # (prefix, lane) -> length, pending, dlq, oldest; summed over the lane's streams
    total = {(k.prefix, lane): [0, 0, 0, 0.0] for k, lane in where}
    for i, (k, lane) in enumerate(where):
        length, pend, dlq, oldest, inbox = res[5 * i:5 * i + 5]
        t = total[k.prefix, lane]
        t[0] += length + inbox  # the lane's unfinished jobs: in its stream or its inbox
        t[1] += pend["pending"] if isinstance(pend, dict) else 0
        t[2] += dlq
        t[3] = max(t[3], oldest[0]["time_since_delivered"] / 1000 if oldest else 0)
    for (prefix, model), n in live.items():
        metrics.model_workers.labels(prefix, model).set(n)
    for (prefix, lane), (length, pending, dlq, oldest_s) in total.items():
        labels = (prefix, ident.model, lane)
        metrics.stream_length.labels(*labels).set(length)
        metrics.pending.labels(*labels).set(pending)
        metrics.dlq_size.labels(*labels).set(dlq)
        metrics.oldest_pending.labels(*labels).set(oldest_s)


class Watchdog:
    """Fails a wedged engine step instead of hanging forever: if one step runs longer
    than ``limit_s()`` (sized from the steps seen: pacing.StepPacer) the process exits
    (code 70) so its supervisor restarts it; its jobs go back to the queue through lease
    expiry and count a delivery each, so a job that wedges every worker ends in the DLQ
    after max_deliveries. While a step runs within its limit, ``keepalive`` (the heartbeat
    and lease refresh) is called every ``every_s``: a slow step is not a dead worker."""

    def __init__(self, limit_s: Callable[[], float], worker_id: str,
                 keepalive: Callable[[], None] = lambda: None, every_s: float = 5.0) -> None:
        self.limit_s = limit_s
        self.worker_id = worker_id
        self.keepalive = keepalive
        self.every_s = every_s
        self._step_started: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=fatal.guarded("watchdog", self._run),
                                        name="pagedq-watchdog", daemon=True)

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
        kept = None  # the step start we last kept alive, and when
        while not self._stop.wait(min(1.0, self.every_s / 2)):
            t = self._step_started
            if t is None:
                continue
            now, limit = time.monotonic(), self.limit_s()
            if now - t > limit:
                log.error("step_wedged", worker_id=self.worker_id, limit_s=round(limit, 1))
                fatal.flush_and_exit(fatal.EXIT_WEDGED)
            if now - t >= self.every_s and (kept is None or kept[0] != t
                                            or now - kept[1] >= self.every_s):
                self.keepalive()
                kept = (t, now)
