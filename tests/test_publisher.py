"""The publisher thread against a real redis-server: ordered events, coalescing of a
large batch's deltas, and fencing of a job whose attempt moved on."""
from __future__ import annotations

from pagedq.producer import Client
from pagedq.wire.keys import Keys
from pagedq.wire.settings import Settings
from pagedq.worker.publisher import Final, Publisher


def _running(r, keys: Keys, job_id: str, attempt: int) -> None:
    r.hset(keys.job(job_id), mapping={"status": "running", "attempt": attempt})


def test_coalesced_events_then_one_final(redis_server, r):
    s = Settings(redis_url=redis_server.url, prefix="pub", coalesce_ms=300, coalesce_min_batch=2)
    keys = Keys("pub")
    pub = Publisher(r, s).start()
    jobs = ["a", "b", "c"]
    for j in jobs:
        _running(r, keys, j, 1)
        pub.register(keys, j, 1, 0)
    for step in range(3):  # three engine steps inside one coalescing window
        pub.tokens([(keys.job(j), 1, None, f"{j}{step} ", [step], None, None, None) for j in jobs])
    verdicts = []
    pub.final(Final(keys, "a", 1, "", keys.jobs("m"), "finished", "length", "a0 a1 a2 ", "",
                    3, 3, verdicts.append))
    pub.stop()
    assert verdicts == ["ok"]
    with Client(redis_server.url, prefix="pub", model="m") as c:
        evs = list(c.stream("a", timeout=5))
    assert [e.type for e in evs] == ["token", "final"]
    assert evs[0].delta == "a0 a1 a2 " and evs[0].token_ids == [0, 1, 2]
    assert evs[1].index == 1 and evs[1].text == "a0 a1 a2 "
    assert r.xlen(keys.out("b")) == 1  # b's three deltas are one event as well


def test_stale_owner_is_fenced_and_told(redis_server, r):
    s = Settings(redis_url=redis_server.url, prefix="pub")
    keys = Keys("pub")
    pub = Publisher(r, s).start()
    _running(r, keys, "x", 2)  # another worker took the job over (attempt 2)
    pub.register(keys, "x", 1, 0)
    pub.tokens([(keys.job("x"), 1, None, "late", [5], None, None, None)])
    verdicts = []
    pub.final(Final(keys, "x", 1, "", keys.jobs("m"), "finished", "stop", "late",
                    on_done=verdicts.append))
    pub.stop()
    assert r.xlen(keys.out("x")) == 0
    assert verdicts == ["fenced"]
    assert pub.lost.get_nowait() == (keys.job("x"), 1)  # the job's uid (worker/jobs.py)
    assert r.hget(keys.job("x"), "status") == "running"


def test_own_job_taken_back_the_earlier_attempt_leaves_it_alone(redis_server, r):
    """A worker's lease ran out while Redis was away (its publisher stalled) and it took its
    own job back (attempt 2, resuming after index 0) while attempt 1's tokens and final
    still wait in the queue: attempt 1 writes nothing, its index is not taken, and neither
    its fenced final nor a "lost" verdict stops attempt 2."""
    s = Settings(redis_url=redis_server.url, prefix="pub")
    keys, uid = Keys("pub"), Keys("pub").job("y")
    pub = Publisher(r, s)  # not started: one round, by hand
    r.xadd(keys.out("y"), {"t": "token", "i": "0", "d": "a", "ids": "1"}, id="0-1")
    _running(r, keys, "y", 2)
    pub.register(keys, "y", 1, 1)
    pub.tokens([(uid, 1, None, "stale ", [7], None, None, None)])
    verdicts = []
    pub.final(Final(keys, "y", 1, "", keys.jobs("m"), "finished", "stop", "stale",
                    on_done=verdicts.append))
    pub.register(keys, "y", 2, 1)
    pub.tokens([(uid, 2, None, "b", [2], None, None, None)])
    items = []
    while not pub._q.empty():
        items.append(pub._q.get())
    pub._round(items)
    pub.tokens([(uid, 2, None, "c", [3], None, None, None)])
    pub._round([pub._q.get()])
    assert verdicts == ["fenced"] and pub.lost.empty()
    log = r.xrange(keys.out("y"))
    assert [i for i, _ in log] == ["0-1", "0-2", "0-3"]  # no gap, nothing of attempt 1
    assert [f["d"] for _, f in log] == ["a", "b", "c"]
