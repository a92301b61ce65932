"""Fixtures (a pytest plugin, see conftest.py): real worker processes serving a tiny random
Llama (byte-level tokenizer) on a fresh redis-server, and clients of that service."""
from __future__ import annotations

import pytest

from pagedq.producer import Client
from pagedq.wire.settings import Settings
from tests.model_fixtures import make_tiny_chat_model
from tests.worker_proc import WorkerProc

MODEL = "tiny"


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """The tiny random Llama every service test runs (tests/model_fixtures.py), with a
    minimal chat template so chat requests work too; the one definition (this module is a
    plugin of tests/conftest.py)."""
    return str(make_tiny_chat_model(tmp_path_factory.mktemp("tiny")))


@pytest.fixture
def svc(redis_server, tiny_dir):
    """Start workers and clients on one fresh redis-server; everything stopped after."""
    prefix = "rel"
    started: list[WorkerProc] = []
    clients: list[Client] = []

    class Svc:
        server = redis_server

        def worker(self, env=None, worker_id=None, extra=(), wait=True):
            env = {"PAGEDQ_LEASE_S": "2", "PAGEDQ_HEARTBEAT_TTL_S": "3", **(env or {})}
            w = WorkerProc(redis_server.url, prefix, model=tiny_dir, worker_id=worker_id,
                           extra=["--served-name", MODEL, "--max-num-seqs", "16", *extra],
                           env=env)
            started.append(w)
            return w.start(wait=wait)

        def client(self, **settings):
            s = Settings(redis_url=redis_server.url, prefix=prefix, model=MODEL, **settings)
            c = Client(settings=s)
            clients.append(c)
            return c

    yield Svc()
    # SIGKILL: the test is over and its redis-server goes too. A drain would cost each
    # worker ~1 s (the idle blocking read, then exit) and checks nothing here; draining
    # is tested where it is the point (test_reliability's SIGTERM test).
    for w in started:
        w.kill()
        w.stop()  # closes its log
    for c in clients:
        c.close()
