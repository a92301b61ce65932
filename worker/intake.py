"""Intake half of the worker: reading entries (own pending, reclaimed, new), validating
them and starting them in the engine. Mixed into worker.service.Worker, whose state it
uses (engine, redis, keys, publisher, jobs, metrics).

Invariant: a job enters ``self.jobs`` only after the START script made this worker its
owner (attempt bumped, status running); anything that cannot run is dead-lettered and
acked in one script (REJECT), so no entry is left pending by a live worker.
"""
from __future__ import annotations

import time

from producer.keys import GROUP
from producer.schema import parse_event
from worker import faults
from worker.jobs import BadEntry, Job, parse_entry, sampling_params
from worker.recovery import reclaim


class Intake:
    def _room(self) -> int:
        eng = self.engine
        if not eng.can_admit():
            return 0
        return max(0, eng.config.max_num_seqs - eng.num_running - eng.num_waiting)

    def _intake(self, own_pending: bool = False) -> bool:
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
        self.intake_round_trips += 1
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
        start only to the jobs it got to (poison detection counts starts)."""
        if not fields:  # its data was deleted from the stream: nothing to run
            self._ack_del(entry_id)
            return
        try:
            req = parse_entry(fields)
        except BadEntry as e:
            self._reject_entry(entry_id, fields, str(e), e.job_id, deliveries)
            return
        job_id = fields["job"]
        if job_id in self.jobs:  # already running here (claimed back by our own refresh)
            return
        jlog = self.log.bind(job_id=job_id)
        self.intake_round_trips += 1
        res = self._start(keys=[self.keys.job(job_id), self.keys.queued_tokens(self.model),
                                self.keys.queued_jobs(self.model)],
                          args=[self.worker_id, f"{time.time():.6f}", self.model,
                                self.s.max_deliveries])
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
        job = Job(job_id, entry_id, attempt, req, deadline, admitted_at=time.monotonic())
        resumed_ids, next_index = self._replay_events(job)
        self.publisher.register(job_id, attempt, next_index)
        if deadline is not None and time.time() > deadline:
            jlog.info("job_expired")
            self._final(job, "expired", "deadline")
            return
        faults.on_admit(str(req.prompt or " ".join(m.content for m in req.messages or [])))
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
        self.metrics.prompt_tokens.inc(job.prompt_tokens)
        jlog.info("job_started", attempt=attempt, resumed_tokens=len(resumed_ids))

    def _ack_del(self, entry_id: str) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.xack(self.stream, GROUP, entry_id).xdel(self.stream, entry_id).execute()

    def _replay_events(self, job: Job) -> tuple[list[int], int]:
        """A reclaimed job continues after the tokens its earlier attempts published."""
        if job.attempt <= 1:
            return [], 0
        ids: list[int] = []
        n = 0
        for _eid, f in self.r.xrange(self.keys.out(job.job_id)):
            ev = parse_event(f)
            if ev.index != n or ev.type != "token":
                break
            ids.extend(ev.token_ids)
            job.text.append(ev.delta)
            n += 1
        return ids, n

    def _reject_entry(self, entry_id: str, fields: dict, reason: str, job_id: str,
                      deliveries: int) -> None:
        self.log.warning("entry_rejected", entry_id=entry_id, job_id=job_id, reason=reason)
        body = str(fields.get("body", fields))[:10000]
        self._reject(keys=[self.stream, self.keys.dlq(self.model), self.keys.job(job_id or "_"),
                           self.keys.out(job_id or "_")],
                     args=[GROUP, entry_id, reason, job_id, body, f"{time.time():.6f}",
                           self.s.result_ttl_s, self.keys.chan(job_id or "_"), deliveries])
        self.metrics.finished.labels("failed").inc()

