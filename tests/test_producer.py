"""Producer client against a real redis-server. The worker side is simulated: a thread
writes events at their explicit ids with schema.token_fields/final_fields."""
from __future__ import annotations

import asyncio
import hashlib
import json
import threading
import time
import uuid

import pytest

from pagedq.producer import (
    AsyncClient,
    Client,
    EventsTrimmed,
    FinalEvent,
    InvalidRequest,
    JobConflict,
    JobNotFound,
    JobRequest,
    Overloaded,
    ResultTimeout,
    Settings,
    TokenEvent,
)
from pagedq.wire.keys import GROUP, out_entry_id
from pagedq.wire.schema import final_fields, token_fields
from tests.queue_helpers import inbox, move

MODEL = "m1"


def make_client(url: str, **settings) -> Client:
    return Client(url, prefix="t" + uuid.uuid4().hex[:10], model=MODEL,
                  settings=Settings(**settings))


@pytest.fixture
def url(shared_redis_server):
    return shared_redis_server.url


@pytest.fixture
def c(url):
    with make_client(url) as client:
        yield client


def play(c: Client, job_id: str, deltas: list[str], delay: float = 0.01,
         status: str = "finished", finish: bool = True) -> None:
    """What a worker writes: status running, one event per delta, final event + hash."""
    r, out = c.redis, c.keys.out(job_id)
    r.hset(c.keys.job(job_id), "status", "running")
    for i, d in enumerate(deltas):
        time.sleep(delay)
        r.xadd(out, token_fields(i, d, [i]), id=out_entry_id(i))
    if finish:
        time.sleep(delay)
        write_final(c, job_id, len(deltas), "".join(deltas), status)


def write_final(c: Client, job_id: str, index: int, text: str, status: str = "finished",
                error: str = "") -> None:
    """The worker's finish: final event and terminal hash in one transaction."""
    with c.redis.pipeline(transaction=True) as p:
        p.xadd(c.keys.out(job_id), final_fields(index, status, "stop", text, error, 3, index),
               id=out_entry_id(index))
        p.hset(c.keys.job(job_id), mapping={"status": status, "text": text, "error": error,
                                              "finish_reason": "stop"})
        p.execute()


def bg(fn, *args, **kw) -> threading.Thread:
    t = threading.Thread(target=fn, args=args, kwargs=kw, daemon=True)
    t.start()
    return t


def assert_complete(events, n: int, start: int = 0) -> None:
    assert [e.index for e in events] == list(range(start, n + 1))
    assert all(isinstance(e, TokenEvent) for e in events[:-1])
    assert isinstance(events[-1], FinalEvent) and events[-1].status == "finished"


DELTAS = [f"w{i} " for i in range(12)]


# ---------------------------------------------------------------- submit

def test_submit_writes_hash_inbox_item_wake_and_counter(c):
    jid = c.submit("hello world!", max_tokens=10, timeout_s=60, stop="\n")
    h = c.redis.hgetall(c.keys.job(jid))
    assert h["status"] == "queued" and h["model"] == MODEL and h["attempt"] == "0"
    assert h["qtok"] == str(12 // 4 + 10) and "entry" not in h
    assert float(h["deadline"]) == pytest.approx(float(h["created_at"]) + 60, abs=1e-3)
    (fields,) = inbox(c.redis, c.keys, MODEL)  # the jobs stream is the workers' alone
    assert fields["job"] == jid and fields["v"] == "1" and not c.redis.exists(c.keys.jobs(MODEL))
    req = JobRequest.model_validate_json(fields["body"])
    assert req.id == jid and req.stop == ["\n"] and req.max_tokens == 10
    assert h["req_hash"] == hashlib.sha1(fields["body"].encode()).hexdigest()
    assert c.redis.lrange(c.keys.wake(MODEL), 0, -1) == ["1"]  # the idle workers' doorbell
    assert c.redis.get(c.keys.queued_tokens(MODEL)) == "13"
    # a worker's MOVE puts it on the stream, with its group, and records the entry id
    assert move(c.redis, c.keys, MODEL) == 1 and not c.redis.exists(c.keys.inbox(MODEL))
    (eid, entry), = c.redis.xrange(c.keys.jobs(MODEL))
    assert entry == fields and c.redis.hget(c.keys.job(jid), "entry") == eid
    assert [g["name"] for g in c.redis.xinfo_groups(c.keys.jobs(MODEL))] == [GROUP]
    assert c.status(jid).status == "queued" and c.status(jid).created_at > 1e9


@pytest.mark.parametrize("args, kw", [
    (("",), {}), (("   \n",), {}), (("hi",), {"max_tokens": 0}), (("hi",), {"max_tokens": -5}),
    (("hi",), {"max_tokens": 10**9}), (("hi",), {"temperature": -0.1}),
    (("hi",), {"bogus": 1}), (("hi",), {"messages": [{"role": "user", "content": "x"}]}),
    ((), {}), ((), {"messages": []}), (("hi",), {"job_id": "a b{x}"}),
    (("hi",), {"model": "bad model"}), ((5,), {}),
])
def test_invalid_submit_enqueues_nothing(c, args, kw):
    with pytest.raises(InvalidRequest, match="invalid"):
        c.submit(*args, **kw)
    assert list(c.redis.scan_iter(c.keys.base + "*")) == []


def test_idempotent_resubmit_and_conflict(c):
    assert c.submit("same", job_id="job-1", max_tokens=4) == "job-1"
    assert c.submit("same", job_id="job-1", max_tokens=4) == "job-1"
    assert c.submit_request(JobRequest(id="job-1", model=MODEL, prompt="same",
                                       max_tokens=4)) == "job-1"
    with pytest.raises(JobConflict):
        c.submit("different", job_id="job-1", max_tokens=4)
    assert len(inbox(c.redis, c.keys, MODEL)) == 1


def test_caps_refuse_and_enqueue_nothing(url):
    with make_client(url, max_queued_jobs=2) as c:
        c.submit("a"), c.submit("b")
        with pytest.raises(Overloaded, match="max_queued_jobs=2"):
            c.submit("c", job_id="refused")
        assert len(inbox(c.redis, c.keys, MODEL)) == 2
        assert not c.redis.exists(c.keys.job("refused"))
    with make_client(url, max_queued_tokens=100) as c:
        first = c.submit("x" * 40, max_tokens=50)  # 60
        with pytest.raises(Overloaded, match="max_queued_tokens=100"):
            c.submit("y", max_tokens=50)  # 60 + 50 > 100
        assert c.redis.get(c.keys.queued_tokens(MODEL)) == "60"
        assert c.cancel(first)  # cancelling a queued job gives its tokens back
        assert c.redis.get(c.keys.queued_tokens(MODEL)) == "0"
        assert c.redis.hget(c.keys.job(first), "qtok") == "0"
        c.submit("y" * 400, max_tokens=50)  # bigger than the cap, but the queue is empty
        assert len(inbox(c.redis, c.keys, MODEL)) == 2  # (the cancelled job's item is there)


def test_concurrent_submits_from_threads(c):
    ids: list[str] = []
    lock = threading.Lock()

    def work():
        got = [c.submit(f"prompt {i}", max_tokens=8) for i in range(10)]
        with lock:
            ids.extend(got)

    for t in [bg(work) for _ in range(8)]:
        t.join()
    assert len(set(ids)) == 80
    entries = inbox(c.redis, c.keys, MODEL)
    assert sorted(f["job"] for f in entries) == sorted(ids)


def test_submit_many(c):
    reqs = [JobRequest(prompt=f"p{i}", max_tokens=4) for i in range(5)]
    ids = c.submit_many(reqs + [{"prompt": "dict", "id": "fixed"}])
    assert len(set(ids)) == 6 and ids[-1] == "fixed"
    assert len(inbox(c.redis, c.keys, MODEL)) == 6
    assert c.status(ids[0]).model == MODEL  # the client's model when the request names none
    with pytest.raises(InvalidRequest):
        c.submit_many([{"prompt": "ok", "id": "x1"}, {"prompt": ""}])
    assert not c.redis.exists(c.keys.job("x1"))
    with pytest.raises(JobConflict) as ei:
        c.submit_many([{"prompt": "new", "id": "x2"}, {"prompt": "other", "id": "fixed"}])
    assert ei.value.job_ids == ["x2", None]


# ---------------------------------------------------------------- stream

def test_stream_live_from_start_middle_and_late(c):
    jid = c.submit("go")
    middle: list = []
    reader = bg(lambda: middle.extend(c.stream(jid, from_index=5, timeout=5)))
    t = bg(play, c, jid, DELTAS)
    events = list(c.stream(jid, timeout=5))
    t.join(), reader.join()
    assert_complete(events, len(DELTAS))
    assert_complete(middle, len(DELTAS), start=5)
    assert_complete(list(c.stream(jid)), len(DELTAS))  # late reader: the log is the truth
    assert "".join(c.stream_text(jid)) == "".join(DELTAS)
    assert [e.index for e in c.stream(jid, from_index=len(DELTAS))] == [len(DELTAS)]


def test_reconnect_from_cursor_sees_every_event_once(c):
    jid = c.submit("go")
    t = bg(play, c, jid, DELTAS, delay=0.02)
    seen = []
    for _ in range(50):  # short-lived readers, each resuming at the last index + 1
        gen = c.stream(jid, from_index=len(seen), timeout=5)
        for ev in gen:
            seen.append(ev)
            break
        gen.close()
        if isinstance(seen[-1], FinalEvent):
            break
    t.join()
    assert_complete(seen, len(DELTAS))


def test_trimmed_log(c):
    jid = c.submit("go")
    play(c, jid, DELTAS[:4], delay=0, finish=False)  # running, events 0..3
    c.redis.xdel(c.keys.out(jid), out_entry_id(0), out_entry_id(1))
    with pytest.raises(EventsTrimmed, match="from index 0"):
        list(c.stream(jid, timeout=1))
    gen = c.stream(jid, from_index=2, timeout=1)
    assert [next(gen).index, next(gen).index] == [2, 3]
    gen.close()
    write_final(c, jid, 4, "".join(DELTAS[:4]))
    # The job ended: a reader from a trimmed index gets the final event (complete text).
    (ev,) = list(c.stream(jid))
    assert isinstance(ev, FinalEvent) and ev.index == 4 and ev.text == "".join(DELTAS[:4])
    assert "".join(c.stream_text(jid)) == "".join(DELTAS[:4])


def test_stream_errors(c):
    with pytest.raises(JobNotFound):
        list(c.stream("nope"))
    jid = c.submit("go")
    t0 = time.monotonic()
    with pytest.raises(ResultTimeout):
        list(c.stream(jid, timeout=0.3))
    assert time.monotonic() - t0 < 1.5


# ---------------------------------------------------------------- result / cancel

def _calls(c: Client, cmd: str) -> int:
    return int(c.redis.info("commandstats").get(f"cmdstat_{cmd}", {}).get("calls", 0))


def test_result_wakes_on_final_event_without_spinning(c):
    jid = c.submit("go")
    h0, x0 = _calls(c, "hgetall"), _calls(c, "xread")
    t = bg(play, c, jid, DELTAS[:3], delay=0.1)
    t0 = time.monotonic()
    rec = c.result(jid, timeout=10)
    took = time.monotonic() - t0
    t.join()
    assert rec.status == "finished" and rec.text == "".join(DELTAS[:3])
    assert 0.3 < took < 2.0
    assert _calls(c, "hgetall") - h0 <= 4 and _calls(c, "xread") - x0 <= 8
    jid2 = c.submit("never done")
    t0 = time.monotonic()
    with pytest.raises(ResultTimeout):
        c.result(jid2, timeout=0.4)
    assert 0.35 < time.monotonic() - t0 < 1.5
    with pytest.raises(JobNotFound):
        c.result("nope", timeout=0.1)


def test_cancel_queued_leaves_only_its_record_and_publishes_the_final(c):
    jid = c.submit("go")
    ps = c.redis.pubsub(ignore_subscribe_messages=True)
    ps.subscribe(c.keys.chan(jid))
    assert c.cancel(jid) is True
    rec = c.status(jid)
    assert rec.status == "cancelled" and rec.finish_reason == "cancelled" and rec.finished_at
    assert not c.redis.exists(c.keys.out(jid))  # it never ran: no event log at all
    (ev,) = list(c.stream(jid))  # the final event, taken from the record
    assert isinstance(ev, FinalEvent) and ev.index == 0 and ev.status == "cancelled"
    msg, deadline = None, time.monotonic() + 2
    while msg is None and time.monotonic() < deadline:  # the first read eats the subscribe ack
        msg = ps.get_message(timeout=0.5)
    assert msg and json.loads(msg["data"])["status"] == "cancelled"
    ps.close()
    assert 0 < c.redis.ttl(c.keys.job(jid)) <= c.settings.cancelled_ttl_s
    assert c.cancel(jid) is False
    assert c.result(jid, timeout=1).status == "cancelled"


def test_cancel_running_and_unknown(c):
    jid = c.submit("go")
    c.redis.hset(c.keys.job(jid), "status", "running")
    assert c.cancel(jid) is True
    assert c.redis.sismember(c.keys.cancel, jid)
    assert c.status(jid).status == "running"  # the owning worker ends it
    with pytest.raises(JobNotFound):
        c.cancel("unknown-job")


def test_subscribe_mirror(c):
    jid = c.submit("go")

    def publish():
        time.sleep(0.2)
        for i, d in enumerate(["a", "b"]):
            c.redis.publish(c.keys.chan(jid), json.dumps(token_fields(i, d, [i])))
        c.redis.publish(c.keys.chan(jid), json.dumps(final_fields(2, "finished", "stop", "ab",
                                                                  "", 1, 2)))
    t = bg(publish)
    events = list(c.subscribe(jid, timeout=5))
    t.join()
    assert [e.index for e in events] == [0, 1, 2] and events[-1].text == "ab"


# ---------------------------------------------------------------- asyncio

def test_async_client(url):
    async def main():
        async with AsyncClient(url, prefix="a" + uuid.uuid4().hex[:8], model=MODEL) as a:
            sync = Client(url, prefix=a.keys.prefix, model=MODEL)
            with pytest.raises(InvalidRequest):
                await a.submit("  ")
            assert await a.redis.llen(a.keys.inbox(MODEL)) == 0
            jid = await a.submit("go", job_id="aj", max_tokens=5)
            assert await a.submit("go", job_id="aj", max_tokens=5) == "aj"
            with pytest.raises(JobConflict):
                await a.submit("other", job_id="aj")
            assert (await a.status(jid)).status == "queued"
            t = bg(play, sync, jid, DELTAS)
            events = [e async for e in a.stream(jid, timeout=5)]
            t.join()
            assert_complete(events, len(DELTAS))
            assert [e.index async for e in a.stream(jid, from_index=7)] == list(range(7, 13))
            assert "".join([d async for d in a.stream_text(jid)]) == "".join(DELTAS)
            assert (await a.result(jid, timeout=1)).text == "".join(DELTAS)
            j2 = await a.submit("late")
            t = bg(play, sync, j2, DELTAS[:2], delay=0.2)
            assert (await a.result(j2, timeout=5)).status == "finished"
            t.join()
            with pytest.raises(ResultTimeout):
                await a.result(await a.submit("never"), timeout=0.3)
            ids = await a.submit_many([{"prompt": "x"}, JobRequest(prompt="y")])
            assert await a.cancel(ids[0]) is True and await a.cancel(ids[0]) is False
            assert [e.status async for e in a.stream(ids[0])] == ["cancelled"]
            assert [e.status async for e in a.subscribe(ids[0])] == ["cancelled"]
            with pytest.raises(JobNotFound):
                await a.cancel("missing")
            with pytest.raises(JobNotFound):
                await a.status("missing")
            sync.close()

    asyncio.run(main())
