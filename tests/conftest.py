"""Shared fixtures: real redis-server processes (random port, temp dir), never a mock."""
from __future__ import annotations

import os

# One torch (OpenMP) thread per test process, set before anything imports torch; worker
# processes the tests start inherit it. With two threads, every op waits at a barrier for
# both: on a busy machine (the suite itself runs pytest + workers, CI runs other jobs) the
# other thread is often descheduled, and SmolLM2 steps got 5-30x slower than with one.
# An OMP_NUM_THREADS already set wins.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import pytest  # noqa: E402
import redis  # noqa: E402

from pagedq.worker.redis_server import RedisServer  # noqa: E402

pytest_plugins = ["tests.model_fixtures", "tests.tiny_service"]


@pytest.fixture
def redis_server():
    """A fresh redis-server for one test; the test may kill/restart it."""
    srv = RedisServer().start()
    yield srv
    srv.cleanup()


@pytest.fixture(scope="session")
def shared_redis_server():
    """One redis-server for a whole session, for tests that only need isolation by prefix."""
    srv = RedisServer().start()
    yield srv
    srv.cleanup()


@pytest.fixture
def r(redis_server):
    client = redis.Redis.from_url(redis_server.url, decode_responses=True)
    yield client
    client.close()
