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

# `pytest -m fast`: the modules whose tests start no worker process and load no model (pure
# units, and the wire, Lua and clients against a redis-server they start), measured at
# about a minute on 2 busy cores. A module joins only if all of it qualifies and it stays
# quick; slower units (the KV-format and decode-variant checks, the Triton-interpreted
# kernels, the SmolLM2 tokenizer's) stay out.
FAST_MODULES = frozenset({
    "test_architecture", "test_batch_cli", "test_batch_lines", "test_block_manager",
    "test_block_manager_props", "test_client_concurrency", "test_client_retry",
    "test_kernels_cpu", "test_metrics", "test_openai_fields", "test_producer",
    "test_publisher", "test_reader", "test_sampler", "test_scheduler", "test_tool_calls",
})


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = getattr(item, "module", None)
        if module is not None and module.__name__.rpartition(".")[2] in FAST_MODULES:
            item.add_marker(pytest.mark.fast)


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
