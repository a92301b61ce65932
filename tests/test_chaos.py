"""Chaos soak: several workers, many jobs, workers SIGKILLed and restarted repeatedly and
Redis (AOF) killed and restarted once. Every job must end with exactly one terminal
result and a gap-free event log; nothing lost, nothing duplicated.

The CI version is short; `pytest -m slow tests/test_chaos.py` runs the long soak
(PAGEDQ_SOAK_JOBS / PAGEDQ_SOAK_KILLS override the sizes)."""
from __future__ import annotations

import os
import random
import threading
import time

import pytest
import redis

from pagedq.producer import Client
from pagedq.wire.schema import FinalEvent
from pagedq.wire.settings import Settings
from pagedq.worker.redis_server import RedisServer
from tests.model_fixtures import make_tiny_model
from tests.worker_proc import WorkerProc

ENV = {"PAGEDQ_LEASE_S": "1.5", "PAGEDQ_HEARTBEAT_TTL_S": "3",
       "PAGEDQ_FAILPOINTS": "step_sleep_s=0.02", "PAGEDQ_MAX_DELIVERIES": "20"}


def soak(tmp_path, jobs: int, kills: int, workers: int = 3) -> dict:
    model = str(make_tiny_model("LlamaForCausalLM", tmp_path / "tiny"))
    srv = RedisServer(dir=str(tmp_path), appendonly=True).start()
    rng = random.Random(7)
    procs: list[WorkerProc] = []

    def spawn() -> WorkerProc:
        w = WorkerProc(srv.url, "chaos", model=model, env=ENV,
                       extra=["--served-name", "tiny", "--max-num-seqs", "8"])
        procs.append(w)
        return w.start(wait=False)

    live = [spawn() for _ in range(workers)]
    client = Client(settings=Settings(redis_url=srv.url, prefix="chaos", model="tiny"))
    ids = [f"soak-{i}" for i in range(jobs)]
    submitted: list[str] = []

    def submit_all() -> None:  # a producer that retries through the outage, idempotently
        for i, jid in enumerate(ids):
            while True:
                try:
                    client.submit(f"job {i}", max_tokens=rng.randint(4, 40), ignore_eos=True,
                                  temperature=0.8, seed=i, job_id=jid)
                    submitted.append(jid)
                    break
                except (redis.ConnectionError, redis.TimeoutError):
                    time.sleep(0.2)
            time.sleep(0.02)

    t0 = time.time()
    producer = threading.Thread(target=submit_all)
    producer.start()
    try:
        redis_restarted = False
        for k in range(kills):
            time.sleep(rng.uniform(1.0, 2.5))
            victim = live.pop(rng.randrange(len(live)))
            victim.kill()
            live.append(spawn())
            if not redis_restarted and k >= kills // 2:
                srv.kill()
                time.sleep(1.0)
                srv.start()
                redis_restarted = True
        producer.join(300)
        chaos_over = time.time()
        deadline = chaos_over + 300
        pending = set(ids)
        while pending and time.time() < deadline:
            try:
                pending = {j for j in pending if not client.status(j).done}
            except (redis.ConnectionError, redis.TimeoutError):
                pass
            time.sleep(0.5)
        recovered_s = time.time() - chaos_over
        finished = lost = dup = gaps = 0
        for jid in ids:
            try:
                rec = client.status(jid)
            except Exception:
                lost += 1
                continue
            if not rec.done:
                lost += 1
                continue
            evs = list(client.stream(jid, timeout=10))
            finals = sum(isinstance(e, FinalEvent) for e in evs)
            dup += finals > 1
            gaps += [e.index for e in evs] != list(range(len(evs)))
            text_ok = "".join(getattr(e, "delta", "") for e in evs[:-1]) == rec.text
            gaps += not text_ok
            finished += rec.status == "finished"
        return dict(submitted=len(submitted), finished=finished, lost=lost,
                    duplicated_terminal=dup, gaps=gaps, kills=kills,
                    redis_restarts=int(redis_restarted), recover_s=round(recovered_s, 1),
                    total_s=round(time.time() - t0, 1))
    finally:
        client.close()
        for w in procs:
            w.stop(10)
        srv.cleanup()


def _check(report: dict, jobs: int) -> None:
    print("\nchaos soak:", report)
    assert report["submitted"] == jobs
    assert report["lost"] == 0 and report["duplicated_terminal"] == 0 and report["gaps"] == 0
    assert report["finished"] == jobs


def test_chaos_soak_short(tmp_path):
    _check(soak(tmp_path, jobs=60, kills=4), 60)


@pytest.mark.slow
def test_chaos_soak_long(tmp_path):
    jobs = int(os.environ.get("PAGEDQ_SOAK_JOBS", "400"))
    kills = int(os.environ.get("PAGEDQ_SOAK_KILLS", "20"))
    _check(soak(tmp_path, jobs=jobs, kills=kills), jobs)
