"""Admission: an entry read from a jobs stream, parsed, STARTed and started in the engine
(a part of intake, worker/intake.py, which reads the entries). Parsing and START run on
either thread (the reader thread's one pipelined START per read: ``start_many``); the rest
(``admit``), and everything touching the engine or the job table, on the engine thread.

Invariant: a job enters the job table (worker/job_table.py) only after the START script
made this worker its owner (attempt bumped, status running); anything that cannot run is
dead-lettered and acked in one script (REJECT), so no entry is left pending by a live
worker, but one whose START a full Redis refused (``Read.deferred``): it stays pending, and
the worker reads its own pending entries again once Redis takes writes (``deferred``).
"""
from __future__ import annotations

import dataclasses
import time
from enum import StrEnum

import redis

from pagedq.wire import script
from pagedq.wire.events import replay
from pagedq.wire.keys import GROUP, Keys
from pagedq.wire.schema import FinishReason, JobRequest, Status
from pagedq.wire.worker_scripts import NAMES as WORKER_SCRIPTS
from pagedq.wire.worker_scripts import Reject, Start, Started, StartKind
from pagedq.worker import chat, faults, lanes
from pagedq.worker.job_table import JobTable
from pagedq.worker.jobs import (
    BadEntry,
    Job,
    WorkerIdentity,
    engine_requests,
    parse_entry,
)
from pagedq.worker.metrics import Metrics
from pagedq.worker.pacing import StepPacer
from pagedq.worker.publisher import Publisher

DLQ_BODY_CHARS = 4096


class Read(StrEnum):
    """Where an entry read is on its way to admission."""

    deleted = "deleted"  # no fields left: ack it
    bad = "bad"  # dead-letter it (``error``)
    running = "running"  # already this worker's: nothing to do
    parsed = "parsed"  # ``req``; START is next
    started = "started"  # START made this worker its owner (``started``)
    deferred = "deferred"  # a full Redis refused START: left pending, read again later


@dataclasses.dataclass(frozen=True, slots=True)
class EntryRead:
    """An entry read, on its way to admission (``kind``)."""
    keys: Keys
    lane: str
    entry_id: str
    fields: dict[str, str] | None
    kind: Read
    req: JobRequest | None = None
    started: Started | None = None
    error: str = ""
    job_id: str = ""


class Admission:
    def __init__(self, ident: WorkerIdentity, engine, publisher: Publisher, metrics: Metrics,
                 pacer: StepPacer, jobs: JobTable, log) -> None:
        """``jobs``: the worker's job table; admission adds the jobs it starts, ends those
        that end at once (expired, replayed to their end, too slow) and drops those it
        dead-letters."""
        self.ident, self.r, self.s = ident, ident.r, ident.settings
        self.model, self.worker_id = ident.model, ident.worker_id
        self.engine, self.publisher, self.metrics, self.pacer = engine, publisher, metrics, pacer
        self.jobs, self.log = jobs, log
        # entries of ours left pending because Redis refused their START for memory: the
        # service reads its own pending entries again once Redis takes writes
        self.deferred = False
        self.starts = 0  # entries STARTed (Redis took the write), for the service's health

    def parse(self, keys: Keys, lane: str, entry_id: str,
              fields: dict[str, str] | None) -> EntryRead:
        """Admission's first step, on either thread: the entry's request, or why it has
        none."""
        if not fields:  # its data was deleted from the stream: nothing to run
            return EntryRead(keys, lane, entry_id, fields, Read.deleted)
        try:
            req = parse_entry(fields, self.model, lane)
        except BadEntry as e:
            return EntryRead(keys, lane, entry_id, fields, Read.bad, error=str(e),
                             job_id=e.job_id)
        # already running here (claimed back by our refresh). On the reader thread this
        # reads the engine thread's table: a membership test, and while a read is under way
        # the engine thread adds no job that could be in it (no reclaim meanwhile)
        if keys.job(fields["job"]) in self.jobs:
            return EntryRead(keys, lane, entry_id, fields, Read.running)
        return EntryRead(keys, lane, entry_id, fields, Read.parsed, req=req)

    def _start_call(self, e: EntryRead) -> Start:
        return Start(e.keys, e.fields["job"], self.model, e.lane, self.worker_id,
                     self.s.max_deliveries)

    def start_one(self, e: EntryRead) -> EntryRead:
        """START for a parsed entry, in one round trip of the engine thread."""
        try:
            reply = script.run(self.r, self._start_call(e))
        except redis.ResponseError as err:  # e.g. WRONGTYPE: a hostile write to the job's keys
            reply = err
        return self._started(e, reply)

    def start_many(self, reads: list[EntryRead]) -> tuple[list[EntryRead], int]:
        """``reads`` with START's outcome for each parsed one, all in one pipelined round
        trip (the reader thread's; one more each time Redis lost its script cache), and
        how many round trips that took."""
        at = [i for i, e in enumerate(reads) if e.kind is Read.parsed]
        replies, trips = self._start_replies([reads[i] for i in at])
        reads = list(reads)
        for i, reply in zip(at, replies, strict=True):
            reads[i] = self._started(reads[i], reply)
        return reads, trips

    def _start_replies(self, parsed: list[EntryRead]) -> tuple[list, int]:
        """START for each entry, pipelined: each one's Started, a ResponseError where Redis
        refused one; and the round trips."""
        todo, replies, trips = list(range(len(parsed))), [None] * len(parsed), 0
        while todo:
            trips += 1
            pipe = self.r.pipeline(transaction=False)
            calls = [self._start_call(parsed[i]) for i in todo]
            for call in calls:
                script.queue(pipe, call)
            res = pipe.execute(raise_on_error=False)
            script.raise_retryable(res)
            for i, x in zip(todo, script.results(calls, res), strict=True):
                replies[i] = x
            # Redis lost its script cache: load it, send those again (none of them ran)
            todo = [i for i, x in zip(todo, res, strict=True)
                    if isinstance(x, redis.exceptions.NoScriptError)]
            if todo:
                script.load(self.r, WORKER_SCRIPTS)
        return replies, trips

    @staticmethod
    def _started(e: EntryRead, reply: Started | Exception) -> EntryRead:
        """``e`` with START's ``reply`` (a ResponseError where Redis refused the job's keys:
        the entry is dead-lettered; any other error is a fault)."""
        if script.is_oom(reply):  # a full Redis: not the entry's fault
            return dataclasses.replace(e, kind=Read.deferred)
        if isinstance(reply, redis.ResponseError):
            return dataclasses.replace(e, kind=Read.bad, job_id=e.fields["job"],
                                       error=f"redis refused the job's keys: {reply}")
        if isinstance(reply, Exception):
            raise reply
        return dataclasses.replace(e, kind=Read.started, started=reply)

    def admit(self, e: EntryRead, deliveries: int) -> None:
        """The second half of admission, on the engine thread. Whatever the entry holds, it
        is admitted or dead-lettered: it never raises out of here."""
        if e.kind is Read.deferred:
            self.deferred = True
        elif e.kind is Read.deleted:
            self._ack_del(e.keys, e.lane, e.entry_id)
        elif e.kind is Read.bad:
            self._reject_entry(e.keys, e.lane, e.entry_id, e.fields, e.error, e.job_id,
                               deliveries)
        elif e.kind is Read.started:
            self.starts += 1  # (Redis took a START: it is not full for us)
            try:
                self._start_job(e.keys, e.lane, e.entry_id, e.fields, e.req, deliveries,
                                e.started)
            except redis.ResponseError as err:  # e.g. WRONGTYPE on the job's events stream
                self._reject_entry(e.keys, e.lane, e.entry_id, e.fields,
                                   f"redis refused the job's keys: {err}", e.fields["job"],
                                   deliveries)

    def _start_job(self, keys: Keys, lane: str, entry_id: str, fields: dict[str, str],
                   req: JobRequest, deliveries: int, res: Started) -> None:
        job_id = fields["job"]
        faults.maybe_raise("intake", [job_id])
        jlog = self.log.bind(job_id=job_id, prefix=keys.prefix)
        if res.kind is StartKind.poison:
            self._reject_entry(keys, lane, entry_id, fields, f"poison job: started "
                               f"{res.attempts} times without a result (max_deliveries="
                               f"{self.s.max_deliveries})", job_id, deliveries)
            return
        if res.kind is not StartKind.ok:
            jlog.info("job_skipped", status=res.status)
            self._ack_del(keys, lane, entry_id)
            return
        attempt, deadline = res.attempt, res.deadline
        job = Job(job_id, entry_id, attempt, req.n, lane, keys, deadline,
                  admitted_at=time.monotonic(), queue_wait_s=res.queue_wait_s)
        self.metrics.queue_wait.labels(lane).observe(job.queue_wait_s)
        next_index = self._replay_events(job)
        if deadline is not None and time.time() > deadline:
            jlog.info("job_expired")
            self.publisher.register(keys, job_id, attempt, next_index)
            self.jobs.end(job, Status.expired, FinishReason.deadline)
            return
        faults.on_admit(str(req.prompt or " ".join(m.text for m in req.messages or [])))
        try:
            job.prompt_tokens = self._add_to_engine(job, req)
        except Exception as e:  # noqa: BLE001 - input this engine cannot take fails its job
            self.engine.abort_request(job.uid)
            if not isinstance(e, ValueError):
                jlog.error("engine_refused_job", error=repr(e), exc_info=e)
            self._reject_entry(keys, lane, entry_id, fields, str(e) or type(e).__name__,
                               job_id, deliveries)
            return
        self.publisher.register(keys, job_id, attempt, next_index)
        self.jobs.add(job)
        if job.done:  # every choice had ended before a crash (replayed): just finish
            self.jobs.end(job, Status.finished, job.finish_reason())
            return
        too_slow, by_deadline = self._prefill_too_slow(job)
        if too_slow:  # the job's own deadline: it expires; the worker's limit: it fails
            self.engine.abort_request(job.uid)
            self.jobs.end(job, *((Status.expired, FinishReason.deadline) if by_deadline
                                else (Status.failed, FinishReason.error)), error=too_slow)
            return
        self.metrics.prompt_tokens.inc(job.prompt_tokens)
        jlog.info("job_started", attempt=attempt, resumed_tokens=job.completion_tokens)

    def _add_to_engine(self, job: Job, req: JobRequest) -> int:
        """One engine request per unfinished choice (resumed after its replayed tokens);
        returns the prompt length."""
        prompt, messages = req.prompt, None
        if req.messages and chat.needs_rendering(req):  # tools: rendered here (worker/chat.py)
            prompt = chat.prompt_ids(self.engine.tokenizer, req)
        elif req.messages:
            messages = [m.model_dump(exclude_none=True) for m in req.messages]
        prompt_tokens = 0
        lanes_ = self.ident.lanes
        priority = lanes.engine_priority(lanes_.index(job.lane), len(lanes_), req.priority)
        requests = engine_requests(job, req, req.output_spec())
        for choice, (rid, params) in zip(job.choices, requests, strict=True):
            if choice.finish_reason is not None:
                continue
            prompt_tokens = self.engine.add_request(
                rid, prompt, params, messages=messages, priority=priority,
                resume_token_ids=choice.resumed_ids)
        return prompt_tokens or len(self.engine.encode(prompt, messages))

    def _prefill_too_slow(self, job: Job) -> tuple[str, bool]:
        """Why the job cannot be prefilled in time on this worker ('' if it can), and
        whether the job's deadline (not PAGEDQ_MAX_PREFILL_S) is what it cannot meet."""
        est = self.pacer.prefill_estimate_s(job.prompt_tokens * len(job.choices))
        if est is None:
            return "", False
        limit, by_deadline = self.s.max_prefill_s or float("inf"), False
        if job.deadline is not None and job.deadline - time.time() < limit:
            limit, by_deadline = job.deadline - time.time(), True
        if est <= limit:
            return "", False
        what = "the job's deadline" if by_deadline else "PAGEDQ_MAX_PREFILL_S"
        return (f"prompt of {job.prompt_tokens} tokens needs about {est:.0f} s to prefill on "
                f"this worker; {what} allows {max(limit, 0):.0f} s"), by_deadline

    def _ack_del(self, keys: Keys, lane: str, entry_id: str) -> None:
        stream = self.ident.stream(lane, keys)
        pipe = self.r.pipeline(transaction=True)
        pipe.xack(stream, GROUP, entry_id).xdel(stream, entry_id).execute()

    def _replay_events(self, job: Job) -> int:
        """A reclaimed job continues after the tokens its earlier attempts published;
        returns the next event index (wire/events.py ``replay``)."""
        if job.attempt <= 1:
            return 0
        replayed, next_index = replay(self.r.xrange(job.keys.out(job.job_id)),
                                      len(job.choices))
        for choice, done in zip(job.choices, replayed, strict=True):
            choice.resumed_ids.extend(done.token_ids)
            choice.num_tokens += len(done.token_ids)
            choice.text.writelines(done.deltas)
            choice.finish_reason = done.finish_reason
        return next_index

    def _reject_entry(self, keys: Keys, lane: str, entry_id: str, fields: dict, reason: str,
                      job_id: str, deliveries: int) -> None:
        self.log.warning("entry_rejected", entry_id=entry_id, job_id=job_id, lane=lane,
                         prefix=keys.prefix, reason=reason)
        # bytes, as they came: hiredis packs str arguments as strict UTF-8, and a body that
        # is not UTF-8 arrives here with surrogate escapes (see Worker's connection)
        body = str(fields.get("body", fields))[:DLQ_BODY_CHARS].encode("utf-8", "surrogateescape")
        script.run(self.r, Reject(keys, self.model, lane, entry_id, reason[:DLQ_BODY_CHARS],
                                  job_id or "", body, time.time(), self.s.result_ttl_s,
                                  deliveries, self.s.dlq_ttl_s))
        if job_id:
            self.jobs.drop(keys.job(job_id))
        self.metrics.ended(keys.prefix, Status.failed, FinishReason.error)

