"""The worker loop: Redis intake -> engine.step() -> publish -> ack.

One thread runs the engine (this loop); the publisher thread writes results; while the
engine is busy, intake's reads run on a reader thread of their own. Intake reads only as
many entries as the engine can admit and blocks on Redis only while the engine is idle, so
a job arriving mid-generation joins the running batch within a step or two. Redis outages
never stop the engine: intake backs off (capped), the publisher retries, the engine keeps
its state.
"""
from __future__ import annotations

import os
import socket
import sys
import time

import redis
import structlog

from pagedq.engine.llm_engine import LLMEngine
from pagedq.wire import connection
from pagedq.wire.keys import GROUP, Keys
from pagedq.wire.redis_errors import RETRYABLE
from pagedq.wire.sampling import split_sample_id
from pagedq.wire.schema import FinishReason, Status
from pagedq.wire.settings import Settings
from pagedq.worker import fatal, faults, liveness, recovery
from pagedq.worker.gc_pauses import GcPauses
from pagedq.worker.health import DRAINING, SERVING, STOPPED, Health
from pagedq.worker.intake import Intake
from pagedq.worker.job_table import JobTable
from pagedq.worker.jobs import (
    WorkerIdentity,
    finish_reason_of,
    logprobs_json,
)
from pagedq.worker.metrics import Metrics, observe_many
from pagedq.worker.pacing import StepPacer
from pagedq.worker.publisher import Publisher
from pagedq.worker.redis_faults import RedisFaults

log = structlog.get_logger("pagedq.worker")
GIL_SWITCH_S = 0.001
_REDIS_DOWN = RETRYABLE  # an outage, a restart, a cluster master failing over


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Worker:
    """The service: parts with declared interfaces, composed here and driven by one loop.
    The engine thread owns ``jobs`` (the jobs this worker started and has not ended,
    worker/job_table.py) and the engine; the publisher thread owns Redis writes of results; the watchdog thread
    only watches steps."""

    def __init__(self, engine: LLMEngine, settings: Settings | None = None, *,
                 worker_id: str | None = None) -> None:
        s = self.s = settings or Settings()
        self.engine = engine
        self.worker_id = worker_id or default_worker_id()
        # surrogateescape: an entry that is not UTF-8 reaches parse_entry (and the DLQ,
        # byte for byte) instead of failing the whole XREADGROUP reply
        self.r = connection.connect(s, decode_responses=True, encoding_errors="surrogateescape",
                                    health_check_interval=10, socket_timeout=30)
        # the key spaces served: every partition of every tenant prefix (one prefix of one
        # partition = a list of one)
        tenants = tuple(k for p in s.served_prefixes for k in Keys(p).spaces(s.partitions))
        ident = self.ident = WorkerIdentity(self.r, tenants[0], s, s.model, self.worker_id,
                                            tenants)
        self.model, self.keys = ident.model, ident.keys
        self.log = log.bind(worker_id=self.worker_id, model=self.model)
        self.metrics = Metrics()
        self.metrics.watch_device(engine.runner.device)
        # prefixes in tenants' order, each once (a prefix has several partitions)
        self.metrics.serving(self.model, dict.fromkeys(k.prefix for k in tenants), ident.lanes)
        self.health = Health(s.health_max_silence_s, self.worker_id)  # /healthz, /readyz
        self.publisher = Publisher(self.r, s)
        self.jobs = JobTable(ident, self.publisher, self.metrics, self.log)
        self.pacer = StepPacer(engine, s.max_step_s, s.step_watchdog_s)
        self.intake = Intake(ident, engine, self.publisher, self.metrics, self.pacer, self.jobs,
                             self.log)
        self.heartbeat = liveness.Heartbeat(ident, self.publisher,
                                            device=str(engine.runner.device),
                                            max_num_seqs=engine.config.max_num_seqs,
                                            vocab_size=engine.runner.vocab_size)
        # an outage, a full Redis, a Redis that lost its data (worker/redis_faults.py)
        self.faults = RedisFaults(ident, self.health, self.metrics, self.log,
                                  engine.has_unfinished)
        self.publisher.on_redis_full = self.faults.redis_full
        self.intake.on_stream_made = self.faults.stream_made
        self.sweep = recovery.UnservedSweep(ident, self.log)
        self.watchdog = liveness.Watchdog(self.pacer.watchdog_limit_s, self.worker_id,
                                          keepalive=self._beat,
                                          every_s=min(s.lease_s, s.heartbeat_ttl_s) / 3)
        self.steps = 0  # for bench/service.py
        self.gc = GcPauses()
        self._stopping = False
        self._next_beat = self._next_metrics = self._next_sweep = 0.0
        # seconds of the engine thread, by phase (logged at exit; bench/service.py reads it);
        # "intake_busy": intake while jobs ran (each poll delays the next step), "intake":
        # all of it, blocking on the stream while the engine is idle included
        self.loop_s = {"engine_step": 0.0, "emit": 0.0, "intake": 0.0, "intake_busy": 0.0,
                       "other": 0.0}

    # ---- lifecycle --------------------------------------------------------------------
    def request_stop(self) -> None:
        self._stopping = True

    def run(self, *, until_idle: bool = False) -> None:
        """Serve until ``request_stop()`` (or, with ``until_idle``, until nothing is left).
        Raises RedisUnusable, before starting anything, when Redis refuses the credentials
        or the TLS set-up; Redis not answering is not fatal (intake retries)."""
        self._redis_call(self.faults.start_check)
        # the publisher thread's Python competes with the engine thread for the GIL; with
        # CPython's 5 ms switch interval the engine thread, back from waiting on the device,
        # could wait up to a whole step for it (H200, bench/service.py: 21,663 tok/s at
        # 5 ms, 22,013-22,089 at 0.2-1 ms)
        sys.setswitchinterval(GIL_SWITCH_S)
        if self.s.metrics_port:
            port = self.metrics.serve(self.s.metrics_port, self.s.metrics_host, self.health)
            self.log.info("metrics_listening", host=self.s.metrics_host, port=port)
        self.gc.start()  # everything of start-up is in the heap by now (worker/gc_pauses.py)
        self.publisher.start()
        self.watchdog.start()
        self.log.info("worker_started", streams=self.ident.streams)
        t_start = time.perf_counter()
        self.health.beat()
        self.health.set_phase(SERVING)
        try:
            self._loop(until_idle)
        except Exception as e:  # noqa: BLE001 - an engine-loop fault ends the process
            fatal.die("engine", e, list(self.jobs))
        finally:
            self.health.set_phase(STOPPED)
            self.watchdog.stop()
            self.intake.close()
            self.publisher.stop()
            self.heartbeat.leave()
            self.gc.stop()
            loop = self.loop_s
            loop["other"] = time.perf_counter() - t_start - sum(
                v for k, v in loop.items() if k != "intake_busy")  # (a part of intake)
            # device_wait_s: of engine_step, the host's wait for sampled tokens (the device
            # was the bottleneck then); publisher_cpu_s: the publisher thread's CPU, which
            # competes with the engine thread for the GIL; gc_*: full collections since
            # start-up (worker/gc_pauses.py)
            self.log.info("worker_stopped", steps=self.steps,
                          publish_round_trips=self.publisher.rounds,
                          intake_round_trips=self.intake.round_trips,
                          intake_read_round_trips=self.intake.read_round_trips,
                          loop_s={k: round(v, 6) for k, v in loop.items()},  # (µs: intake's
                          # busy share is often under a millisecond)
                          device_wait_s=round(self.engine.device_wait_s, 3),
                          publisher_cpu_s=round(self.publisher.cpu_s, 3),
                          gc_full=self.gc.full, gc_max_pause_s=round(self.gc.max_s, 4),
                          gc_pause_s=round(self.gc.total_s, 3))

    def _loop(self, until_idle: bool) -> None:
        own_pending = True  # a restarted worker first re-reads its own pending entries
        drain_until = None
        while True:
            self.health.beat()  # one beat per iteration: /healthz's liveness
            self._drain_cancels()
            if self._stopping:
                now = time.monotonic()
                if drain_until is None:
                    drain_until = now + self.s.drain_timeout_s
                    self.log.info("drain_started", running=len(self.jobs))
                    self._redis_call(self.intake.settle)
                    self.health.set_phase(DRAINING)
                if not self.jobs or now > drain_until:
                    break
            else:
                t, busy = time.perf_counter(), self.engine.has_unfinished()
                writes = self.intake.writes
                if self._redis_call(self.intake.poll, own_pending):
                    own_pending = False
                    self.faults.after_poll(self.intake.take_deferred(),
                                           self.intake.writes > writes)
                if self.faults.reread_own:  # entries read and not started: read again
                    own_pending, self.faults.reread_own = True, False
                dt = time.perf_counter() - t
                self.loop_s["intake"] += dt
                if busy:
                    self.loop_s["intake_busy"] += dt
            if self.engine.has_unfinished():
                self._step()
            elif until_idle and not self._redis_call(self.intake.has_backlog):
                break
            self._housekeeping()
        self._release_all()

    def _step(self) -> None:
        if faults.FAILPOINTS:
            faults.maybe_raise("engine", list(self.jobs))
        # Cancel requests are looked up while the step runs and applied before its tokens
        # are published: a cancel that landed before the step began stops the job's output
        # at once, one that lands during it by the end of the next step.
        self.publisher.check_cancels(list(self.jobs))
        self.watchdog.step_begins()
        t0 = time.perf_counter()
        outs = self.engine.step()
        faults.on_step(self.engine.last_step_tokens)
        t1 = time.perf_counter()
        self.watchdog.step_ends()
        self.pacer.after_step(t1 - t0, self.engine.last_step_tokens)
        self.steps += 1
        self._apply_cancels()
        self._emit(outs)
        self.loop_s["engine_step"] += t1 - t0
        self.loop_s["emit"] += time.perf_counter() - t1

    def _redis_call(self, fn, *args):
        """An intake-side Redis call: False when it failed and is retried later (backoff;
        worker/redis_faults.py)."""
        return self.faults.call(fn, *args)

    def _release_all(self) -> None:
        """Hand unfinished jobs back: abort them here and mark their entries long idle so
        any other worker's next reclaim takes them (they resume from their events)."""
        if not self.jobs:
            return
        by_stream: dict[str, list[str]] = {}
        for j in self.jobs.values():
            by_stream.setdefault(self.ident.stream(j.lane, j.keys), []).append(j.entry_id)
        for uid in list(self.jobs):
            self.engine.abort_request(uid)
        self.publisher.flush()
        idle_ms = int(self.s.lease_s * 1000) * 10
        try:
            for stream, ids in by_stream.items():
                self.r.xclaim(stream, GROUP, self.worker_id, 0, ids, idle=idle_ms, justid=True)
        except (*_REDIS_DOWN, redis.ResponseError):  # (NOGROUP: the stream is gone)
            pass  # the lease expires on its own
        self.log.info("jobs_released", count=len(self.jobs))
        self.jobs.clear()

    # ---- results ----------------------------------------------------------------------
    def _emit(self, outs: list) -> None:
        batch, now, ended = [], time.monotonic(), []
        jobs, top, urgent = self.jobs, self.ident.lanes[0], False
        gaps: dict[float, int] = {}  # previous token's time -> tokens (one ITL each)
        for o in outs:
            rid, k = o.request_id, 0
            job = jobs.get(rid)  # n == 1: the request id is the job's uid
            if job is None:
                if "#" not in rid:
                    continue
                rid, k = split_sample_id(rid)
                job = jobs.get(rid)
                if job is None:
                    continue
            head = None
            if job.last_token_at is None:
                job.first_token_at = now
                self.metrics.ttft.labels(job.lane).observe(now - job.admitted_at)
                self.metrics.submit_ttft.labels(job.lane).observe(
                    job.queue_wait_s + now - job.admitted_at)
                urgent = urgent or job.lane == top
                head = (job.prompt_tokens, None if o.prompt_logprobs is None else
                        logprobs_json(o.prompt_logprobs, self._token_text))
            else:
                gaps[job.last_token_at] = gaps.get(job.last_token_at, 0) + 1
            job.last_token_at = now
            choice = job.choices[k]
            choice.text.write(o.delta)
            choice.num_tokens += len(o.new_token_ids)
            fr = None
            if o.finished:
                fr = choice.finish_reason = finish_reason_of(o.finish_reason)
                if job.done:
                    ended.append(job)
            lp = logprobs_json(o.logprobs, self._token_text) if o.logprobs else None
            batch.append((rid, job.attempt, None if job.n == 1 else k, o.delta,
                          o.new_token_ids, lp, fr, head))
        for last, count in gaps.items():
            observe_many(self.metrics.itl, now - last, count)
        self.metrics.generation_tokens.inc(sum(len(b[4]) for b in batch))  # tokens, not events
        self.publisher.tokens(batch, urgent)
        for job in ended:
            self.jobs.end(job, Status.finished, job.finish_reason())

    def _token_text(self, token_id: int) -> str:
        tok = self.engine.tokenizer
        return tok.decode([token_id]) if tok is not None else ""

    def _drain_cancels(self) -> None:
        """Cancels and takeovers, then deadlines (O(jobs): once per loop, not per step)."""
        self._apply_cancels()
        now = time.time()
        for job in [j for j in self.jobs.values() if j.deadline is not None and now > j.deadline]:
            self.engine.abort_request(job.uid)
            self.jobs.end(job, Status.finished, FinishReason.deadline)

    def _apply_cancels(self) -> None:
        while not self.publisher.lost.empty():  # another worker took it over: stop, no result
            uid, attempt = self.publisher.lost.get()
            job = self.jobs.get(uid)
            if job is not None and job.attempt == attempt:  # (not a newer attempt of ours)
                self.jobs.drop(uid)
                self.engine.abort_request(job.uid)
                self.log.warning("job_lost", job_id=job.job_id, prefix=job.keys.prefix,
                                 attempt=job.attempt)
        while not self.publisher.cancel_hits.empty():
            job = self.jobs.get(self.publisher.cancel_hits.get())
            if job is not None:
                self.engine.abort_request(job.uid)
                self.jobs.end(job, Status.cancelled, FinishReason.cancelled)

    def _beat(self) -> None:
        self.heartbeat.beat(list(self.jobs.values()), self.engine.kv_cache_usage)

    def _housekeeping(self) -> None:
        now = time.monotonic()
        if now >= self._next_beat:
            self._next_beat = now + min(1.0, self.s.heartbeat_ttl_s / 3)
            self._beat()
            self.metrics.observe_engine(self.engine)
        if self.s.metrics_port and now >= self._next_metrics:
            self._next_metrics = now + 5.0
            liveness.read_queue_metrics(self.ident, self.metrics)
        if self.s.unserved_timeout_s and now >= self._next_sweep:
            self._next_sweep = now + min(30.0, self.s.unserved_timeout_s / 4)
            self._redis_call(self.sweep.run)
