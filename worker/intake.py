"""Intake: reading entries (own pending, reclaimed, new) and handing each to admission
(worker/admission.py: parse, START, start in the engine). A part of the worker
(worker/service.py composes it). While the engine is busy, new entries are read, parsed
and STARTed on a reader thread, one read at a time; everything else, and everything
touching the engine or the job table (worker/job_table.py), runs on the engine thread.

New jobs wait in each lane's inbox (SUBMIT's): how they are moved into the jobs streams and
read, idle or busy, on a single Redis or a cluster, is worker/reads.py.

Key spaces: a worker may serve several key prefixes (tenants), each split into partitions
(``ident.tenants``: every partition of every prefix); each key space has its own jobs
stream per lane. Lanes keep their order across key spaces; one lane's room is shared among
its key spaces' streams in fair shares (worker/tenants.py), and who goes first rotates.
Every entry is handled with the keys of the key space whose stream it came from.
"""
from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

from pagedq.wire.keys import GROUP, Keys
from pagedq.worker import faults, lanes, tenants
from pagedq.worker.admission import Admission, Read
from pagedq.worker.job_table import JobTable
from pagedq.worker.jobs import WorkerIdentity
from pagedq.worker.metrics import Metrics
from pagedq.worker.pacing import StepPacer
from pagedq.worker.publisher import Publisher
from pagedq.worker.reads import NewEntries
from pagedq.worker.recovery import reclaim

LOWER_LANE_POLL_S = 0.1  # a busy worker looks at an empty lower lane this often
# a busy worker admits at most this many new entries per poll (each costs the engine thread
# a START round trip, parsing and engine.add_request: 0.6-0.7 ms on a dev machine's CPU): the
# engine steps between polls, so a burst of jobs is prefilled while the rest of it is
# admitted, instead of after all of it
BUSY_ADMIT_MAX = 32


class Intake:
    def __init__(self, ident: WorkerIdentity, engine, publisher: Publisher, metrics: Metrics,
                 pacer: StepPacer, jobs: JobTable, log) -> None:
        """``jobs``: the worker's job table (read here for the seats held; admission
        changes it)."""
        self.ident, self.r, self.s = ident, ident.r, ident.settings
        self.model, self.worker_id = ident.model, ident.worker_id
        self.engine, self.metrics, self.jobs, self.log = engine, metrics, jobs, log
        self.admission = Admission(ident, engine, publisher, metrics, pacer, jobs, log)
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
        return self.admission.starts + self.new.moves

    def take_deferred(self) -> bool:
        """Whether Redis refused a START for memory since the last call (those entries
        are left pending: the service reads its own pending entries again)."""
        deferred, self.admission.deferred = self.admission.deferred, False
        return deferred

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
        reads, trips = self.admission.start_many([
            self.admission.parse(k, lane, entry_id, fields)
            for k, entries in taken.items() for entry_id, fields in entries])
        self.read_round_trips += trips
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
            self.admission.admit(e, 1)
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
        e = self.admission.parse(keys, lane, entry_id, fields)
        if e.kind is Read.parsed:
            self.round_trips += 1
            e = self.admission.start_one(e)
        self.admission.admit(e, deliveries)
