"""Publishing off the engine's critical path.

The engine loop hands each step's deltas to ``Publisher.tokens()`` and goes on with the
next step; one background thread drains everything queued so far into ONE pipelined
round trip: one PUBLISH script call for all token events, then the terminal scripts.
When Redis is slower than the engine, the queue grows and a job's deltas from several
steps merge into one event (adaptive coalescing, no added latency when Redis keeps up).

Invariants: a job's events are written in index order, its final event last; the
thread owns every job's next event index, for the attempt registered last (a worker may
take its own job back after a lease ran out, e.g. while Redis was away: the earlier
attempt's unwritten tokens are then dropped, never numbered in the new attempt's log, and
its final event and "lost" verdicts leave the new attempt alone); a failed round trip is
retried as a whole
(scripts are idempotent: explicit event ids, compare-and-set on attempt), and so is one
where Redis refused a PUBLISH or FINISH for memory (a full Redis: the thread keeps every
job's events and retries with backoff, reporting through ``on_redis_full``) or where FINISH
found the job's log behind the final's index (a round that failed in part). On a Redis
Cluster a round holds one PUBLISH call per key space (a script touches one slot), and a
reply that is a connection-level failure (a master failing over: the cluster pipeline
returns it instead of raising) fails the round, which is then sent again whole.
"""
from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis
import structlog

from pagedq.wire import script, worker_scripts
from pagedq.wire.connection import is_cluster
from pagedq.wire.keys import Keys
from pagedq.wire.redis_errors import RETRYABLE
from pagedq.wire.schema import FinishReason, Status
from pagedq.wire.settings import Settings
from pagedq.wire.worker_scripts import EventHead, Verdict
from pagedq.worker import fatal, faults

log = structlog.get_logger("pagedq.publisher")


@dataclass(slots=True)
class Final:
    """A job's end: its FINISH call's inputs (the publisher adds the event index, the time,
    the TTL), and who hears the script's verdict (the verdict, or the error's text)."""

    keys: Keys  # the job's tenant's
    job_id: str
    attempt: int
    entry_id: str
    stream: str  # the jobs stream (lane) holding the job's entry
    status: Status
    finish_reason: FinishReason
    text: str
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    on_done: Callable[[Verdict | str], None] | None = None
    choices: list[dict[str, Any]] | None = None  # n > 1 only

    @property
    def uid(self) -> str:
        return self.keys.job(self.job_id)


# What the engine loop hands over per (job, choice) and step, a plain tuple (one per running
# job and step: the hot path): (job uid, attempt, choice or None when n == 1, delta,
# token_ids, logprobs or None, finish_reason when this step ended the choice else None,
# the job's EventHead on its first output of this attempt else None: written only if that
# event is the job's event 0, wire/worker_scripts.py). A job's uid is its record's key
# (worker/jobs.py Job.uid); ``register`` told the thread whose keys and id it is.
TokenDelta = tuple[str, int, "int | None", str, list[int], "list[Any] | None",
                   "FinishReason | None", "EventHead | None"]


# ---- what the engine loop queues for the thread: one message per call of Publisher ------

@dataclass(slots=True, frozen=True)
class _Register:
    keys: Keys
    job_id: str
    attempt: int
    next_index: int


@dataclass(slots=True, frozen=True)
class _Tokens:
    batch: list[TokenDelta]
    urgent: bool  # holds a first token someone waits for: never held back


@dataclass(slots=True, frozen=True)
class _Call:
    fn: Callable[[redis.client.Pipeline], None]


@dataclass(slots=True, frozen=True)
class _CancelCheck:
    uids: list[str]


@dataclass(slots=True, frozen=True)
class _Flush:
    done: threading.Event


@dataclass(slots=True, frozen=True)
class _Wake:
    """Nothing to do: wakes the thread so that it sees it must stop."""


Message = _Register | _Tokens | Final | _Call | _CancelCheck | _Flush | _Wake


@dataclass(slots=True, frozen=True)
class _Owner:
    """A registered job's names, built once (the thread names every running job's keys at
    every round): its tenant's keys and its id, the keys its token events touch
    (worker_scripts.event_keys), its tenant's cancel set."""

    keys: Keys
    job_id: str
    events: tuple[str, str, str]
    cancel: str


@dataclass(slots=True)
class _Pending:
    attempt: int
    choice: int | None
    delta: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    lp: list[Any] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    head: EventHead | None = None


class Publisher:
    """Jobs are named by their uid (worker/jobs.py Job.uid) in every call but ``register``
    and ``final``, which give the job's keys and id; ``cancel_hits`` carries uids, ``lost``
    (uid, attempt) pairs."""

    def __init__(self, r: redis.Redis, settings: Settings) -> None:
        self.r, self.s = r, settings
        self._per_slot = is_cluster(r)  # one PUBLISH call per key space, not one per round
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        # owned by the publisher thread, by uid: the next event index, whose job it is
        self._next_index: dict[str, int] = {}
        self._owner: dict[str, _Owner] = {}
        self._attempt: dict[str, int] = {}  # the attempt registered last
        self._thread = threading.Thread(
            target=fatal.guarded("publisher", self._run, lambda: list(self._next_index)),
            name="pagedq-publisher", daemon=True)
        self._stop = threading.Event()
        self.cancel_hits: queue.SimpleQueue = queue.SimpleQueue()  # job ids to abort
        # (uid, attempt) of jobs fenced off by a newer attempt
        self.lost: queue.SimpleQueue = queue.SimpleQueue()
        self.rounds = 0  # round trips to Redis
        self.errors = 0
        # on_redis_full(part, why): a full Redis refused this thread's writes ("publisher":
        # results, retried; "heartbeat": the heartbeat, not retried), or why="" once it
        # takes them again (worker/service.py reports it: health, metrics, a log line)
        self.on_redis_full: Callable[[str, str], None] = lambda part, why: None
        self.cpu_s = 0.0  # the thread's CPU seconds, set when it ends (bench/service.py)

    # ---- called from the engine loop --------------------------------------------------
    def start(self) -> Publisher:
        self._thread.start()
        return self

    def register(self, keys: Keys, job_id: str, attempt: int, next_index: int) -> None:
        self._q.put(_Register(keys, job_id, attempt, next_index))

    def tokens(self, batch: list[TokenDelta], urgent: bool = False) -> None:
        """One TokenDelta for every (job, choice) with new tokens this step. ``urgent``:
        the batch holds a first token someone waits for (an interactive job's): it is
        never held back for coalescing."""
        if batch:
            self._q.put(_Tokens(batch, urgent))

    def final(self, f: Final) -> None:
        self._q.put(f)

    def call(self, fn: Callable[[redis.client.Pipeline], None]) -> None:
        """Run ``fn(pipeline)`` in the next round trip (heartbeats, lease refresh)."""
        self._q.put(_Call(fn))

    def check_cancels(self, uids: list[str]) -> None:
        if uids:
            self._q.put(_CancelCheck(uids))

    def flush(self, timeout: float = 30.0) -> bool:
        """Block until everything queued so far is written."""
        ev = threading.Event()
        self._q.put(_Flush(ev))
        return ev.wait(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        self._stop.set()
        self._q.put(_Wake())
        self._thread.join(timeout)

    # ---- the thread -------------------------------------------------------------------
    def _keepalive(self, calls: list) -> None:
        """The heartbeat and lease refreshes of a round that is waiting for Redis to take
        its results: sent on their own, so the worker keeps its jobs meanwhile (REFRESH
        runs on a full Redis: XCLAIM never grows it, and its function may exceed maxmemory)."""
        if not calls:
            return
        try:
            pipe = self.r.pipeline(transaction=False)
            for fn in calls:
                fn(pipe)
            pipe.execute(raise_on_error=False)
        except RETRYABLE:
            pass

    def _run(self) -> None:
        while not self._stop.is_set():
            items: list[Message] = [self._q.get()]
            first = items[0]
            if (self.s.coalesce_ms > 0 and isinstance(first, _Tokens) and not first.urgent
                    and len(first.batch) >= self.s.coalesce_min_batch):
                # a large batch: hold its deltas a few ms so the next steps' merge into
                # the same events (fewer, larger events; bounded added latency)
                time.sleep(self.s.coalesce_ms / 1000.0)
            while True:
                try:
                    items.append(self._q.get_nowait())
                except queue.Empty:
                    break
            self._round(items)
        self.cpu_s = time.thread_time()

    def _round(self, items: list[Message]) -> None:
        pending: dict[tuple[str, int | None], _Pending] = {}
        # token flushes ((job, choice) and its _Pending: an attempt's own, when a job's
        # attempt changes within the round) and finals, in arrival order
        order: list[tuple[tuple[str, int | None], _Pending] | Final] = []
        calls, cancel_ids, flushes = [], [], []
        for it in items:
            if isinstance(it, _Tokens):
                for job_id, attempt, choice, delta, ids, lp, fr, head in it.batch:
                    key = (job_id, choice)
                    p = pending.get(key)
                    if p is None or p.attempt != attempt:
                        p = pending[key] = _Pending(attempt, choice)
                        order.append((key, p))
                    p.delta.append(delta)
                    p.ids.extend(ids)
                    if lp is not None:
                        p.lp.extend(lp)
                    if fr is not None:
                        p.finish_reason = fr
                    if head is not None:
                        p.head = head
            elif isinstance(it, _Register):
                uid = it.keys.job(it.job_id)
                self._next_index[uid] = it.next_index
                self._owner[uid] = _Owner(it.keys, it.job_id,
                                          worker_scripts.event_keys(it.keys, it.job_id),
                                          it.keys.cancel)
                self._attempt[uid] = it.attempt
            elif isinstance(it, Final):
                order.append(it)
            elif isinstance(it, _Call):
                calls.append(it.fn)
            elif isinstance(it, _CancelCheck):
                cancel_ids = it.uids
            elif isinstance(it, _Flush):
                flushes.append(it.done)
        if order or calls or cancel_ids:
            self._write(pending, order, calls, cancel_ids)
        for ev in flushes:
            ev.set()

    def _write(self, pending: dict[tuple[str, int | None], _Pending],
               order: list[tuple[tuple[str, int | None], _Pending] | Final],
               calls: list, cancel_ids: list[str]) -> None:
        # PUBLISH calls: one, or one per key space on a cluster; each with the job uid and
        # attempt of each of its events, in add order
        pubs: dict[str, tuple[worker_scripts.Publish, list[tuple[str, int]]]] = {}
        finals: list[Final] = []
        for obj in order:
            if not isinstance(obj, Final):
                (uid, _choice), p = obj
                owner = self._owner.get(uid)
                if owner is None or p.attempt != self._attempt.get(uid):
                    continue  # never started here, or an earlier attempt: nothing to write
                group = owner.keys.base if self._per_slot else ""
                if group not in pubs:
                    pubs[group] = (worker_scripts.Publish(self.s.out_maxlen,
                                                          self.s.stream_idle_ttl_s), [])
                pub, published = pubs[group]
                published.append((uid, p.attempt))
                idx = self._next_index.get(uid, 0)
                self._next_index[uid] = idx + 1
                pub.add_named(owner.events, p.attempt, idx, "".join(p.delta), p.ids,
                              p.lp or None, p.choice, p.finish_reason, p.head)
            else:
                finals.append(obj)
        # the cancel sets to ask, per tenant: {cancel set: [(uid, job id)]}
        asks: dict[str, list[tuple[str, str]]] = {}
        for uid in cancel_ids:
            if (owner := self._owner.get(uid)) is not None:
                asks.setdefault(owner.cancel, []).append((uid, owner.job_id))
        if faults.FAILPOINTS:
            faults.maybe_raise("publisher", [k[0] for k in pending] + [f.job_id for f in finals])
        backoff = 0.05
        while True:
            try:
                now = time.time()
                finishes = [worker_scripts.Finish(
                    f.keys, f.job_id, f.stream, f.entry_id, f.attempt, f.status, f.finish_reason,
                    f.text, f.error, f.prompt_tokens, f.completion_tokens,
                    self._next_index.get(f.uid, 0), now, self.s.result_ttl_s, self.s.out_maxlen,
                    f.choices) for f in finals]
                pipe = self.r.pipeline(transaction=False)
                for pub, _ in pubs.values():
                    script.queue(pipe, pub)
                for call in finishes:
                    script.queue(pipe, call)
                for fn in calls:
                    fn(pipe)
                for cancel_set, jobs in asks.items():
                    pipe.smismember(cancel_set, [job_id for _, job_id in jobs])
                res = pipe.execute(raise_on_error=False)
                if script.noscript(res):  # Redis lost its scripts: load, send it all again
                    script.load(self.r, worker_scripts.NAMES)
                    continue
                script.raise_retryable(res)
                head = res[:len(pubs) + len(finishes)]  # the results' scripts
                if why := _retry_reason(head, len(pubs)):
                    self.errors += 1
                    self.on_redis_full("publisher", str(why) if script.is_oom(why) else "")
                    log.warning("publish_retry", error=str(why), backoff_s=backoff)
                    self._keepalive(calls)
                    time.sleep(backoff)
                    backoff = min(backoff * 2, 2.0)
                    continue
                break
            except RETRYABLE as e:
                self.errors += 1
                log.warning("publish_retry", error=str(e), backoff_s=backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
        self.rounds += 1
        self.on_redis_full("publisher", "")
        refused = ""
        for x in res:
            if isinstance(x, Exception):
                self.errors += 1
                if script.is_oom(x):  # a heartbeat write: the next beat tries again
                    refused = f"Redis refused the heartbeat: {x}"
                else:
                    log.error("publish_script_error", error=str(x))
        if calls:  # (a round without the heartbeat says nothing of it)
            self.on_redis_full("heartbeat", refused)
        base = len(pubs)
        for (pub, published), reply in zip(pubs.values(), res, strict=False):
            if isinstance(reply, list):
                for pos in pub.parse(reply):
                    self.lost.put(published[pos])
        for f, verdict in zip(finals, script.results(finishes, res[base:base + len(finals)]),
                              strict=True):
            if self._attempt.get(f.uid) == f.attempt:  # (else a newer attempt runs here)
                self._next_index.pop(f.uid, None)
                self._owner.pop(f.uid, None)
                self._attempt.pop(f.uid, None)
            if f.on_done is not None:
                f.on_done(verdict if isinstance(verdict, str) else str(verdict))
        for jobs, hits in zip(asks.values(), res[len(res) - len(asks):], strict=True):
            if isinstance(hits, Exception):
                continue  # counted and logged above; asked again before the next step
            for (uid, _), hit in zip(jobs, hits, strict=True):
                if hit:
                    self.cancel_hits.put(uid)


def _retry_reason(head: list[Any], finals_from: int) -> Any:
    """Why a round's results must be sent again, or None: Redis refused a PUBLISH or FINISH
    for memory (that error), or a FINISH found the job's log behind the final's index
    (a round that failed in part: "behind")."""
    for i, x in enumerate(head):
        if script.is_oom(x):
            return x
        if i >= finals_from and x == Verdict.behind:
            return Verdict.behind
    return None
