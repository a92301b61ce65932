"""Shared fixtures: real redis-server processes (random port, temp dir), never a mock."""
from __future__ import annotations

import pytest
import redis

from worker.redis_server import RedisServer

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
