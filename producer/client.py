"""Synchronous producer client: submit, status, stream, result, cancel.

The module-level helpers are shared with the asyncio client (producer/aio.py); they hold
the protocol logic, the classes only do I/O.

Reading invariants: a job's event k is out-stream id ``0-(k+1)``; the terminal job hash
and the final event are written atomically (worker finish script, CANCEL_LUA), so a
reader that sees a terminal hash finds the final event in the stream unless the stream
itself expired or was never written, and then the final event is rebuilt from the hash.
No call busy-spins: every wait is an XREAD BLOCK (or pub/sub read) of at most POLL_S,
after which the job hash is re-checked (it may have expired or been deleted).

Riding out a Redis restart: every Redis call of both clients goes through a retry loop
(``Client._retry`` / ``AsyncClient._retry``) with one shared policy, ``Backoff``: a
connection-level failure is retried whole, with capped exponential backoff, for up to
``settings.client_retry_s`` seconds from its first failure, then re-raised. Each call is
safe to repeat: SUBMIT is idempotent by job id and request hash ('exists'), CANCEL is
idempotent, the rest are reads; a cut XREAD is re-sent from the same cursor, so stream()
neither loses nor repeats an event. The pools are built without redis-py's retry
options, so their connections do not retry on their own (``Retry(NoBackoff(), 0)``): this
is the only retry policy.
"""
from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import redis

from .errors import EventsTrimmed, JobNotFound, ResultTimeout
from .keys import Keys, check_name, index_of_entry_id
from .schema import TERMINAL, Event, FinalEvent, JobRecord, JobRequest, TokenEvent, parse_event
from .scripts import (
    build_request,
    cancel_call,
    check_cancel_reply,
    check_submit_reply,
    checked_id,
    collect_replies,
    register,
    served_call,
    served_reply,
    submit_call,
    with_id,
)
from .settings import Settings

POLL_S = 5.0  # longest single blocking read; the job hash is re-checked in between
# redis-py 8 defaults socket_timeout to 5 s, which would cut a 5 s BLOCK short
SOCKET_TIMEOUT_S = POLL_S + 10.0
READ_COUNT = 1000  # out-stream entries per XREAD

# What a Redis restart looks like to a client: refused or cut connections, timeouts, and
# LOADING replies while it loads its AOF (redis.BusyLoadingError is a ConnectionError).
RETRYABLE: tuple[type[Exception], ...] = (redis.ConnectionError, redis.TimeoutError)
RETRY_FIRST_S = 0.05  # first backoff; doubled per failure up to RETRY_CAP_S
RETRY_CAP_S = 1.0

T = TypeVar("T")


# ---------------------------------------------------------------- shared helpers

class Backoff:
    """The retry schedule of one call, shared by Client and AsyncClient: capped exponential
    delays (with jitter, so many clients do not reconnect in lockstep) until ``budget_s``
    seconds have passed since the call's first failure."""

    __slots__ = ("budget_s", "deadline", "failures")

    def __init__(self, budget_s: float) -> None:
        self.budget_s = budget_s
        self.deadline: float | None = None
        self.failures = 0

    def next_delay(self) -> float | None:
        """After a failure: seconds to wait before the next attempt, or None when the
        budget is spent (the caller re-raises the failure)."""
        now = time.monotonic()
        if self.deadline is None:
            self.deadline = now + self.budget_s
        left = self.deadline - now
        if left <= 0:
            return None
        step = min(RETRY_CAP_S, RETRY_FIRST_S * 2 ** min(self.failures, 30))
        self.failures += 1
        return min(left, step * random.uniform(0.5, 1.0))


def entries_of(resp: Any) -> list[tuple[str, dict[str, str]]]:
    """XREAD reply of one key -> its entries (RESP2 list or RESP3 dict shape)."""
    if not resp:
        return []
    if isinstance(resp, dict):
        batches = list(resp.values())
        return list(batches[0][0]) if batches and batches[0] else []
    return list(resp[0][1])


class Cursor:
    """The next event index a reader expects. XREAD from ``0-idx`` returns index idx on."""

    __slots__ = ("idx",)

    def __init__(self, idx: int) -> None:
        if idx < 0:
            raise ValueError("from_index must be >= 0")
        self.idx = idx

    @property
    def xid(self) -> str:
        return f"0-{self.idx}"

    def take(self, entries: list[tuple[str, dict[str, str]]]) -> tuple[list[Event], bool]:
        """Events continuing the cursor, and whether the log skips past the next index
        (its head was trimmed) before the batch ends."""
        out: list[Event] = []
        for eid, fields in entries:
            if index_of_entry_id(eid) != self.idx:
                return out, True
            ev = parse_event(fields)
            out.append(ev)
            self.idx += 1
            if isinstance(ev, FinalEvent):
                break
        return out, False


def final_of(job_id: str, h: dict[str, str], last: list[Any], cur: Cursor) -> FinalEvent | None:
    """The final event for a terminal job: the log's last entry if it is final (None when
    the reader is already past it), else rebuilt from the job hash at the cursor."""
    if last:
        ev = parse_event(last[0][1])
        if isinstance(ev, FinalEvent):
            return ev if ev.index >= cur.idx else None
    rec = JobRecord.from_hash(job_id, h)
    return FinalEvent(index=cur.idx, status=rec.status, finish_reason=rec.finish_reason,
                      text=rec.text, error=rec.error, usage=rec.usage)


def trimmed_error(job_id: str, idx: int) -> EventsTrimmed:
    return EventsTrimmed(f"events of job {job_id!r} from index {idx} were trimmed from its "
                         "event log while it is still running; resume from a later index "
                         "or wait for result()")


def remaining(timeout: float | None, since: float) -> float:
    """Seconds left of ``timeout`` measured from ``since`` (monotonic); inf if None."""
    return float("inf") if timeout is None else timeout - (time.monotonic() - since)


def block_ms(wait: float) -> int:
    return max(1, int(min(POLL_S, wait) * 1000))


def text_deltas(events: Iterator[Event]) -> Iterator[str]:
    """Deltas; then whatever of the final text was not streamed (e.g. after a trim)."""
    sent = 0
    for ev in events:
        if isinstance(ev, TokenEvent):
            if ev.delta:
                sent += len(ev.delta)
                yield ev.delta
        elif len(ev.text) > sent:
            yield ev.text[sent:]


# ---------------------------------------------------------------- the client

class Client:
    """``Client(redis_url=None, *, prefix=None, model=None, settings=None)``; unset
    arguments come from ``Settings()`` (PAGEDQ_* environment). Thread-safe."""

    def __init__(self, redis_url: str | None = None, *, prefix: str | None = None,
                 model: str | None = None, settings: Settings | None = None) -> None:
        self.settings = settings or Settings()
        self.keys = Keys(prefix or self.settings.prefix)
        self.model = check_name("model", model or self.settings.model)
        self.redis = redis.Redis(connection_pool=redis.BlockingConnectionPool.from_url(
            redis_url or self.settings.redis_url, decode_responses=True, timeout=None,
            max_connections=self.settings.client_max_connections,
            socket_timeout=SOCKET_TIMEOUT_S))
        self._scripts = register(self.redis)

    def _retry(self, call: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """``call(*args, **kwargs)``, repeated on connection-level failures (see Backoff)."""
        backoff = Backoff(self.settings.client_retry_s)
        while True:
            try:
                return call(*args, **kwargs)
            except RETRYABLE:
                delay = backoff.next_delay()
                if delay is None:
                    raise
                time.sleep(delay)

    # -- submit
    def submit(self, prompt: str | list[int] | None = None, *, messages: list[Any] | None = None,
               model: str | None = None, max_tokens: int | None = None,
               temperature: float | None = None, top_p: float | None = None,
               top_k: int | None = None, seed: int | None = None,
               stop: list[str] | str | None = None, timeout_s: float | None = None,
               job_id: str | None = None, require_worker: bool = False, **params: Any) -> str:
        """Validate and enqueue one job; returns its id. Idempotent per job id.
        ``require_worker``: refuse (NoWorker, nothing enqueued) unless a live worker serves
        the model."""
        explicit = dict(max_tokens=max_tokens, temperature=temperature, top_p=top_p,
                        top_k=top_k, seed=seed, stop=stop, timeout_s=timeout_s)
        req = build_request(prompt, messages, model or self.model, job_id, explicit, params)
        return self._submit(req, require_worker)

    def submit_request(self, req: JobRequest | dict[str, Any],
                       require_worker: bool = False) -> str:
        return self._submit(with_id(req, self.model), require_worker)

    def _submit(self, req: JobRequest, require_worker: bool = False) -> str:
        keys, args = submit_call(self.keys, req, self.settings, require_worker)
        return check_submit_reply(self._retry(self._scripts.submit, keys, args), req.id)

    def submit_many(self, reqs: list[JobRequest | dict[str, Any]]) -> list[str]:
        """All requests are validated before anything is sent (InvalidRequest: nothing
        enqueued), then submitted in one pipeline, each atomically but not all together.
        On JobConflict/Overloaded the others are still enqueued; the first error is raised
        with ``.job_ids`` (None where refused). Resubmitting with fixed ids is safe."""
        reqs = [with_id(r, self.model) for r in reqs]
        calls = [submit_call(self.keys, req, self.settings) for req in reqs]

        def send() -> list[Any]:
            with self.redis.pipeline(transaction=False) as pipe:
                for keys, args in calls:
                    self._scripts.submit(keys, args, client=pipe)
                return pipe.execute(raise_on_error=False)
        return collect_replies(reqs, self._retry(send))

    def served_models(self) -> dict[str, int]:
        """Models with at least one live worker -> how many (from the workers'
        heartbeats, judged by Redis's clock)."""
        keys, args = served_call(self.keys)
        return served_reply(self._retry(self._scripts.served, keys, args))

    # -- read
    def status(self, job_id: str) -> JobRecord:
        job = self.keys.job(checked_id(job_id))
        h = self._retry(self.redis.hgetall, job)
        if not h:
            raise JobNotFound(job_id)
        return JobRecord.from_hash(job_id, h)

    def result(self, job_id: str, timeout: float | None = None) -> JobRecord:
        """Wait until the job is terminal; wakes on every new event, never spins."""
        job, out = self.keys.job(checked_id(job_id)), self.keys.out(job_id)
        start = time.monotonic()

        def head() -> list[Any]:  # hash + log tail, atomically
            with self.redis.pipeline(transaction=True) as p:
                return p.hgetall(job).xrevrange(out, "+", "-", count=1).execute()
        while True:
            h, last = self._retry(head)
            if not h:
                raise JobNotFound(job_id)
            if h.get("status") in TERMINAL:
                return JobRecord.from_hash(job_id, h)
            last_id = last[0][0] if last else "0-0"
            while True:
                wait = remaining(timeout, start)
                if wait <= 0:
                    raise ResultTimeout(f"job {job_id!r} not done after {timeout} s")
                got = entries_of(self._retry(self.redis.xread, {out: last_id},
                                             count=READ_COUNT, block=block_ms(wait)))
                if not got or any(f.get("t") == "final" for _, f in got):
                    break  # poll interval over, or the job just ended: re-read the hash
                last_id = got[-1][0]

    def stream(self, job_id: str, from_index: int = 0,
               timeout: float | None = None) -> Iterator[Event]:
        """Events from ``from_index`` in index order, each once, ending with the final
        event. ``timeout``: most seconds without a new event (ResultTimeout). Errors
        (JobNotFound, EventsTrimmed) are raised when iteration starts or reaches them."""
        job, out = self.keys.job(checked_id(job_id)), self.keys.out(job_id)
        cur = Cursor(from_index)
        if not self._retry(self.redis.exists, job):
            raise JobNotFound(job_id)
        quiet_since, block, terminal_seen = time.monotonic(), None, False
        while True:
            # a read cut by a restart is re-sent from the same cursor: nothing lost or repeated
            got = entries_of(self._retry(self.redis.xread, {out: cur.xid}, count=READ_COUNT,
                                         block=block))
            if got:
                events, gap = cur.take(got)
                for ev in events:
                    yield ev
                    if isinstance(ev, FinalEvent):
                        return
                quiet_since = time.monotonic()
                if not gap:
                    continue
            h = self._retry(self.redis.hgetall, job)
            if not h:
                raise JobNotFound(job_id)
            if h.get("status") in TERMINAL:
                # No new entry yet the hash is terminal: read once more (the final event may
                # have landed between the two reads), then take it from the log tail.
                if got or terminal_seen:
                    last = self._retry(self.redis.xrevrange, out, "+", "-", count=1)
                    fin = final_of(job_id, h, last, cur)
                    if fin is not None:
                        yield fin
                    return
                terminal_seen, block = True, None
                continue
            if got:
                raise trimmed_error(job_id, cur.idx)
            wait = remaining(timeout, quiet_since)
            if wait <= 0:
                raise ResultTimeout(f"no event of job {job_id!r} for {timeout} s")
            block = block_ms(wait)

    def stream_text(self, job_id: str, timeout: float | None = None) -> Iterator[str]:
        """Text deltas from the start; they concatenate to the final text."""
        return text_deltas(self.stream(job_id, 0, timeout))

    def subscribe(self, job_id: str, timeout: float | None = None) -> Iterator[Event]:
        """Events from the pub/sub mirror: at-most-once, only those published after the
        subscription; the out stream (stream()) is the source of truth. After a lost
        connection redis-py resubscribes; what was published meanwhile is missed."""
        chan = self.keys.chan(checked_id(job_id))
        job, out = self.keys.job(job_id), self.keys.out(job_id)
        ps = self.redis.pubsub(ignore_subscribe_messages=True)
        try:
            self._retry(ps.subscribe, chan)
            h = self._retry(self.redis.hgetall, job)
            if h.get("status") in TERMINAL:  # ended before we subscribed
                last = self._retry(self.redis.xrevrange, out, "+", "-", count=1)
                yield final_of(job_id, h, last, Cursor(0))  # type: ignore[misc]
                return
            quiet_since = time.monotonic()
            while True:
                wait = remaining(timeout, quiet_since)
                if wait <= 0:
                    raise ResultTimeout(f"no message for job {job_id!r} for {timeout} s")
                msg = self._retry(ps.get_message, timeout=min(POLL_S, wait))
                if msg is None or msg.get("type") != "message":
                    continue
                ev = parse_event(json.loads(msg["data"]))
                quiet_since = time.monotonic()
                yield ev
                if isinstance(ev, FinalEvent):
                    return
        finally:
            ps.close()

    # -- cancel
    def cancel(self, job_id: str) -> bool:
        """True if cancelled (queued) or a cancel was requested (running); False if the
        job had already ended."""
        keys, args = cancel_call(self.keys, checked_id(job_id), self.settings)
        return check_cancel_reply(self._retry(self._scripts.cancel, keys, args), job_id)

    # -- lifecycle
    def close(self) -> None:
        self.redis.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

