"""Clients ride out a Redis restart: a real redis-server with AOF is stopped and started
again on the same port while readers wait in stream()/result()/subscribe(). The worker
side is simulated the way tests/test_producer.py does it: events written at their
explicit ids, the final event and the terminal hash in one transaction.

Every wait is on a condition with a generous timeout; the only fixed sleep is the length
of the outage itself, which the checks do not depend on (it is far below the retry
budget)."""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

import pytest
import redis

from pagedq.producer import AsyncClient, Client, FinalEvent, Settings, TokenEvent
from pagedq.producer.client import RETRY_CAP_S, RETRY_FIRST_S, RETRYABLE, Backoff
from pagedq.wire.keys import Keys, out_entry_id
from pagedq.wire.schema import JobRecord, final_fields, token_fields
from pagedq.worker.redis_server import RedisServer, free_port

MODEL = "m1"
# how long Redis stays down: far below the default 30 s retry budget, and long enough
# for several retries (backoff from RETRY_FIRST_S, capped at RETRY_CAP_S = 1 s)
OUTAGE_S = 1.5
WAIT_S = 60.0  # generous limit of every condition wait
DELTAS = [f"w{i} " for i in range(10)]
TEXT = "".join(DELTAS)


@pytest.fixture
def srv():
    s = RedisServer(appendonly=True).start()
    yield s
    s.cleanup()


def raw(srv: RedisServer) -> redis.Redis:
    """A plain redis-py client (no retry of its own): the simulated worker and observer."""
    return redis.Redis.from_url(srv.url, decode_responses=True)


def wait_for(cond: Callable[[], bool], what: str, timeout: float = WAIT_S) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class Outcome:
    """Runs ``fn`` in a daemon thread and keeps its return value or exception."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.value: Any = None
        self.error: BaseException | None = None
        self.ended_at: float | None = None
        self.thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self.thread.start()

    def _run(self, fn: Callable[[], Any]) -> None:
        try:
            self.value = fn()
        except BaseException as e:  # handed to the test thread by get()/error
            self.error = e
        self.ended_at = time.monotonic()

    def join(self, timeout: float = WAIT_S) -> Outcome:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "reader still running"
        return self

    def get(self, timeout: float = WAIT_S) -> Any:
        self.join(timeout)
        if self.error is not None:
            raise self.error
        return self.value


# ---------------------------------------------------------------- the simulated worker

def start_job(r: redis.Redis, keys: Keys, job_id: str) -> None:
    r.hset(keys.job(job_id), mapping={"status": "running", "model": MODEL})


def write_tokens(r: redis.Redis, keys: Keys, job_id: str, indices: range) -> None:
    for i in indices:
        r.xadd(keys.out(job_id), token_fields(i, DELTAS[i], [i]), id=out_entry_id(i))


def write_final(r: redis.Redis, keys: Keys, job_id: str, index: int, text: str) -> None:
    """The worker's finish: final event and terminal hash in one transaction."""
    with r.pipeline(transaction=True) as p:
        p.xadd(keys.out(job_id), final_fields(index, "finished", "stop", text, "", 3, index),
               id=out_entry_id(index))
        p.hset(keys.job(job_id), mapping={"status": "finished", "text": text, "error": "",
                                          "finish_reason": "stop"})
        p.execute()


def blocked_in_xread(r: redis.Redis) -> int:
    """Clients that wait in a blocking XREAD right now."""
    return sum(1 for cl in r.client_list() if cl.get("cmd") == "xread" and "b" in cl["flags"])


# ---------------------------------------------------------------- the readers

def sync_readers(url: str, prefix: str, job_id: str, events: list, **kw: Any):
    """A thread in stream() (its events appended to ``events``) and one in result() of a
    Client. Returns (done, close): done() waits for both and returns what each ended with,
    [stream's exception or None, result's JobRecord or exception]."""
    c = Client(url, prefix=prefix, model=MODEL, settings=Settings(**kw))

    def stream() -> None:
        for ev in c.stream(job_id, timeout=120):
            events.append(ev)

    s, res = Outcome(stream), Outcome(lambda: c.result(job_id, timeout=120))

    def done() -> list[Any]:
        s.join(), res.join()
        return [s.error, res.error or res.value]
    return done, c.close


def async_readers(url: str, prefix: str, job_id: str, events: list, **kw: Any):
    """The same with one AsyncClient: a task in stream() and one in result(), on an event
    loop in a thread of its own."""
    async def main() -> list[Any]:
        async with AsyncClient(url, prefix=prefix, model=MODEL, settings=Settings(**kw)) as ac:
            async def stream() -> None:
                async for ev in ac.stream(job_id, timeout=120):
                    events.append(ev)

            return list(await asyncio.gather(stream(), ac.result(job_id, timeout=120),
                                             return_exceptions=True))

    o = Outcome(lambda: asyncio.run(main()))
    return o.get, lambda: None


READERS = {"sync": sync_readers, "async": async_readers}


def check_complete(events: list, ended: list[Any]) -> None:
    """Both readers returned; stream() got every event exactly once, in order, ending
    with the final one; result() the finished record."""
    stream_error, rec = ended
    assert stream_error is None and isinstance(rec, JobRecord), ended
    assert [e.index for e in events] == list(range(len(DELTAS) + 1))
    assert all(isinstance(e, TokenEvent) for e in events[:-1])
    assert isinstance(events[-1], FinalEvent) and events[-1].text == TEXT
    assert "".join(e.delta for e in events[:-1]) == TEXT
    assert rec.status == "finished" and rec.text == TEXT


# ---------------------------------------------------------------- riding out a restart

@pytest.mark.parametrize("kind", sorted(READERS))
def test_stream_and_result_ride_out_a_redis_restart(srv, kind):
    prefix, job = "t" + uuid.uuid4().hex[:8], "job-1"
    keys, w = Keys(prefix), raw(srv)
    start_job(w, keys, job)
    write_tokens(w, keys, job, range(4))
    events: list = []
    done, close = READERS[kind](srv.url, prefix, job, events)
    try:
        # both readers are inside a blocking XREAD (stream() past event 3) when Redis goes
        wait_for(lambda: len(events) == 4 and blocked_in_xread(w) == 2, "two blocked readers")
        w.close()
        srv.stop()
        time.sleep(OUTAGE_S)  # the outage; the readers keep retrying meanwhile
        assert len(events) == 4
        srv.start()
        w = raw(srv)
        assert w.hget(keys.job(job), "status") == "running"  # the AOF brought the job back
        write_tokens(w, keys, job, range(4, len(DELTAS)))
        write_final(w, keys, job, len(DELTAS), TEXT)
        check_complete(events, done())
    finally:
        close()
        w.close()


def test_submit_status_cancel_retry_until_redis_is_back(srv):
    """Calls made while Redis is down wait for it (within the budget) instead of failing:
    submit, submit_many, status and cancel."""
    prefix = "t" + uuid.uuid4().hex[:8]
    with Client(srv.url, prefix=prefix, model=MODEL) as c:
        assert c.submit("before", job_id="a", max_tokens=4) == "a"
        srv.stop()
        calls = {
            "submit": Outcome(lambda: c.submit("during", job_id="b", max_tokens=4)),
            "submit_many": Outcome(lambda: c.submit_many([{"prompt": "x", "id": "c"},
                                                          {"prompt": "y", "id": "d"}])),
            "status": Outcome(lambda: c.status("a").status),
            "cancel": Outcome(lambda: c.cancel("a")),
        }
        time.sleep(OUTAGE_S)
        assert all(o.thread.is_alive() for o in calls.values())
        srv.start()
        assert calls["submit"].get() == "b"
        assert calls["submit_many"].get() == ["c", "d"]
        assert calls["status"].get() in ("queued", "cancelled")
        assert calls["cancel"].get() is True
        assert {c.status(j).status for j in "bcd"} == {"queued"}
        assert c.status("a").status == "cancelled"


def test_subscribe_resubscribes_after_a_restart(srv):
    """subscribe() is at-most-once: it misses what is published while Redis is down, but
    keeps listening on the new server once it is back."""
    prefix, job = "t" + uuid.uuid4().hex[:8], "job-s"
    keys, w = Keys(prefix), raw(srv)
    start_job(w, keys, job)
    chan = keys.chan(job)
    with Client(srv.url, prefix=prefix, model=MODEL) as c:
        sub = Outcome(lambda: list(c.subscribe(job, timeout=120)))
        wait_for(lambda: w.pubsub_numsub(chan)[0][1] == 1, "the subscription")
        w.close()
        srv.stop()
        time.sleep(OUTAGE_S)
        assert sub.thread.is_alive()
        srv.start()
        w = raw(srv)
        wait_for(lambda: w.pubsub_numsub(chan)[0][1] == 1, "the resubscription")
        w.publish(chan, json.dumps(final_fields(0, "finished", "stop", "done", "", 1, 0)))
        evs = sub.get()
        assert len(evs) == 1 and isinstance(evs[0], FinalEvent) and evs[0].text == "done"
        w.close()


def test_busy_loading_is_retried(srv):
    """A restarted Redis answers -LOADING (BusyLoadingError) until its AOF is loaded; the
    clients wait that out too. key-load-delay makes loading take seconds."""
    assert issubclass(redis.BusyLoadingError, RETRYABLE)
    prefix, job = "t" + uuid.uuid4().hex[:8], "job-l"
    keys, w = Keys(prefix), raw(srv)
    with w.pipeline(transaction=False) as p:
        for i in range(300):
            p.set(f"fill:{i}", "x" * 200)
        p.execute()
    w.bgrewriteaof()  # the keys go to the AOF's RDB base, which key-load-delay slows down
    wait_for(lambda: not any(w.info("persistence")[k] for k in
                             ("aof_rewrite_in_progress", "aof_rewrite_scheduled")),
             "the AOF rewrite")
    start_job(w, keys, job)
    write_tokens(w, keys, job, range(4))
    events: list = []
    done, close = sync_readers(srv.url, prefix, job, events)
    try:
        wait_for(lambda: len(events) == 4 and blocked_in_xread(w) == 2, "two blocked readers")
        w.close()
        srv.stop()
        srv.extra = ["--key-load-delay", "10000",  # µs per key: ~3 s for 300 keys
                     "--loading-process-events-interval-bytes", "1024"]
        starting = Outcome(lambda: srv.start(timeout=WAIT_S))
        wait_for(lambda: loading(srv.port), "Redis to answer -LOADING")
        with Client(srv.url, prefix=prefix, model=MODEL) as c:
            assert c.status(job).status == "running"  # asked while loading, answered after
        starting.get()
        w = raw(srv)
        write_tokens(w, keys, job, range(4, len(DELTAS)))
        write_final(w, keys, job, len(DELTAS), TEXT)
        check_complete(events, done())
    finally:
        close()
        w.close()


def loading(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as s:
            s.sendall(b"EXISTS probe\r\n")
            return s.recv(64).startswith(b"-LOADING")
    except OSError:
        return False


# ---------------------------------------------------------------- giving up

@pytest.mark.parametrize("kind", sorted(READERS))
def test_blocked_readers_give_up_after_client_retry_s(srv, kind):
    """With Redis kept down, a reader cut in its blocking XREAD raises the ConnectionError
    once client_retry_s has passed since the failure (not before), within a bounded time."""
    prefix, job = "t" + uuid.uuid4().hex[:8], "job-d"
    keys, w = Keys(prefix), raw(srv)
    start_job(w, keys, job)
    write_tokens(w, keys, job, range(2))
    events: list = []
    done, close = READERS[kind](srv.url, prefix, job, events, client_retry_s=1.0)
    try:
        wait_for(lambda: len(events) == 2 and blocked_in_xread(w) == 2, "two blocked readers")
        w.close()
        stopped = time.monotonic()
        srv.stop()
        ended = done()
        took = time.monotonic() - stopped
        assert all(isinstance(x, redis.ConnectionError) for x in ended), ended
        assert 1.0 <= took < 30.0
        assert len(events) == 2
    finally:
        close()


@pytest.mark.parametrize("budget", [0.0, 0.5])
def test_calls_give_up_after_client_retry_s(budget):
    """Nothing listens: every call raises ConnectionError after the budget (0 = at once),
    both clients."""
    url = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens: connections are refused
    with Client(url, prefix="t", model=MODEL, settings=Settings(client_retry_s=budget)) as c:
        for call in (lambda: c.status("x"), lambda: c.submit("hi", job_id="x"),
                     lambda: c.cancel("x"), lambda: list(c.stream("x"))):
            t0 = time.monotonic()
            with pytest.raises(redis.ConnectionError):
                call()
            assert budget <= time.monotonic() - t0 < budget + 10.0

    async def async_calls() -> None:
        async with AsyncClient(url, prefix="t", model=MODEL,
                               settings=Settings(client_retry_s=budget)) as ac:
            for call in (lambda: ac.status("x"), lambda: ac.result("x")):
                t0 = time.monotonic()
                with pytest.raises(redis.ConnectionError):
                    await call()
                assert budget <= time.monotonic() - t0 < budget + 10.0
    asyncio.run(async_calls())


def test_backoff_is_capped_exponential_within_the_budget():
    b = Backoff(1000.0)
    for i in range(12):
        step = min(RETRY_CAP_S, RETRY_FIRST_S * 2 ** i)
        assert step / 2 <= b.next_delay() <= step  # jittered in [step/2, step]
    b = Backoff(0.2)
    assert b.next_delay() <= 0.2  # never past the budget
    time.sleep(0.25)
    assert b.next_delay() is None  # budget spent: give up
    assert Backoff(0.0).next_delay() is None
