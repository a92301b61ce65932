"""The producer's reading protocol, sans I/O: one home for what Client and AsyncClient do
when they read a job (status, result, stream, subscribe), for their retry policy and for
how they are configured (``client_setup``).

Each reading call is a generator ("protocol") that yields what it needs and is sent the
replies; it keeps all the state (cursor, deadlines, what it has already seen) and raises
the client errors (JobNotFound, EventsTrimmed, ResultTimeout) itself. It yields two kinds
of step:

* a ``Command``, one Redis call described as data (``XRead(out, "0-3", 1000, 5000)``);
  the driver makes it and sends the reply back: ``proto.send(reply)``;
* an ``Event`` (stream, subscribe): the driver hands it to its caller and sends ``None``.

What the generator returns is the call's result (status(), result()). Nothing here touches
a socket or sleeps: a protocol only reads the ``clock`` it is given. The drivers are the
I/O shells, producer/client.py (``reply = cmd.call(redis)``) and producer/aio.py (``reply =
await cmd.call(redis)``), stepping a protocol with ``Exchange``: redis-py spells each
command the same in both, so ``call`` returns the reply on a sync client and an awaitable
of it on an asyncio one. Each command is made through the shell's ``_retry`` (policy:
``Backoff`` below, sleeping: the shell), so a command cut by a Redis restart is made again
whole; every command is a read (or SUBSCRIBE), safe to repeat, and an XREAD is re-sent
from the same cursor: no event is lost or repeated.

Reading invariants: a job's event k is out-stream id ``0-(k+1)``; the terminal job hash
and the final event are written atomically (worker finish script, CANCEL_LUA), so a
reader that sees a terminal hash finds the final event in the stream unless the stream
itself expired or was never written, and then the final event is rebuilt from the hash.
No call busy-spins: every wait is an XREAD BLOCK (or pub/sub read) of at most POLL_S,
after which the job hash is re-checked (it may have expired or been deleted).
"""
from __future__ import annotations

import json
import random
import time
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from typing import Any

from pagedq.wire.connection import is_cluster_pubsub, redis_kwargs
from pagedq.wire.errors import EventsTrimmed, JobNotFound, ResultTimeout
from pagedq.wire.events import Cursor, entries_of
from pagedq.wire.keys import Keys, check_name
from pagedq.wire.schema import TERMINAL, Event, FinalEvent, JobRecord, TokenEvent, parse_event
from pagedq.wire.settings import Settings

from .requests import checked_id

POLL_S = 5.0  # longest single blocking read; the job hash is re-checked in between
# redis-py 8 defaults socket_timeout to 5 s, which would cut a 5 s BLOCK short
SOCKET_TIMEOUT_S = POLL_S + 10.0
READ_COUNT = 1000  # out-stream entries per XREAD

# What the clients retry: wire/redis_errors.py ``RETRYABLE`` (a Redis restart, a cluster
# master failing over). Not retried although ConnectionErrors: wrong credentials and TLS
# certificate errors (``is_fatal``); the shells raise them as RedisUnusable.
RETRY_FIRST_S = 0.05  # first backoff; doubled per failure up to RETRY_CAP_S
RETRY_CAP_S = 1.0

Clock = Callable[[], float]


def client_setup(redis_url: str | None, prefix: str | None, model: str | None,
                 settings: Settings | None) -> tuple[Settings, Keys, str, dict[str, Any]]:
    """What both clients are built from: (settings, keys, model, pool); unset arguments
    come from ``Settings()`` (PAGEDQ_* environment). ``pool``: the arguments of
    ``BlockingConnectionPool.from_url``: decoded replies, a call waits for a free
    connection (no timeout) rather than failing, a socket timeout longer than any BLOCK,
    none of redis-py's retry options (the shells' ``_retry`` is the only retry), and the
    credentials and TLS files of ``settings`` (wire/connection.py)."""
    settings = settings or Settings()
    keys = Keys(prefix or settings.prefix)
    model = check_name("model", model or settings.model)
    url = redis_url or settings.redis_url
    pool = dict(url=url, decode_responses=True, timeout=None,
                max_connections=settings.client_max_connections,
                socket_timeout=SOCKET_TIMEOUT_S, **redis_kwargs(settings, url))
    return settings, keys, model, pool


# ---------------------------------------------------------------- retry policy

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

    def delay_after(self, error: Exception) -> float:
        """``next_delay()``, raising ``error`` (the failure being handled) once the budget
        is spent."""
        delay = self.next_delay()
        if delay is None:
            raise error
        return delay


# ---------------------------------------------------------------- commands

@dataclass(frozen=True, slots=True)
class Command:
    """One Redis call a protocol asks for. ``call(r, ps)`` makes it with redis-py on the
    client ``r`` (or the pub/sub object ``ps``); the shells, not the protocols, call it."""

    def call(self, r: Any, ps: Any = None) -> Any:
        raise NotImplementedError


@dataclass(frozen=True, slots=True)
class Exists(Command):
    """``EXISTS key`` -> 0 or 1."""
    key: str

    def call(self, r: Any, ps: Any = None) -> Any:
        return r.exists(self.key)


@dataclass(frozen=True, slots=True)
class HGetAll(Command):
    """``HGETALL key`` -> dict (empty when the key does not exist)."""
    key: str

    def call(self, r: Any, ps: Any = None) -> Any:
        return r.hgetall(self.key)


@dataclass(frozen=True, slots=True)
class XRead(Command):
    """``XREAD COUNT count [BLOCK block] STREAMS key after`` -> redis-py's XREAD reply."""
    key: str
    after: str
    count: int = READ_COUNT
    block: int | None = None  # ms; None: do not block

    def call(self, r: Any, ps: Any = None) -> Any:
        return r.xread({self.key: self.after}, count=self.count, block=self.block)


@dataclass(frozen=True, slots=True)
class LastEntry(Command):
    """``XREVRANGE key + - COUNT 1`` -> [] or [(id, fields)]."""
    key: str

    def call(self, r: Any, ps: Any = None) -> Any:
        return r.xrevrange(self.key, "+", "-", count=1)


@dataclass(frozen=True, slots=True)
class JobHead(Command):
    """``XREVRANGE out + - COUNT 1`` then ``HGETALL job``, pipelined (one round trip, no
    MULTI: a read-only user may send it) -> [last entries, hash]. In that order on purpose:
    a hash that is not terminal was not terminal when the tail was read either (the final
    event and the terminal status are written in one script), so the tail read is before
    the final event and an XREAD after it will see the final event."""
    job: str
    out: str

    def call(self, r: Any, ps: Any = None) -> Any:
        # execute() raises the first error reply, and resets the pipeline (gives its
        # connection back) however it ends
        return r.pipeline(transaction=False).xrevrange(self.out, "+", "-", count=1).hgetall(
            self.job).execute()


@dataclass(frozen=True, slots=True)
class Subscribe(Command):
    """``SUBSCRIBE chan`` on the pub/sub connection (``SSUBSCRIBE`` on a cluster's: there
    the scripts publish with SPUBLISH, pagedq.wire.lua.sharded)."""
    chan: str

    def call(self, r: Any, ps: Any = None) -> Any:
        if is_cluster_pubsub(ps):
            return ps.ssubscribe(self.chan)
        return ps.subscribe(self.chan)


@dataclass(frozen=True, slots=True)
class GetMessage(Command):
    """The next pub/sub message, waiting at most ``timeout`` s -> message dict or None."""
    timeout: float

    def call(self, r: Any, ps: Any = None) -> Any:
        if is_cluster_pubsub(ps):
            return ps.get_sharded_message(ignore_subscribe_messages=True, timeout=self.timeout)
        return ps.get_message(ignore_subscribe_messages=True, timeout=self.timeout)


Step = Command | Event
Protocol = Generator[Step, Any, Any]


class Exchange:
    """How a shell steps a protocol: iterate for its steps; after a command, set ``reply``
    before taking the next step; once iteration ends, ``value`` is what it returned."""

    __slots__ = ("proto", "reply", "value")

    def __init__(self, proto: Protocol) -> None:
        self.proto = proto
        self.reply: Any = None
        self.value: Any = None

    def __iter__(self) -> Exchange:
        return self

    def __next__(self) -> Step:
        reply, self.reply = self.reply, None
        try:
            return self.proto.send(reply)
        except StopIteration as stop:
            self.value = stop.value
            raise


# ---------------------------------------------------------------- helpers

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


def remaining(timeout: float | None, since: float, clock: Clock = time.monotonic) -> float:
    """Seconds left of ``timeout`` measured from ``since`` (on ``clock``); inf if None."""
    return float("inf") if timeout is None else timeout - (clock() - since)


def block_ms(wait: float) -> int:
    return max(1, int(min(POLL_S, wait) * 1000))


class TextDeltas:
    """``cut(ev)``: the text event ``ev`` adds to a stream read from index 0: a token's
    delta, then whatever of the final text was not streamed (e.g. after a trim); '' when
    none."""

    __slots__ = ("sent",)

    def __init__(self) -> None:
        self.sent = 0

    def __call__(self, ev: Event) -> str:
        new = ev.delta if isinstance(ev, TokenEvent) else ev.text[self.sent:]
        self.sent += len(new)
        return new


def text_deltas(events: Iterator[Event]) -> Iterator[str]:
    """Deltas; then whatever of the final text was not streamed (e.g. after a trim)."""
    cut = TextDeltas()
    for ev in events:
        if new := cut(ev):
            yield new


# ---------------------------------------------------------------- the protocols

def read_status(keys: Keys, job_id: str) -> Protocol:
    """status(): the job's record; JobNotFound if it has none."""
    h = yield HGetAll(keys.job(checked_id(job_id)))
    if not h:
        raise JobNotFound(job_id)
    return JobRecord.from_hash(job_id, h)


def wait_result(keys: Keys, job_id: str, timeout: float | None = None,
                clock: Clock = time.monotonic) -> Protocol:
    """result(): wait until the job is terminal and return its record; wakes on every new
    event (XREAD BLOCK past the log's tail), re-reads the hash after each poll interval or
    final event, never spins. ResultTimeout after ``timeout`` s in all."""
    job, out = keys.job(checked_id(job_id)), keys.out(job_id)
    start = clock()
    while True:
        last, h = yield JobHead(job, out)
        if not h:
            raise JobNotFound(job_id)
        if h.get("status") in TERMINAL:
            return JobRecord.from_hash(job_id, h)
        last_id = last[0][0] if last else "0-0"
        while True:
            wait = remaining(timeout, start, clock)
            if wait <= 0:
                raise ResultTimeout(f"job {job_id!r} not done after {timeout} s")
            got = entries_of((yield XRead(out, last_id, READ_COUNT, block_ms(wait))))
            if not got or any(f.get("t") == "final" for _, f in got):
                break  # poll interval over, or the job just ended: re-read the hash
            last_id = got[-1][0]


def read_stream(keys: Keys, job_id: str, from_index: int = 0, timeout: float | None = None,
                clock: Clock = time.monotonic) -> Protocol:
    """stream(): events from ``from_index`` in index order, each once, ending with the
    final event. ``timeout``: most seconds without a new event (ResultTimeout). JobNotFound
    when the job has no record; EventsTrimmed when the log no longer holds the next index
    while the job still runs; for a terminal job the final event is taken from the log's
    tail or rebuilt from the hash."""
    job, out = keys.job(checked_id(job_id)), keys.out(job_id)
    cur = Cursor(from_index)
    if not (yield Exists(job)):
        raise JobNotFound(job_id)
    quiet_since, block, terminal_seen = clock(), None, False
    while True:
        got = entries_of((yield XRead(out, cur.xid, READ_COUNT, block)))
        if got:
            events, gap = cur.take(got)
            for ev in events:
                yield ev
                if isinstance(ev, FinalEvent):
                    return
            quiet_since = clock()
            if not gap:
                continue
        h = yield HGetAll(job)
        if not h:
            raise JobNotFound(job_id)
        if h.get("status") in TERMINAL:
            # No new entry yet the hash is terminal: read once more (the final event may
            # have landed between the two reads), then take it from the log tail.
            if got or terminal_seen:
                fin = final_of(job_id, h, (yield LastEntry(out)), cur)
                if fin is not None:
                    yield fin
                return
            terminal_seen, block = True, None
            continue
        if got:
            raise trimmed_error(job_id, cur.idx)
        wait = remaining(timeout, quiet_since, clock)
        if wait <= 0:
            raise ResultTimeout(f"no event of job {job_id!r} for {timeout} s")
        block = block_ms(wait)


def read_mirror(keys: Keys, job_id: str, timeout: float | None = None,
                clock: Clock = time.monotonic) -> Protocol:
    """subscribe(): events from the job's pub/sub channel (commands on the shell's pub/sub
    object), after a check that the job has not already ended (then: only its final
    event). ``timeout``: most seconds without a message (ResultTimeout)."""
    chan = keys.chan(checked_id(job_id))
    yield Subscribe(chan)
    h = yield HGetAll(keys.job(job_id))
    if h.get("status") in TERMINAL:  # ended before we subscribed
        yield final_of(job_id, h, (yield LastEntry(keys.out(job_id))), Cursor(0))
        return
    quiet_since = clock()
    while True:
        wait = remaining(timeout, quiet_since, clock)
        if wait <= 0:
            raise ResultTimeout(f"no message for job {job_id!r} for {timeout} s")
        msg = yield GetMessage(min(POLL_S, wait))
        if msg is None or msg.get("type") not in ("message", "smessage"):
            continue
        ev = parse_event(json.loads(msg["data"]))
        quiet_since = clock()
        yield ev
        if isinstance(ev, FinalEvent):
            return
