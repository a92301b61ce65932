"""The worker loop: Redis intake -> engine.step() -> publish -> ack.

One thread runs the engine (this loop); one publisher thread talks to Redis for the
results. Intake reads only as many entries as the engine can admit, and blocks on Redis
only while the engine is idle, so a job that arrives mid-generation joins the running
batch at the next step.
"""
from __future__ import annotations

import os
import socket
import time

import redis
import structlog

from engine.llm_engine import LLMEngine
from producer.keys import GROUP, Keys
from producer.schema import parse_event
from producer.settings import Settings
from worker import lua
from worker.jobs import BadEntry, Job, parse_entry, sampling_params
from worker.publisher import Final, Publisher

log = structlog.get_logger("pagedq.worker")


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class Worker:
    def __init__(self, engine: LLMEngine, settings: Settings | None = None, *,
                 model: str | None = None, worker_id: str | None = None) -> None:
        self.s = settings or Settings()
        self.engine = engine
        self.model = model or self.s.model
        self.worker_id = worker_id or default_worker_id()
        self.keys = Keys(self.s.prefix)
        self.r = redis.Redis.from_url(self.s.redis_url, decode_responses=True,
                                      health_check_interval=10)
        self.stream = self.keys.jobs(self.model)
        self.publisher = Publisher(self.r, self.keys, self.s, self.model)
        self._start = self.r.register_script(lua.START)
        self._reject = self.r.register_script(lua.REJECT)
        self._refresh = self.r.register_script(lua.REFRESH)
        self.jobs: dict[str, Job] = {}
        self._stopping = False
        self._last_housekeeping = 0.0
        self.log = log.bind(worker_id=self.worker_id, model=self.model)

    # ---- lifecycle --------------------------------------------------------------------
    def request_stop(self) -> None:
        self._stopping = True

    def run(self, *, until_idle: bool = False) -> None:
        """Serve until ``request_stop()`` (or, with ``until_idle``, until nothing is left)."""
        self._ensure_group()
        self.publisher.start()
        self.log.info("worker_started", stream=self.stream)
        drain_until = None
        try:
            self._intake(own_pending=True)
            while True:
                self._drain_cancels()
                if self._stopping:
                    now = time.monotonic()
                    if drain_until is None:
                        drain_until = now + self.s.drain_timeout_s
                        self.log.info("drain_started", running=len(self.jobs))
                    if not self.jobs or now > drain_until:
                        break
                else:
                    self._intake()
                if self.engine.has_unfinished():
                    self._emit(self.engine.step())
                    self.publisher.check_cancels(list(self.jobs))
                elif until_idle and not self._has_backlog():
                    break
                self._housekeeping()
            self._release_all()
        finally:
            self.publisher.stop()
            self.log.info("worker_stopped")

    def _release_all(self) -> None:
        """Hand unfinished jobs back: abort them here and mark their entries long idle so
        any other worker's next reclaim takes them (they resume from their events)."""
        if not self.jobs:
            return
        ids = [j.entry_id for j in self.jobs.values()]
        for job_id in list(self.jobs):
            self.engine.abort_request(job_id)
        self.publisher.flush()
        idle_ms = int(self.s.lease_s * 1000) * 10
        self.r.xclaim(self.stream, GROUP, self.worker_id, 0, ids, idle=idle_ms, justid=True)
        self.log.info("jobs_released", count=len(ids))
        self.jobs.clear()

    def _ensure_group(self) -> None:
        try:
            self.r.xgroup_create(self.stream, GROUP, id="0", mkstream=True)
        except redis.ResponseError as e:
            if "BUSYGROUP" not in str(e):
                raise

    def _has_backlog(self) -> bool:
        info = self.r.xinfo_groups(self.stream)
        for g in info:
            if g["name"] == GROUP:
                return bool(g.get("lag") or g.get("pending"))
        return False

    # ---- intake -----------------------------------------------------------------------
    def _intake(self, own_pending: bool = False) -> None:
        eng = self.engine
        room = eng.config.max_num_seqs - eng.num_running - eng.num_waiting
        if room <= 0 or not eng.can_admit():
            return
        block = None if (eng.has_unfinished() or own_pending) else 500
        resp = self.r.xreadgroup(GROUP, self.worker_id, {self.stream: "0" if own_pending else ">"},
                                 count=room, block=block)
        for _stream, entries in resp or []:
            for entry_id, fields in entries:
                if fields is None:  # pending entry whose data was trimmed/deleted
                    self.r.xack(self.stream, GROUP, entry_id)
                    continue
                self._admit(entry_id, fields)

    def _admit(self, entry_id: str, fields: dict[str, str]) -> None:
        try:
            req = parse_entry(fields)
        except BadEntry as e:
            self._reject_entry(entry_id, fields, str(e), e.job_id)
            return
        job_id = fields["job"]
        jlog = self.log.bind(job_id=job_id)
        res = self._start(keys=[self.keys.job(job_id), self.keys.queued_tokens(self.model)],
                          args=[self.worker_id, f"{time.time():.6f}", self.model])
        if res[0] != "ok":
            jlog.info("job_skipped", status=res[1])
            self.r.xack(self.stream, GROUP, entry_id)
            return
        attempt, deadline = int(res[1]), float(res[2]) if res[2] else None
        job = Job(job_id, entry_id, attempt, req, deadline)
        resumed_ids, next_index = self._replay_events(job)
        self.publisher.register(job_id, attempt, next_index)
        if deadline is not None and time.time() > deadline:
            jlog.info("job_expired")
            self._final(job, "expired", "deadline")
            return
        try:
            messages = [m.model_dump() for m in req.messages] if req.messages else None
            job.prompt_tokens = self.engine.add_request(
                job_id, req.prompt, sampling_params(req), messages=messages,
                priority=req.priority, resume_token_ids=resumed_ids)
        except ValueError as e:
            jlog.info("job_rejected", reason=str(e))
            self.r.xadd(self.keys.dlq(self.model), {"entry": entry_id, "job": job_id,
                                                    "reason": str(e), "body": fields["body"]},
                        maxlen=100000, approximate=True)
            self._final(job, "failed", "error", error=str(e))
            return
        job.completion_tokens = len(resumed_ids)
        self.jobs[job_id] = job
        jlog.info("job_started", attempt=attempt, resumed_tokens=len(resumed_ids))

    def _replay_events(self, job: Job) -> tuple[list[int], int]:
        """A reclaimed job continues after the tokens its earlier attempts published."""
        if job.attempt <= 1:
            return [], 0
        ids: list[int] = []
        n = 0
        for _eid, f in self.r.xrange(self.keys.out(job.job_id)):
            ev = parse_event(f)
            if ev.index != n or ev.type != "token":
                break  # trimmed or unexpected: resume from what is contiguous
            ids.extend(ev.token_ids)
            job.text.append(ev.delta)
            n += 1
        return ids, n

    def _reject_entry(self, entry_id: str, fields: dict, reason: str, job_id: str) -> None:
        self.log.warning("entry_rejected", entry_id=entry_id, job_id=job_id, reason=reason)
        jk = self.keys.job(job_id) if job_id else self.keys.job("_")
        ok = self.keys.out(job_id) if job_id else self.keys.out("_")
        body = str(fields.get("body", fields))[:10000]
        self._reject(keys=[self.stream, self.keys.dlq(self.model), jk, ok],
                     args=[GROUP, entry_id, reason, job_id, body, f"{time.time():.6f}",
                           self.s.result_ttl_s, self.keys.chan(job_id or "_"), 1])

    # ---- results ----------------------------------------------------------------------
    def _emit(self, outs: list) -> None:
        batch = []
        for o in outs:
            job = self.jobs.get(o.request_id)
            if job is None:
                continue
            job.text.append(o.delta)
            job.completion_tokens = o.num_output_tokens
            batch.append((job.job_id, job.attempt, o.delta, o.new_token_ids, o.logprobs))
        self.publisher.tokens(batch)
        for o in outs:
            if o.finished and o.request_id in self.jobs:
                self._final(self.jobs.pop(o.request_id), "finished", o.finish_reason or "stop")

    def _final(self, job: Job, status: str, reason: str, error: str = "") -> None:
        self.jobs.pop(job.job_id, None)
        jlog = self.log.bind(job_id=job.job_id)

        def done(verdict: str) -> None:
            jlog.info("job_done", status=status, finish_reason=reason, verdict=verdict,
                      completion_tokens=job.completion_tokens)

        self.publisher.final(Final(job.job_id, job.attempt, job.entry_id, status, reason,
                                   "".join(job.text), error, job.prompt_tokens,
                                   job.completion_tokens, done))

    def _drain_cancels(self) -> None:
        while not self.publisher.cancel_hits.empty():
            job_id = self.publisher.cancel_hits.get()
            job = self.jobs.get(job_id)
            if job is not None:
                self.engine.abort_request(job_id)
                self._final(job, "cancelled", "cancelled")
        now = time.time()
        for job in [j for j in self.jobs.values() if j.deadline is not None and now > j.deadline]:
            self.engine.abort_request(job.job_id)
            self._final(job, "finished", "deadline")

    # ---- liveness ---------------------------------------------------------------------
    def _housekeeping(self) -> None:
        """Heartbeat and lease refresh, queued from the engine loop itself: a wedged loop
        stops both, so its jobs become claimable by other workers."""
        now = time.time()
        if now - self._last_housekeeping < 1.0:
            return
        self._last_housekeeping = now
        wk, ttl = self.keys.worker(self.worker_id), int(self.s.heartbeat_ttl_s) + 1
        state = {"model": self.model, "running": len(self.jobs), "at": f"{now:.3f}",
                 "kv_usage": f"{self.engine.kv_cache_usage:.4f}"}
        owned = list(self.jobs.values())
        refresh_keys = [self.stream] + [self.keys.job(j.job_id) for j in owned]
        refresh_args: list = [GROUP, self.worker_id]
        for j in owned:
            refresh_args += [j.entry_id, j.attempt]

        def beat(pipe) -> None:
            pipe.hset(wk, mapping=state)
            pipe.expire(wk, ttl)
            pipe.zadd(self.keys.workers, {self.worker_id: now})
            if owned:
                self._refresh(keys=refresh_keys, args=refresh_args, client=pipe)

        self.publisher.call(beat)
