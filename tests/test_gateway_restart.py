"""A rolling restart behind the gateway: worker A is stopped cleanly (SIGTERM) while worker
B starts; an official-SDK client, sending requests all along with retries enough for B's
start, sees no error. Between A's leaving and B's first heartbeat the gateway answers 503
``no_worker`` (the model was served moments ago), which the SDK retries; a 404
``model_not_found`` there (what a clean stop used to cause) would be raised at once. The
gap is made certain: B is held (SIGSTOP) from its spawn until a request has met the gap.
Real processes throughout: redis-server, `pagedq gateway`, two `pagedq worker`s of a tiny
random Llama."""
from __future__ import annotations

import signal
import threading

import httpx
import openai
import pytest
import redis

from pagedq.worker.redis_server import RedisServer
from tests.model_fixtures import make_tiny_chat_model
from tests.test_gateway import PREFIX, Gateway, make_key
from tests.tiny_service import MODEL
from tests.waiting import until
from tests.worker_proc import WorkerProc

pytestmark = pytest.mark.timeout(300)


def worker(url: str, folder: str, name: str) -> WorkerProc:
    return WorkerProc(url, PREFIX, model=folder, worker_id=name,
                      extra=["--served-name", MODEL, "--max-num-seqs", "8"],
                      env={"PAGEDQ_HEARTBEAT_TTL_S": "3"})


def test_rolling_restart_is_invisible_to_an_sdk_client(tmp_path_factory):
    folder = str(make_tiny_chat_model(tmp_path_factory.mktemp("tiny-restart")))
    srv = RedisServer().start()
    a = worker(srv.url, folder, "worker-a").start(wait=False)
    gw = Gateway(srv.url, tmp_path_factory.mktemp("restart-batches"))
    b = None
    statuses: list[int] = []
    try:
        gw.wait_ready()
        a.wait_ready()
        http = httpx.Client(event_hooks={"response": [lambda r: statuses.append(r.status_code)]})
        # the SDK's exponential backoff (0.5 s doubling, capped at 8 s): 8 retries wait out
        # ~40 s, a tiny worker's start under a loaded CI machine included
        sdk = openai.OpenAI(base_url=gw.base + "/v1", api_key=make_key(srv.url),
                            http_client=http, max_retries=8)
        done, errors, stop = [], [], threading.Event()

        def client() -> None:
            k = 0
            while not stop.is_set():
                k += 1
                try:
                    if k % 2:
                        r = sdk.completions.create(model=MODEL, prompt=f"request {k}",
                                                   max_tokens=4)
                        text = r.choices[0].text
                    else:
                        text = "".join(c.choices[0].text for c in sdk.completions.create(
                            model=MODEL, prompt=f"request {k}", max_tokens=4, stream=True))
                    done.append(text)
                except Exception as e:  # noqa: BLE001 - what the test is about
                    errors.append(e)

        t = threading.Thread(target=client, daemon=True)
        t.start()
        until(lambda: len(done) >= 3 or errors, "requests served by worker A", 60, 0.05)
        b = worker(srv.url, folder, "worker-b").start(wait=False)  # B starts...
        b.signal(signal.SIGSTOP)  # ...held until the gap is seen
        a.signal(signal.SIGTERM)  # ...while A stops cleanly
        assert a.proc.wait(60) == 0, a.log()
        # A is gone, B is held: a request now meets no live worker, gets 503 and is retried
        # until B serves it
        before = len(statuses)
        gap: list = []
        asker = threading.Thread(target=lambda: gap.append(sdk.completions.create(
            model=MODEL, prompt="in the gap", max_tokens=4)), daemon=True)
        asker.start()
        until(lambda: 503 in statuses[before:], "a 503 in the gap", 60, 0.05)
        with redis.Redis.from_url(srv.url) as r:
            assert not r.exists(f"{{{PREFIX}}}:worker:worker-b")
        b.signal(signal.SIGCONT)
        asker.join(120)
        assert gap and gap[0].choices[0].finish_reason in ("stop", "length"), statuses[before:]
        served_before_b = len(done)
        b.wait_ready()
        until(lambda: len(done) >= served_before_b + 3 or errors, "requests served by B",
              60, 0.05)
        stop.set()
        t.join(60)
        assert not errors, errors
        assert 404 not in statuses and all(s in (200, 503) for s in statuses), statuses
        assert "drain_started" in a.log(None)
    finally:
        gw.stop()
        for w in (a, b):
            if w is not None:
                w.stop(10)
        srv.cleanup()
