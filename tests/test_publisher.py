"""The publisher thread against a real redis-server: ordered events, coalescing of a
large batch's deltas, and fencing of a job whose attempt moved on."""
from __future__ import annotations

from producer import Client
from producer.keys import Keys
from producer.settings import Settings
from worker.publisher import Final, Publisher


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
        pub.tokens([(keys.job(j), 1, None, f"{j}{step} ", [step], None, None) for j in jobs])
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
    pub.tokens([(keys.job("x"), 1, None, "late", [5], None, None)])
    verdicts = []
    pub.final(Final(keys, "x", 1, "", keys.jobs("m"), "finished", "stop", "late",
                    on_done=verdicts.append))
    pub.stop()
    assert r.xlen(keys.out("x")) == 0
    assert verdicts == ["fenced"]
    assert pub.lost.get_nowait() == keys.job("x")  # the job's uid (worker/jobs.py)
    assert r.hget(keys.job("x"), "status") == "running"
