"""A rolling restart behind the gateway: worker A is stopped cleanly (SIGTERM) while worker
B starts; an official-SDK client with its default retries, sending requests all along,
sees no error. Between A's leaving and B's first heartbeat the gateway answers 503
``no_worker`` with Retry-After (the model was served moments ago), which the SDK retries;
a 404 ``model_not_found`` there (what a clean stop used to cause) would be raised at once.
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
        sdk = openai.OpenAI(base_url=gw.base + "/v1", api_key=make_key(srv.url),
                            http_client=http)  # the SDK's default retries (2)
        assert sdk.max_retries == 2
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
        a.signal(signal.SIGTERM)  # ...while A stops cleanly
        assert a.proc.wait(60) == 0, a.log()
        # A is gone, B is still loading (its start takes longer than A's stop): a request
        # now meets no live worker, gets 503 + Retry-After and is retried until B serves it
        with redis.Redis.from_url(srv.url) as r:
            b_up = r.exists(f"{{{PREFIX}}}:worker:worker-b")
        before = len(statuses)
        text = sdk.completions.create(model=MODEL, prompt="in the gap", max_tokens=4)
        assert not b_up and 503 in statuses[before:], statuses[before:]
        assert text.choices[0].finish_reason in ("stop", "length")
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
