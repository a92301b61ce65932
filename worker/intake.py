"""Intake: reading entries (own pending, reclaimed, new), validating them and starting
them in the engine. A part of the worker (worker/service.py composes it): it adds jobs to
the service's table of owned jobs and hands jobs that end at once to ``end_job``.

Invariant: a job enters ``jobs`` only after the START script made this worker its owner
(attempt bumped, status running); anything that cannot run is dead-lettered and acked in
one script (REJECT), so no entry is left pending by a live worker.
"""
from __future__ import annotations

import time
from collections.abc import Callable

import redis

from producer.keys import GROUP
from producer.schema import FinishReason, JobRequest, Status, parse_event
from worker import faults, lua
from worker.jobs import BadEntry, Job, WorkerIdentity, parse_entry, sampling_params
from worker.metrics import Metrics
from worker.pacing import StepPacer
from worker.publisher import Publisher
from worker.recovery import reclaim

DLQ_BODY_CHARS = 4096  # a dead-lettered body is kept this long: enough to see what it was


class Intake:
    def __init__(self, ident: WorkerIdentity, engine, publisher: Publisher, metrics: Metrics,
                 pacer: StepPacer, jobs: dict[str, Job],
                 end_job: Callable[..., None], log) -> None:
        """``jobs``: the service's table of owned jobs (intake adds to it, and removes a
        job it dead-letters); ``end_job(job, status, reason, error="")``: how a job that
        ends at admission is finished (expired, replayed to its end, too slow)."""
        self.r, self.keys, self.s = ident.r, ident.keys, ident.settings
        self.model, self.worker_id, self.stream = ident.model, ident.worker_id, ident.stream
        self.engine, self.publisher, self.metrics, self.pacer = engine, publisher, metrics, pacer
        self.jobs, self.end_job, self.log = jobs, end_job, log
        self._start = lua.Script(self.r, lua.START)
        self._reject = lua.Script(self.r, lua.REJECT)
        self.round_trips = 0  # Redis round trips of the engine thread (bench/service.py)
        self._next_reclaim = self._next_poll = 0.0
        self._claim_cursor = "0-0"

    def has_backlog(self) -> bool:
        for g in self.r.xinfo_groups(self.stream):
            if g["name"] == GROUP:
                return bool(g.get("lag") or g.get("pending"))
        return False

    def _room(self) -> int:
        eng = self.engine
        if not eng.can_admit():
            return 0
        return max(0, eng.config.max_num_seqs - eng.num_running - eng.num_waiting)

    def poll(self, own_pending: bool = False) -> bool:
        """Admit entries: own pending ones first (after a restart), then idle ones of
        other workers, then new ones. Returns False while own pending remain."""
        room = self._room()
        if room <= 0:
            return False
        if own_pending:
            resp = self.r.xreadgroup(GROUP, self.worker_id, {self.stream: "0"}, count=room)
            entries = resp[0][1] if resp else []
            if entries:
                pend = self.r.xpending_range(self.stream, GROUP, min=entries[0][0],
                                             max=entries[-1][0], count=len(entries),
                                             consumername=self.worker_id)
                counts = {p["message_id"]: p["times_delivered"] for p in pend}
                for entry_id, fields in entries:
                    self._admit(entry_id, fields, counts.get(entry_id, 1))
            return len(entries) < room
        if time.monotonic() >= self._next_reclaim:
            self._next_reclaim = time.monotonic() + max(0.5, self.s.lease_s / 4)
            self._claim_cursor, claimed = reclaim(self.r, self.stream, self.worker_id,
                                                  self.s.lease_s, room, self._claim_cursor)
            for c in claimed:
                self.metrics.reclaims.inc()
                self.log.info("entry_reclaimed", entry_id=c.entry_id, deliveries=c.deliveries)
                self._admit(c.entry_id, c.fields, c.deliveries)
            room = self._room()
            if room <= 0:
                return True
        busy = self.engine.has_unfinished()
        if busy and time.monotonic() < self._next_poll:
            return True
        self.round_trips += 1
        resp = self.r.xreadgroup(GROUP, self.worker_id, {self.stream: ">"}, count=room,
                                 block=None if busy else 500)
        got = 0
        for _stream, entries in resp or []:
            for entry_id, fields in entries:
                got += 1
                self._admit(entry_id, fields, 1)
        self._next_poll = 0.0 if got else time.monotonic() + self.s.intake_poll_ms / 1000.0
        return True

    def _admit(self, entry_id: str, fields: dict[str, str] | None, deliveries: int) -> None:
        """START runs here, per entry, right before the job enters the engine (not batched
        over the entries read): a worker that crashes while admitting has then charged a
        start only to the jobs it got to (poison detection counts starts). Whatever one
        entry holds, it is admitted or dead-lettered: it never raises out of here."""
        if not fields:  # its data was deleted from the stream: nothing to run
            self._ack_del(entry_id)
            return
        try:
            req = parse_entry(fields, self.model)
        except BadEntry as e:
            self._reject_entry(entry_id, fields, str(e), e.job_id, deliveries)
            return
        try:
            self._start_job(entry_id, fields, req, deliveries)
        except redis.ResponseError as e:  # e.g. WRONGTYPE: a hostile write to the job's keys
            self._reject_entry(entry_id, fields, f"redis refused the job's keys: {e}",
                               fields["job"], deliveries)

    def _start_job(self, entry_id: str, fields: dict[str, str], req: JobRequest,
                   deliveries: int) -> None:
        job_id = fields["job"]
        if job_id in self.jobs:  # already running here (claimed back by our own refresh)
            return
        faults.maybe_raise("intake", [job_id])
        jlog = self.log.bind(job_id=job_id)
        self.round_trips += 1
        res = self._start(keys=[self.keys.job(job_id), self.keys.queued_tokens(self.model),
                                self.keys.queued_jobs(self.model)],
                          args=[self.worker_id, self.model, self.s.max_deliveries])
        if res[0] == "poison":
            self._reject_entry(entry_id, fields, f"poison job: started {res[1]} times without "
                               f"a result (max_deliveries={self.s.max_deliveries})", job_id,
                               deliveries)
            return
        if res[0] != "ok":
            jlog.info("job_skipped", status=res[1])
            self._ack_del(entry_id)
            return
        attempt, deadline = int(res[1]), float(res[2]) if res[2] else None
        job = Job(job_id, entry_id, attempt, req, deadline, admitted_at=time.monotonic(),
                  queue_wait_s=float(res[4]))
        self.metrics.queue_wait.observe(job.queue_wait_s)
        next_index = self._replay_events(job)
        if deadline is not None and time.time() > deadline:
            jlog.info("job_expired")
            self.publisher.register(job_id, attempt, next_index)
            self.end_job(job, Status.expired, FinishReason.deadline)
            return
        faults.on_admit(str(req.prompt or " ".join(m.content for m in req.messages or [])))
        try:
            job.prompt_tokens = self._add_to_engine(job)
        except Exception as e:  # noqa: BLE001 - input this engine cannot take fails its job
            self.engine.abort_request(job_id)
            if not isinstance(e, ValueError):
                jlog.error("engine_refused_job", error=repr(e), exc_info=e)
            self._reject_entry(entry_id, fields, str(e) or type(e).__name__, job_id, deliveries)
            return
        self.publisher.register(job_id, attempt, next_index)
        self.jobs[job_id] = job
        if job.done:  # every choice had ended before a crash (replayed): just finish
            self.end_job(job, Status.finished, job.finish_reason())
            return
        too_slow = self._prefill_too_slow(job)
        if too_slow:
            self.engine.abort_request(job_id)
            self.end_job(job, Status.failed, FinishReason.error, error=too_slow)
            return
        self.metrics.prompt_tokens.inc(job.prompt_tokens)
        jlog.info("job_started", attempt=attempt, resumed_tokens=job.completion_tokens)

    def _add_to_engine(self, job: Job) -> int:
        """One engine request per unfinished choice (resumed after its replayed tokens);
        returns the prompt length."""
        req = job.request
        messages = ([m.model_dump(exclude_none=True) for m in req.messages]
                    if req.messages else None)
        prompt_tokens = 0
        for k, choice in enumerate(job.choices):
            if choice.finish_reason is not None:
                continue
            prompt_tokens = self.engine.add_request(
                job.request_id(k), req.prompt, sampling_params(req, k), messages=messages,
                priority=req.priority, resume_token_ids=choice.resumed_ids)
        return prompt_tokens or len(self.engine.encode(req.prompt, messages))

    def _prefill_too_slow(self, job: Job) -> str:
        """Why the job cannot be prefilled in time on this worker, or ''."""
        est = self.pacer.prefill_estimate_s(job.prompt_tokens * len(job.choices))
        if est is None:
            return ""
        limit, what = self.s.max_prefill_s or float("inf"), "PAGEDQ_MAX_PREFILL_S"
        if job.deadline is not None and job.deadline - time.time() < limit:
            limit, what = job.deadline - time.time(), "the job's deadline"
        if est <= limit:
            return ""
        return (f"prompt of {job.prompt_tokens} tokens needs about {est:.0f} s to prefill on "
                f"this worker; {what} allows {max(limit, 0):.0f} s")

    def _ack_del(self, entry_id: str) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.xack(self.stream, GROUP, entry_id).xdel(self.stream, entry_id).execute()

    def _replay_events(self, job: Job) -> int:
        """A reclaimed job continues after the tokens its earlier attempts published;
        returns the next event index. Replay stops at the first event it cannot use."""
        if job.attempt <= 1:
            return 0
        n = 0
        for _eid, f in self.r.xrange(self.keys.out(job.job_id)):
            try:
                ev = parse_event(f)
            except (ValueError, KeyError):
                break
            if ev.index != n or ev.type != "token" or not 0 <= ev.choice < len(job.choices):
                break
            choice = job.choices[ev.choice]
            choice.resumed_ids.extend(ev.token_ids)
            choice.num_tokens += len(ev.token_ids)
            choice.text.append(ev.delta)
            if ev.finish_reason:
                choice.finish_reason = ev.finish_reason
            n += 1
        return n

    def _reject_entry(self, entry_id: str, fields: dict, reason: str, job_id: str,
                      deliveries: int) -> None:
        self.log.warning("entry_rejected", entry_id=entry_id, job_id=job_id, reason=reason)
        # bytes, as they came: hiredis packs str arguments as strict UTF-8, and a body that
        # is not UTF-8 arrives here with surrogate escapes (see Worker's connection)
        body = str(fields.get("body", fields))[:DLQ_BODY_CHARS].encode("utf-8", "surrogateescape")
        job_id = job_id or ""
        self._reject(keys=[self.stream, self.keys.dlq(self.model), self.keys.job(job_id or "_"),
                           self.keys.out(job_id or "_"), self.keys.queued_tokens(self.model),
                           self.keys.queued_jobs(self.model)],
                     args=[GROUP, entry_id, reason[:DLQ_BODY_CHARS], job_id, body,
                           f"{time.time():.6f}", self.s.result_ttl_s, self.keys.chan(job_id or "_"),
                           deliveries, self.s.dlq_ttl_s])
        self.jobs.pop(job_id, None)
        self.metrics.finished.labels(Status.failed).inc()
