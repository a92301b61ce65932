"""Intake: reading entries (own pending, reclaimed, new), validating them and starting
them in the engine. A part of the worker (worker/service.py composes it): it adds jobs to
the service's table of owned jobs and hands jobs that end at once to ``end_job``. While
the engine is busy, new entries are read, parsed and STARTed on a reader thread, one read
at a time; everything else, and everything touching the engine or ``jobs``, runs on the
engine thread.

Invariant: a job enters ``jobs`` only after the START script made this worker its owner
(attempt bumped, status running); anything that cannot run is dead-lettered and acked in
one script (REJECT), so no entry is left pending by a live worker, but one whose START a
full Redis refused (``Read.deferred``): it stays pending, and the worker reads its own
pending entries again once Redis takes writes (``deferred``).

New jobs wait in each lane's inbox (SUBMIT's): how they are moved into the jobs streams and
read, idle or busy, on a single Redis or a cluster, is worker/reads.py.

Key spaces: a worker may serve several key prefixes (tenants), each split into partitions
(``ident.tenants``: every partition of every prefix); each key space has its own jobs
stream per lane. Lanes keep their order across key spaces; one lane's room is shared among
its key spaces' streams in fair shares (worker/tenants.py), and who goes first rotates.
Every entry is handled with the keys of the key space whose stream it came from.
"""
from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from enum import StrEnum

import redis

from pagedq.wire import script
from pagedq.wire.events import replay
from pagedq.wire.keys import GROUP, Keys
from pagedq.wire.schema import FinishReason, JobRequest, Status
from pagedq.wire.worker_scripts import NAMES as WORKER_SCRIPTS
from pagedq.wire.worker_scripts import Reject, Start, Started, StartKind
from pagedq.worker import chat, faults, lanes, tenants
from pagedq.worker.jobs import (
    BadEntry,
    Job,
    WorkerIdentity,
    parse_entry,
    sampling_params,
)
from pagedq.worker.metrics import Metrics
from pagedq.worker.pacing import StepPacer
from pagedq.worker.publisher import Publisher
from pagedq.worker.reads import NewEntries
from pagedq.worker.recovery import reclaim

DLQ_BODY_CHARS = 4096
LOWER_LANE_POLL_S = 0.1  # a busy worker looks at an empty lower lane this often
# a busy worker admits at most this many new entries per poll (each costs the engine thread
# a START round trip, parsing and engine.add_request: 0.6-0.7 ms on a dev machine's CPU): the
# engine steps between polls, so a burst of jobs is prefilled while the rest of it is
# admitted, instead of after all of it
BUSY_ADMIT_MAX = 32


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


class Intake:
    def __init__(self, ident: WorkerIdentity, engine, publisher: Publisher, metrics: Metrics,
                 pacer: StepPacer, jobs: dict[str, Job],
                 end_job: Callable[..., None], log) -> None:
        """``jobs``: the service's table of owned jobs (intake adds to it, and removes a
        job it dead-letters); ``end_job(job, status, reason, error="")``: how a job that
        ends at admission is finished (expired, replayed to its end, too slow)."""
        self.ident, self.r, self.s = ident, ident.r, ident.settings
        self.model, self.worker_id = ident.model, ident.worker_id
        self.engine, self.publisher, self.metrics, self.pacer = engine, publisher, metrics, pacer
        self.jobs, self.end_job, self.log = jobs, end_job, log
        # entries of ours left pending because Redis refused their START for memory: the
        # service reads its own pending entries again once Redis takes writes
        self.deferred = False
        self.starts = 0  # entries STARTed (Redis took the write), for the service's health
        # ``on_stream_made(stream)``: set by the service (a stream that vanished, made again)
        self.new = NewEntries(ident, lambda stream: self.on_stream_made(stream))
        self.on_stream_made: Callable[[str], None] = lambda stream: None
        self.round_trips = 0  # Redis round trips of the engine thread (bench/service.py)
        self.read_round_trips = 0  # of the reader thread (busy reads), the only writer
        # A busy worker's reads, and the START of what they read, run here, one read at a
        # time: the engine thread collects a read's entries at the poll after it ended and
        # never waits on Redis for them (each of its round trips also waited for the GIL
        # on the way back, up to the switch interval while the publisher thread ran). The
        # result is (lane, take, room, [EntryRead]); its exception is raised by the engine
        # thread's collect, so it ends the loop like any intake fault.
        self._reader = ThreadPoolExecutor(1, thread_name_prefix="pagedq-intake-read")
        self._inflight: Future | None = None
        self._scan_from = 0  # rank of the lane the next busy read looks at first
        self._next_reclaim = 0.0
        # while the engine is busy, a lane whose last read was empty is read again only
        # after intake_poll_ms (the first lane) or LOWER_LANE_POLL_S (the others)
        self._next_poll = dict.fromkeys(ident.lanes, 0.0)
        self._claim_cursor = dict.fromkeys(ident.streams, "0-0")
        self._floor = lanes.floor_seats(engine.config.max_num_seqs, self.s.lane_min_share)
        # per kind of read (a lane's, the idle read, a lane's reclaim): how many were made,
        # so that each kind has a different tenant first each time (tenants.rotated)
        self._turns: dict[str, int] = {}
        # jobs stream -> (its tenant's keys, its lane), and its lane's rank
        self._where = {ident.stream(lane, k): (k, lane) for lane in ident.lanes
                       for k in ident.tenants}
        self._rank = {stream: ident.lanes.index(lane) for stream, (_, lane) in
                      self._where.items()}

    @property
    def writes(self) -> int:
        """MOVE rounds and STARTs Redis took so far: one more says it is not full."""
        return self.starts + self.new.moves

    def has_backlog(self) -> bool:
        for lane in self.ident.lanes:
            for k in self.ident.tenants:
                if self.r.llen(k.inbox(self.model, lane)):
                    return True
                if not self.r.exists(stream := self.ident.stream(lane, k)):
                    continue
                for g in self.r.xinfo_groups(stream):
                    if g["name"] == GROUP and (g.get("lag") or g.get("pending")):
                        return True
        return False

    def _rooms(self) -> dict[str, int]:
        """Seats each lane may admit now (worker/lanes.py)."""
        held = dict.fromkeys(self.ident.lanes, 0)
        for job in self.jobs.values():
            held[job.lane] += job.seats
        eng = self.engine
        got = lanes.rooms(eng.config.max_num_seqs, list(held.values()), self._floor,
                          eng.can_admit())
        return dict(zip(held, got, strict=True))

    def poll(self, own_pending: bool = False) -> bool:
        """Admit entries: own pending ones first (after a restart), then idle ones of
        other workers, then new ones; each lane up to its room, highest lane first.
        Returns False while own pending remain."""
        if own_pending:
            more = False
            for lane in self.ident.lanes:
                for k in self.ident.tenants:
                    room = self._rooms()[lane]
                    if room > 0:
                        more |= not self._own_pending(k, lane, room)
            return not more
        self._collect(wait=not self.engine.has_unfinished())
        # reclaiming while a read is under way could admit more than that read's room
        if self._inflight is None and time.monotonic() >= self._next_reclaim:
            self._next_reclaim = time.monotonic() + max(0.5, self.s.lease_s / 4)
            for lane in self.ident.lanes:
                for k in self._tenant_order(f"reclaim {lane}"):
                    room = self._rooms()[lane]
                    if room <= 0:
                        break
                    stream = self.ident.stream(lane, k)
                    self._claim_cursor[stream], claimed = reclaim(
                        self.r, stream, self.worker_id, self.s.lease_s, room,
                        self._claim_cursor[stream])
                    for c in claimed:
                        self.metrics.reclaims.inc()
                        self.log.info("entry_reclaimed", entry_id=c.entry_id, lane=lane,
                                      prefix=k.prefix, deliveries=c.deliveries)
                        self._admit(k, lane, c.entry_id, c.fields, c.deliveries)
        self._read_new(self.engine.has_unfinished())
        return True

    def _tenant_order(self, kind: str) -> list[Keys]:
        """The tenants, the next one first at each read of this ``kind`` (round robin)."""
        turn = self._turns[kind] = self._turns.get(kind, -1) + 1
        return tenants.rotated(self.ident.tenants, turn)

    def _own_pending(self, keys: Keys, lane: str, room: int) -> bool:
        """Re-admit this worker's own pending entries of a tenant's lane (those of jobs it
        runs are read too, and left alone); True when none remain."""
        stream = self.ident.stream(lane, keys)
        running = sum(j.keys == keys and j.lane == lane for j in self.jobs.values())
        resp = self.r.xreadgroup(GROUP, self.worker_id, {stream: "0"}, count=room + running)
        entries = resp[0][1] if resp else []
        if entries:
            pend = self.r.xpending_range(stream, GROUP, min=entries[0][0], max=entries[-1][0],
                                         count=len(entries), consumername=self.worker_id)
            counts = {p["message_id"]: p["times_delivered"] for p in pend}
            for entry_id, fields in entries:
                self._admit(keys, lane, entry_id, fields, counts.get(entry_id, 1))
        return len(entries) < room + running

    def _read_new(self, busy: bool) -> None:
        """New entries. Idle: move and read one entry of every stream with room (every lane
        of every tenant) in one round trip; none: wait on the wake lists, then once more
        (the next poll, not blocking, fills the rest lane by lane). Busy: start the next
        read on the reader thread (``_submit_read``)."""
        if busy:
            if self._inflight is None:
                self._submit_read()
            return
        rooms, order = self._rooms(), self._tenant_order("idle")
        lanes_ = [ln for ln, room in rooms.items() if room > 0]
        if not lanes_:
            return
        resp, trips = self.new.idle_read(order, lanes_)
        self.round_trips += trips
        for stream, entries in sorted(resp or [], key=lambda x: self._rank[x[0]]):
            for entry_id, fields in entries:
                self._admit(*self._where[stream], entry_id, fields, 1)

    def _submit_read(self) -> None:
        """Busy: read one lane with room, the lanes in turn from ``_scan_from`` (highest
        first after a wrap), so a lower lane sees what the higher ones left. A lane's room
        in fair shares among its tenants, at most BUSY_ADMIT_MAX entries; a lane that
        filled its read while it may hold more is read again before any lower lane
        (``_collect``), so that no lower lane takes seats before it."""
        now, lanes_, rooms = time.monotonic(), self.ident.lanes, self._rooms()
        for rank in [*range(self._scan_from, len(lanes_)), *range(self._scan_from)]:
            lane, room = lanes_[rank], rooms[lanes_[rank]]
            if now < self._next_poll[lane] or room <= 0:
                continue
            take = min(room, BUSY_ADMIT_MAX)
            self._inflight = self._reader.submit(self._take, lane, take, room,
                                                 self._tenant_order(lane))
            return

    def _take(self, lane: str, take: int, room: int, order: list[Keys]) -> tuple:
        """The reader thread's work: ``take`` new entries of ``lane``, fair among tenants,
        parsed and STARTed in one more round trip. A worker that crashes while admitting
        them has charged a start to each (poison detection counts starts): to one read's
        entries at most, BUSY_ADMIT_MAX."""
        taken = tenants.fair_take(take, order, functools.partial(self._read_lane, lane))
        if faults.FAILPOINTS:
            faults.maybe_raise("intake_read", [f.get("job", "") for es in taken.values()
                                               for _, f in es if f])
        reads = [self._parse(k, lane, entry_id, fields)
                 for k, entries in taken.items() for entry_id, fields in entries]
        parsed = [i for i, e in enumerate(reads) if e.kind is Read.parsed]
        for i, reply in zip(parsed, self._start_many([reads[i] for i in parsed]), strict=True):
            reads[i] = self._started(reads[i], reply)
        return lane, take, room, reads

    def _collect(self, wait: bool) -> None:
        """Admit the entries of the read under way once it has ended (``wait``: wait for
        it). The only place the reader thread's results, and its faults, come back."""
        fut = self._inflight
        if fut is None or not (wait or fut.done()):
            return
        self._inflight = None
        lane, take, room, reads = fut.result()
        for e in reads:
            self._admit_read(e, 1)
        n = len(reads)
        rank = self.ident.lanes.index(lane)
        wait_s = self.s.intake_poll_ms / 1000.0 if rank == 0 else LOWER_LANE_POLL_S
        self._next_poll[lane] = 0.0 if n else time.monotonic() + wait_s
        self._scan_from = 0 if n == take < room else rank + 1

    def settle(self) -> None:
        """Admit what the read under way brings (a worker that stops polling: its entries
        are this worker's already, so they run or are released with the others)."""
        self._collect(wait=True)

    def close(self) -> None:
        self._reader.shutdown(wait=False, cancel_futures=True)

    def _read_lane(self, lane: str, counts: dict[Keys, int]) -> dict[Keys, list]:
        """New entries of a lane's streams, ``counts[tenant]`` of each (moved from their
        inboxes first), in one round trip (XREADGROUP's COUNT is per call: one call per
        tenant, pipelined). The reader thread's."""
        self.read_round_trips += 1
        replies = self.new.move_and_read([(lane, k, n) for k, n in counts.items()])
        return {k: resp[0][1] if resp else [] for k, resp in zip(counts, replies, strict=True)}

    def _admit(self, keys: Keys, lane: str, entry_id: str, fields: dict[str, str] | None,
               deliveries: int) -> None:
        """Parse, START and start one entry, all on the engine thread."""
        e = self._parse(keys, lane, entry_id, fields)
        if e.kind is Read.parsed:
            self.round_trips += 1
            e = self._started(e, self._start_reply(e))
        self._admit_read(e, deliveries)

    def _parse(self, keys: Keys, lane: str, entry_id: str,
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
        # reads the engine thread's dict: a membership test, and while a read is under way
        # the engine thread adds no job that could be in it (no reclaim meanwhile)
        if keys.job(fields["job"]) in self.jobs:
            return EntryRead(keys, lane, entry_id, fields, Read.running)
        return EntryRead(keys, lane, entry_id, fields, Read.parsed, req=req)

    def _start_call(self, e: EntryRead) -> Start:
        return Start(e.keys, e.fields["job"], self.model, e.lane, self.worker_id,
                     self.s.max_deliveries)

    def _start_reply(self, e: EntryRead) -> Started | redis.ResponseError:
        try:
            return script.run(self.r, self._start_call(e))
        except redis.ResponseError as err:  # e.g. WRONGTYPE: a hostile write to the job's keys
            return err

    def _start_many(self, parsed: list[EntryRead]) -> list:
        """START for each entry, in one pipelined round trip (the reader thread's): each
        one's Started, a ResponseError where Redis refused one."""
        todo, replies = list(range(len(parsed))), [None] * len(parsed)
        while todo:
            self.read_round_trips += 1
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
        return replies

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

    def _admit_read(self, e: EntryRead, deliveries: int) -> None:
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
            self.end_job(job, Status.expired, FinishReason.deadline)
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
        self.jobs[job.uid] = job
        if job.done:  # every choice had ended before a crash (replayed): just finish
            self.end_job(job, Status.finished, job.finish_reason())
            return
        too_slow, by_deadline = self._prefill_too_slow(job)
        if too_slow:  # the job's own deadline: it expires; the worker's limit: it fails
            self.engine.abort_request(job.uid)
            self.end_job(job, *((Status.expired, FinishReason.deadline) if by_deadline
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
        guided = req.output_spec()
        for k, choice in enumerate(job.choices):
            if choice.finish_reason is not None:
                continue
            prompt_tokens = self.engine.add_request(
                job.request_id(k), prompt, sampling_params(req, k, guided), messages=messages,
                priority=priority, resume_token_ids=choice.resumed_ids)
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
            self.jobs.pop(keys.job(job_id), None)
        self.metrics.finished.labels(Status.failed).inc()

