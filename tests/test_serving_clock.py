"""A worker that stopped cleanly stops counting at once, to the microsecond of Redis's clock.

Its serving-set entry is scored with the moment of its stop (worker/liveness.py leave);
SUBMIT's require_worker and SERVED compare that with Redis TIME. Comparing with whole
seconds kept the stopped worker "live" for the rest of its second: a request in that gap
was queued for nobody instead of refused (503), and a rolling restart's client waited on it.
Real redis-server; the entry is written as a stopped worker writes it."""
from __future__ import annotations

import time

import pytest

from pagedq.producer import Client
from pagedq.wire.errors import NoWorker
from pagedq.wire.settings import Settings

MODEL = "clocked"


def redis_now(r) -> float:
    s, us = r.time()
    return s + us / 1e6


def test_a_worker_stopped_earlier_in_this_second_is_not_live(redis_server):
    c = Client(settings=Settings(redis_url=redis_server.url, prefix="clk", model=MODEL))
    try:
        while redis_now(c.redis) % 1 > 0.5:  # the second has time left for what follows
            time.sleep(0.05)
        now = redis_now(c.redis)
        stopped_at = int(now) + (now % 1) / 2  # earlier, in the same whole second
        c.redis.zadd(c.keys.serving(MODEL), {"w-stopped": stopped_at})
        c.redis.zadd(c.keys.serving(MODEL), {"w-dead": now - 30})
        c.redis.sadd(c.keys.models, MODEL)
        with pytest.raises(NoWorker):
            c.submit("x", max_tokens=2, require_worker=True)
        assert c.served_models() == {}
        assert int(redis_now(c.redis)) == int(now), "the test ran past its second"
        c.redis.zadd(c.keys.serving(MODEL), {"w-live": redis_now(c.redis) + 5})
        assert c.served_models() == {MODEL: 1}
        job = c.submit("x", max_tokens=2, require_worker=True)
        assert c.status(job).status == "queued"
    finally:
        c.close()
