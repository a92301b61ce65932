"""Publishing off the engine's critical path.

The engine loop hands each step's deltas to ``Publisher.tokens()`` and goes on with the
next step; one background thread drains everything queued so far into ONE pipelined
round trip: one PUBLISH script call for all token events, then the terminal scripts.
When Redis is slower than the engine, the queue grows and a job's deltas from several
steps merge into one event (adaptive coalescing, no added latency when Redis keeps up).

Invariants: a job's events are written in index order, its final event last; the
thread owns every job's next event index; a failed round trip is retried as a whole
(scripts are idempotent: explicit event ids, compare-and-set on attempt).
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

from producer import worker_scripts
from producer.keys import Keys
from producer.settings import Settings
from worker import fatal, faults, lua

log = structlog.get_logger("pagedq.publisher")


@dataclass(slots=True)
class Final:
    job_id: str
    attempt: int
    entry_id: str
    stream: str  # the jobs stream (lane) holding the job's entry
    status: str
    finish_reason: str
    text: str
    error: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    on_done: Callable[[str], None] | None = None  # receives the script's verdict
    choices: list[dict[str, Any]] | None = None  # n > 1 only


# What the engine loop hands over per (job, choice) and step:
# (job_id, attempt, choice or None when n == 1, delta, token_ids, logprobs or None,
#  finish_reason when this step ended the choice else None)
TokenDelta = tuple[str, int, "int | None", str, list[int], "list[Any] | None", "str | None"]


@dataclass(slots=True)
class _Pending:
    attempt: int
    choice: int | None
    delta: list[str] = field(default_factory=list)
    ids: list[int] = field(default_factory=list)
    lp: list[Any] = field(default_factory=list)
    finish_reason: str | None = None


class Publisher:
    def __init__(self, r: redis.Redis, keys: Keys, settings: Settings, model: str) -> None:
        self.r, self.keys, self.s, self.model = r, keys, settings, model
        self._publish = lua.Script(r, lua.PUBLISH)
        self._finish = lua.Script(r, lua.FINISH)
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._next_index: dict[str, int] = {}  # owned by the publisher thread
        self._thread = threading.Thread(
            target=fatal.guarded("publisher", self._run, lambda: list(self._next_index)),
            name="pagedq-publisher", daemon=True)
        self._stop = threading.Event()
        self.cancel_hits: queue.SimpleQueue = queue.SimpleQueue()  # job ids to abort
        self.lost: queue.SimpleQueue = queue.SimpleQueue()  # job ids fenced off by a newer attempt
        self.rounds = 0  # round trips to Redis
        self.errors = 0

    # ---- called from the engine loop --------------------------------------------------
    def start(self) -> Publisher:
        self._thread.start()
        return self

    def register(self, job_id: str, attempt: int, next_index: int) -> None:
        self._q.put(("reg", job_id, attempt, next_index))

    def tokens(self, batch: list[TokenDelta], urgent: bool = False) -> None:
        """One TokenDelta for every (job, choice) with new tokens this step. ``urgent``:
        the batch holds a first token someone waits for (an interactive job's): it is
        never held back for coalescing."""
        if batch:
            self._q.put(("tok", batch, urgent))

    def final(self, f: Final) -> None:
        self._q.put(("fin", f))

    def call(self, fn: Callable[[redis.client.Pipeline], None]) -> None:
        """Run ``fn(pipeline)`` in the next round trip (heartbeats, lease refresh)."""
        self._q.put(("call", fn))

    def check_cancels(self, job_ids: list[str]) -> None:
        if job_ids:
            self._q.put(("cancel?", job_ids))

    def flush(self, timeout: float = 30.0) -> bool:
        """Block until everything queued so far is written."""
        ev = threading.Event()
        self._q.put(("flush", ev))
        return ev.wait(timeout)

    def stop(self, timeout: float = 30.0) -> None:
        self.flush(timeout)
        self._stop.set()
        self._q.put(("noop",))
        self._thread.join(timeout)

    # ---- the thread -------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            items = [self._q.get()]
            first = items[0]
            if (self.s.coalesce_ms > 0 and first[0] == "tok" and not first[2]
                    and len(first[1]) >= self.s.coalesce_min_batch):
                # a large batch: hold its deltas a few ms so the next steps' merge into
                # the same events (fewer, larger events; bounded added latency)
                time.sleep(self.s.coalesce_ms / 1000.0)
            while True:
                try:
                    items.append(self._q.get_nowait())
                except queue.Empty:
                    break
            self._round(items)

    def _round(self, items: list[tuple]) -> None:
        pending: dict[tuple[str, int | None], _Pending] = {}
        order: list[tuple[str, Any]] = []  # token flushes and finals in arrival order
        calls, cancel_ids, flushes = [], [], []
        for it in items:
            kind = it[0]
            if kind == "reg":
                self._next_index[it[1]] = it[3]
            elif kind == "tok":
                for job_id, attempt, choice, delta, ids, lp, fr in it[1]:
                    key = (job_id, choice)
                    p = pending.get(key)
                    if p is None or p.attempt != attempt:
                        p = pending[key] = _Pending(attempt, choice)
                        order.append(("tok", key))
                    p.delta.append(delta)
                    p.ids.extend(ids)
                    if lp is not None:
                        p.lp.extend(lp)
                    if fr is not None:
                        p.finish_reason = fr
            elif kind == "fin":
                order.append(("fin", it[1]))
            elif kind == "call":
                calls.append(it[1])
            elif kind == "cancel?":
                cancel_ids = it[1]
            elif kind == "flush":
                flushes.append(it[1])
        if order or calls or cancel_ids:
            self._write(pending, order, calls, cancel_ids)
        for ev in flushes:
            ev.set()

    def _write(self, pending: dict[str, _Pending], order: list[tuple[str, Any]],
               calls: list, cancel_ids: list[str]) -> None:
        pub = worker_scripts.Publish(self.keys, self.s.out_maxlen, self.s.stream_idle_ttl_s)
        finals: list[Final] = []
        published: list[str] = []  # job id of each event, in add order
        for kind, obj in order:
            if kind == "tok":
                p = pending[obj]
                job_id = obj[0]
                published.append(job_id)
                idx = self._next_index.get(job_id, 0)
                self._next_index[job_id] = idx + 1
                pub.add(job_id, p.attempt, idx, "".join(p.delta), p.ids, p.lp or None,
                        p.choice, p.finish_reason)
            else:
                finals.append(obj)
        if faults.FAILPOINTS:
            faults.maybe_raise("publisher", [k[0] for k in pending] + [f.job_id for f in finals])
        backoff = 0.05
        while True:
            try:
                pipe = self.r.pipeline(transaction=False)
                if published:
                    self._publish(*pub.call, client=pipe)
                for f in finals:
                    self._finish(*worker_scripts.finish(
                        self.keys, f.job_id, f.stream, f.entry_id, f.attempt, f.status,
                        f.finish_reason, f.text, f.error, f.prompt_tokens, f.completion_tokens,
                        self._next_index.get(f.job_id, 0), time.time(), self.s.result_ttl_s,
                        self.s.out_maxlen, f.choices), client=pipe)
                for fn in calls:
                    fn(pipe)
                if cancel_ids:
                    pipe.smismember(self.keys.cancel, cancel_ids)
                res = pipe.execute(raise_on_error=False)
                if lua.noscript(res):  # Redis lost its script cache: load, send it all again
                    lua.load_all(self.r)
                    continue
                break
            except (redis.ConnectionError, redis.TimeoutError) as e:
                self.errors += 1
                log.warning("publish_retry", error=str(e), backoff_s=backoff)
                time.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
        self.rounds += 1
        for x in res:
            if isinstance(x, Exception):
                self.errors += 1
                log.error("publish_script_error", error=str(x))
        base = 1 if published else 0
        if published and isinstance(res[0], list):
            for pos in pub.lost(res[0]):
                self.lost.put(published[pos])
        for f, verdict in zip(finals, res[base:base + len(finals)], strict=True):
            self._next_index.pop(f.job_id, None)
            if f.on_done is not None:
                f.on_done(verdict if isinstance(verdict, str) else str(verdict))
        if cancel_ids:
            for job_id, hit in zip(cancel_ids, res[-1], strict=True):
                if hit:
                    self.cancel_hits.put(job_id)
