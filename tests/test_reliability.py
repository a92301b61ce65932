"""Worker faults against real redis-server and real worker processes killed with real
signals. A tiny random Llama (byte-level tokenizer) keeps them fast; what is checked is
the queue's behaviour: no job lost, exactly one terminal result, no duplicated or
missing tokens."""
from __future__ import annotations

import json
import signal
import subprocess
import sys
import time

import pytest

from pagedq.producer import Client
from pagedq.wire import lua
from pagedq.wire.errors import Overloaded
from pagedq.wire.keys import GROUP
from pagedq.wire.schema import FinalEvent
from pagedq.wire.settings import Settings
from pagedq.worker.redis_server import RedisServer
from tests.queue_helpers import move, queued
from tests.tiny_service import MODEL
from tests.worker_proc import WorkerProc


def events_of(c: Client, job_id: str):
    evs = list(c.stream(job_id, timeout=60))
    assert [e.index for e in evs] == list(range(len(evs))), "missing or duplicated events"
    assert sum(isinstance(e, FinalEvent) for e in evs) == 1
    return evs


def check_consistent(c: Client, job_id: str):
    rec = c.result(job_id, timeout=120)
    evs = events_of(c, job_id)
    assert "".join(e.delta for e in evs[:-1]) == rec.text == evs[-1].text
    assert sum(len(e.token_ids) for e in evs[:-1]) == rec.usage.completion_tokens
    return rec, evs


def wait_tokens(c: Client, job_id: str, n: int) -> None:
    it = c.stream(job_id, timeout=60)
    for _ in range(n):
        assert next(it).type == "token"


def gen(c: Client, prompt: str = "abc", **kw) -> str:
    kw.setdefault("max_tokens", 60)
    kw.setdefault("ignore_eos", True)
    return c.submit(prompt, **kw)


def test_kill9_mid_decode_resumes_without_duplicates_and_same_seeded_text(svc):
    a = svc.worker(env={"PAGEDQ_FAILPOINTS": "step_sleep_s=0.05"})
    c = svc.client()
    job = gen(c, "resume me", temperature=0.9, seed=1234, max_tokens=80)
    wait_tokens(c, job, 15)
    a.kill()
    svc.worker()
    rec, evs = check_consistent(c, job)
    assert rec.status == "finished" and rec.attempt == 2
    assert rec.usage.completion_tokens == 80
    ref = gen(c, "resume me", temperature=0.9, seed=1234, max_tokens=80)  # uninterrupted
    assert c.result(ref, timeout=120).text == rec.text


def test_ack_lost_after_result_written_gives_no_second_result(svc):
    c = svc.client()
    r = c.redis
    job = gen(c, max_tokens=5)
    assert move(r, c.keys, MODEL) == 1
    r.xreadgroup(GROUP, "ghost", {c.keys.jobs(MODEL): ">"}, count=1)  # a worker took it...
    r.hincrby(c.keys.job(job), "attempt", 1)
    r.hset(c.keys.job(job), "status", "running")
    finish = r.register_script(lua.source("finish"))  # ...wrote its result, then died before XACK
    finish(keys=[c.keys.job(job), c.keys.out(job), c.keys.jobs(MODEL), c.keys.cancel],
           args=[1, "finished", "length", "ghost text", "", 1, 5, 0, 3600, "", GROUP, job,
                 c.keys.chan(job), time.time(), 1000])
    svc.worker()
    deadline = time.time() + 30
    while r.xpending(c.keys.jobs(MODEL), GROUP)["pending"] and time.time() < deadline:
        time.sleep(0.2)
    assert r.xpending(c.keys.jobs(MODEL), GROUP)["pending"] == 0
    rec = c.status(job)
    assert rec.text == "ghost text" and rec.attempt == 1
    assert len(events_of(c, job)) == 1


def test_duplicate_claim_of_running_job_fences_the_stale_owner(svc):
    # A is frozen (SIGSTOP: a VM pause, a swap storm) longer than the lease, so B claims
    # A's job while A is still alive; when A wakes up, its late writes must be refused.
    a = svc.worker(env={"PAGEDQ_FAILPOINTS": "step_sleep_s=0.3"})
    c = svc.client()
    job = gen(c, max_tokens=40)
    wait_tokens(c, job, 1)
    a.signal(signal.SIGSTOP)
    try:
        svc.worker()
        deadline = time.monotonic() + 60
        while c.status(job).attempt < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.status(job).attempt >= 2
    finally:
        a.signal(signal.SIGCONT)
    rec, _evs = check_consistent(c, job)
    assert rec.attempt >= 2 and rec.worker != a.worker_id
    assert rec.usage.completion_tokens == 40
    deadline = time.monotonic() + 30
    while "job_lost" not in a.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert "job_lost" in a.log()  # A saw it was fenced off and dropped the job
    rec2, _ = check_consistent(c, job)
    assert rec2 == rec


def test_restart_recovers_own_pending_entries_before_the_lease(svc):
    w = svc.worker(worker_id="fixed", env={"PAGEDQ_LEASE_S": "600",
                                           "PAGEDQ_FAILPOINTS": "step_sleep_s=0.05"})
    c = svc.client()
    job = gen(c, max_tokens=40)
    wait_tokens(c, job, 5)
    w.kill()
    t0 = time.time()
    svc.worker(worker_id="fixed", env={"PAGEDQ_LEASE_S": "600"})
    rec, _ = check_consistent(c, job)
    assert rec.status == "finished" and rec.attempt == 2
    assert time.time() - t0 < 120  # far below the 600 s lease: read from its own pending


def test_redis_killed_and_restarted_with_aof_loses_no_acknowledged_job(tmp_path, tiny_dir):
    srv = RedisServer(dir=str(tmp_path), appendonly=True).start()
    try:
        w = WorkerProc(srv.url, "aof", model=tiny_dir, extra=["--served-name", MODEL],
                       env={"PAGEDQ_LEASE_S": "2", "PAGEDQ_FAILPOINTS": "step_sleep_s=0.02"})
        w.start()
        c = Client(settings=Settings(redis_url=srv.url, prefix="aof", model=MODEL))
        jobs = [gen(c, f"job {i}", max_tokens=30) for i in range(12)]
        wait_tokens(c, jobs[0], 3)
        srv.kill()
        time.sleep(1.5)
        srv.start()
        for j in jobs:
            rec, _ = check_consistent(c, j)
            assert rec.status == "finished"
        assert w.proc.poll() is None, "the worker must survive the outage"
        c.close()
        w.stop()
    finally:
        srv.cleanup()


def test_poison_job_goes_to_dlq_after_max_deliveries_and_worker_keeps_serving(svc):
    env = {"PAGEDQ_FAILPOINTS": "crash_on_prompt=POISON", "PAGEDQ_MAX_DELIVERIES": "2",
           "PAGEDQ_LEASE_S": "1"}
    c = svc.client()
    poison = gen(c, "POISON pill", max_tokens=5)
    good = [gen(c, f"fine {i}", max_tokens=5) for i in range(3)]
    restarts = 0
    deadline = time.time() + 150
    while time.time() < deadline:  # a supervisor: restart the worker whenever it dies
        w = svc.worker(env=env, worker_id="same", wait=False)
        while w.proc.poll() is None and time.time() < deadline:
            if c.status(poison).done and all(c.status(g).done for g in good):
                break
            time.sleep(0.2)
        if w.proc.poll() is None:
            break
        restarts += 1
    rec = c.result(poison, timeout=5)
    assert rec.status == "failed" and "poison" in rec.error
    assert restarts == 2  # two crashed deliveries, the third is dead-lettered
    dlq = c.redis.xrange(c.keys.dlq(MODEL))
    assert [f["job"] for _i, f in dlq] == [poison]
    for g in good:
        assert c.result(g, timeout=60).status == "finished"


def test_oversized_and_malformed_raw_entries(svc):
    svc.worker()
    c = svc.client()
    s = c.keys.jobs(MODEL)
    c.redis.xadd(s, {"job": "huge", "body": '{"prompt": "' + "x" * 1_100_000 + '"}'})
    c.redis.xadd(s, {"job": "arr", "body": "[1, 2]"})
    c.redis.xadd(s, {"job": "bad id!", "body": '{"prompt": "hi"}'})
    c.redis.xadd(s, {"job": "v2", "body": '{"prompt": "hi", "max_tokens": 2}', "v": "2"})
    ok = gen(c, max_tokens=3)
    assert c.result(ok, timeout=60).status == "finished"
    for j in ("huge", "arr", "v2"):
        rec = c.result(j, timeout=30)
        assert rec.status == "failed", rec
    assert "1000000" in c.status("huge").error or "longer" in c.status("huge").error
    assert c.status("v2").error.startswith("unknown schema version '2'")
    assert len(c.redis.xrange(c.keys.dlq(MODEL))) == 4
    assert c.redis.xpending(s, GROUP)["pending"] == 0


def test_flood_beyond_caps_is_refused_with_overloaded(svc):
    c = svc.client(max_queued_jobs=5)
    for i in range(5):
        gen(c, f"{i}")
    with pytest.raises(Overloaded):
        gen(c, "one too many")
    assert len(queued(c.redis, c.keys, MODEL)) == 5
    svc.worker()
    c2 = svc.client(max_queued_jobs=5)
    deadline = time.time() + 60
    while time.time() < deadline:  # the queue drains, so submissions are accepted again
        try:
            j = gen(c2, "later", max_tokens=2)
            break
        except Overloaded:
            time.sleep(0.3)
    assert c2.result(j, timeout=60).status == "finished"


def test_cancel_queued_and_running(svc):
    c = svc.client()
    queued = gen(c, max_tokens=5)
    assert c.cancel(queued) is True
    assert c.status(queued).status == "cancelled"
    svc.worker(env={"PAGEDQ_FAILPOINTS": "step_sleep_s=0.05"})
    running = gen(c, max_tokens=200)
    wait_tokens(c, running, 5)
    t0 = time.time()
    assert c.cancel(running) is True
    rec, evs = check_consistent(c, running)
    assert rec.status == "cancelled" and rec.finish_reason == "cancelled"
    assert 5 <= rec.usage.completion_tokens < 200 and time.time() - t0 < 10
    assert c.status(queued).attempt == 0  # the cancelled queued job never started
    assert not c.redis.sismember(c.keys.cancel, running)


def test_deadlines_before_and_during_generation(svc):
    c = svc.client()
    early = gen(c, max_tokens=5, timeout_s=0.5)
    time.sleep(1.0)
    svc.worker(env={"PAGEDQ_FAILPOINTS": "step_sleep_s=0.05"})
    rec = c.result(early, timeout=60)
    assert rec.status == "expired" and rec.usage.completion_tokens == 0
    late = gen(c, max_tokens=2000, timeout_s=3.0)
    rec, _ = check_consistent(c, late)
    assert rec.finish_reason == "deadline" and 0 < rec.usage.completion_tokens < 2000


def test_long_job_not_reclaimed_while_its_worker_is_alive(svc):
    env = {"PAGEDQ_LEASE_S": "1.5", "PAGEDQ_FAILPOINTS": "step_sleep_s=0.05"}
    a = svc.worker(env=env)
    c = svc.client()
    job = gen(c, max_tokens=120)  # ~6 s, four leases
    wait_tokens(c, job, 1)
    svc.worker(env={"PAGEDQ_LEASE_S": "1.5"})
    rec, _ = check_consistent(c, job)
    assert rec.attempt == 1 and rec.worker == a.worker_id


def test_absent_reader_out_stream_is_capped_and_expires(svc):
    # XADD MAXLEN ~ only drops whole stream nodes (stream-node-max-entries, default 100
    # entries), and a busy worker merges tokens into fewer events, so with the defaults the
    # head of a 250-token job's log need not be trimmed at all. With 5-entry nodes and a cap
    # of 10 it is trimmed once about 15 events exist (the job writes far more).
    maxlen, node = 10, 5
    c = svc.client()
    c.redis.config_set("stream-node-max-entries", node)  # before the out stream exists
    svc.worker(env={"PAGEDQ_OUT_MAXLEN": str(maxlen), "PAGEDQ_RESULT_TTL_S": "120"})
    job = gen(c, max_tokens=250)
    rec = c.result(job, timeout=120)
    assert rec.status == "finished"
    out = c.keys.out(job)
    last_id = c.redis.xrevrange(out, count=1)[0][0]
    last = int(last_id.split("-")[1]) - 1  # event i lives at id 0-(i+1)
    assert last >= maxlen + node  # enough events were written for trimming to be due
    # capped: each XADD drops whole head nodes while length - head node size >= maxlen
    assert c.redis.xlen(out) < maxlen + node
    first_id = c.redis.xrange(out, count=1)[0][0]
    assert int(first_id.split("-")[1]) - 1 > 0  # the head really was trimmed
    assert 0 < c.redis.ttl(out) <= 120
    assert 0 < c.redis.ttl(c.keys.job(job)) <= 120
    # the head of the log is gone: a reader from 0 of the finished job gets the final event
    # (complete text), a reader of a running job would get EventsTrimmed
    evs = list(c.stream(job, from_index=0, timeout=10))
    assert len(evs) == 1 and isinstance(evs[0], FinalEvent) and evs[0].text == rec.text
    assert list(c.stream(job, from_index=last, timeout=10))[-1].text == rec.text


def test_idempotent_resubmission_runs_once(svc):
    svc.worker()
    c = svc.client()
    a = gen(c, max_tokens=4, job_id="same-id")
    b = gen(c, max_tokens=4, job_id="same-id")
    assert a == b == "same-id"
    rec = c.result(a, timeout=60)
    # one run: attempt 1, and its 4 tokens streamed once (an event may carry several)
    evs = events_of(c, a)
    assert rec.attempt == 1 and sum(len(e.token_ids) for e in evs[:-1]) == 4
    assert c.redis.xlen(c.keys.jobs(MODEL)) == 0  # one entry, deleted once its job ended


def test_script_cache_flushed_under_a_running_worker(svc):
    """Scripts run as functions (Redis >= 7) or by EVALSHA (6.2); after FUNCTION FLUSH and
    SCRIPT FLUSH (what a Redis restart without its data amounts to) the worker loads them
    again: jobs running and jobs arriving all finish once."""
    svc.worker(env={"PAGEDQ_FAILPOINTS": "step_sleep_s=0.05"})
    c = svc.client()
    running = gen(c, max_tokens=30)
    wait_tokens(c, running, 2)
    c.redis.script_flush()  # PUBLISH / FINISH / REFRESH of the running job meet NOSCRIPT
    c.redis.function_flush()  # ... or "Function not found"
    later = [gen(c, f"job {i}", max_tokens=5) for i in range(3)]  # START meets it too
    for job in [running, *later]:
        rec, _ = check_consistent(c, job)
        assert rec.status == "finished" and rec.attempt == 1


def test_watchdog_fails_a_wedged_step_and_the_job_is_taken_over(svc):
    w = svc.worker(env={"PAGEDQ_FAILPOINTS": "wedge_on_prompt=HANG",
                        "PAGEDQ_STEP_WATCHDOG_S": "2"})
    c = svc.client()
    job = gen(c, "HANG here", max_tokens=10)
    assert w.proc.wait(30) == 70  # exits instead of hanging forever
    assert "step_wedged" in w.log()
    svc.worker()
    rec, _ = check_consistent(c, job)
    assert rec.status == "finished" and rec.attempt == 2


def test_second_sigterm_exits_at_once_first_drains(svc):
    w = svc.worker(env={"PAGEDQ_FAILPOINTS": "step_sleep_s=0.05", "PAGEDQ_DRAIN_TIMEOUT_S": "60"})
    c = svc.client()
    job = gen(c, max_tokens=40)
    wait_tokens(c, job, 2)
    w.signal(signal.SIGTERM)  # drain: the running job finishes
    assert w.proc.wait(60) == 0
    assert c.result(job, timeout=5).status == "finished"
    stopped = [json.loads(x) for x in w.log().splitlines() if '"worker_stopped"' in x]
    assert stopped and stopped[0]["steps"] >= 40  # the exit line, with the collector's figures
    assert stopped[0]["gc_full"] >= 0 and stopped[0]["gc_max_pause_s"] >= 0
    loop = stopped[0]["loop_s"]  # intake while the job ran, inside all of intake
    assert 0 < loop["intake_busy"] <= loop["intake"] and loop["other"] >= 0, loop
    assert stopped[0]["intake_read_round_trips"] > 0  # busy reads went by the reader thread
    w2 = svc.worker(env={"PAGEDQ_FAILPOINTS": "step_sleep_s=0.05", "PAGEDQ_DRAIN_TIMEOUT_S": "60"})
    job2 = gen(c, max_tokens=500)
    wait_tokens(c, job2, 2)
    w2.signal(signal.SIGTERM)
    time.sleep(0.3)
    w2.signal(signal.SIGTERM)  # second signal: out at once
    assert w2.proc.wait(10) != 0
    svc.worker()  # the job is taken over and completed
    rec, _ = check_consistent(c, job2)
    assert rec.status == "finished" and rec.attempt == 2


if __name__ == "__main__":
    sys.exit(subprocess.call([sys.executable, "-m", "pytest", "-q", __file__]))


@pytest.mark.parametrize("kv", ["fp8", "fp8_e5m2", "int8"])
def test_worker_with_8bit_kv_cache_serves_jobs(svc, kv):
    """Each 8-bit KV cache end to end: its ready line names it; jobs through Redis."""
    w = svc.worker(extra=["--kv-cache-dtype", kv])
    c = svc.client()
    jobs = [gen(c, f"{kv} {i}", max_tokens=6, temperature=1.0) for i in range(3)]
    jobs.append(gen(c, "greedy", max_tokens=6, temperature=0.0))
    for job in jobs:
        rec, _ = check_consistent(c, job)
        assert rec.status == "finished" and rec.usage.completion_tokens == 6
    names = {"fp8": "float8_e4m3fn, scales fitted", "fp8_e5m2": "float8_e5m2",
             "int8": "int8, scale per token"}
    assert names[kv] in w.log(tail=None)


def test_worker_noise_seed_is_per_process_unless_given():
    from pagedq.cli import build_parser
    from pagedq.worker.cli import engine_kwargs
    seeds = {engine_kwargs(build_parser().parse_args(["worker"]))["seed"] for _ in range(3)}
    assert len(seeds) == 3  # workers never share the unseeded jobs' noise stream
    assert engine_kwargs(build_parser().parse_args(["worker", "--seed", "5"]))["seed"] == 5
