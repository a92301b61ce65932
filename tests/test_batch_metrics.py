"""`pagedq batch worker --metrics-port`: a real rq worker process's /metrics before and
after a batch (its rq jobs by function and outcome, their durations, the prefix's batches
by status, process metrics), against a real redis-server and a pagedq worker serving the
tiny model. Nothing mocked."""
from __future__ import annotations

import subprocess
import sys
import urllib.request

from prometheus_client.parser import text_string_to_metric_families

from pagedq.batch import Batches, BatchSettings
from pagedq.batch.record import BatchStatus
from pagedq.wire.settings import Settings
from pagedq.worker.redis_server import RedisServer, free_port
from tests.test_batch_e2e import PREFIX, RqWorker, write_input
from tests.tiny_service import MODEL
from tests.waiting import until
from tests.worker_proc import ROOT, WorkerProc


def samples(port: int) -> dict[tuple[str, tuple], float]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        body = r.read().decode()
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(body) for s in fam.samples}


def test_batch_worker_metrics_before_and_after_a_batch(tiny_dir, tmp_path):
    srv = RedisServer().start()
    w = WorkerProc(srv.url, PREFIX, model=tiny_dir, extra=["--served-name", MODEL])
    port = free_port()
    rq = None
    try:
        w.start()
        rq = RqWorker(srv.url, tmp_path / "b", {"PAGEDQ_BATCH_METRICS_PORT": str(port)}).start()
        s = until(lambda: _try(port), "the batch worker's /metrics", 30, 0.05)
        jobs = lambda fn, outcome: ("pagedq:batch_rq_jobs_total",  # noqa: E731
                                    (("function", fn), ("outcome", outcome)))
        for fn in ("ingest", "tick"):
            assert s[jobs(fn, "ok")] == s[jobs(fn, "failed")] == 0
        assert all(s["pagedq:batches", (("status", st),)] == 0 for st in BatchStatus)
        assert ("process_resident_memory_bytes", ()) in s
        with Batches(srv.url, prefix=PREFIX, model=MODEL,
                     settings=Settings(redis_url=srv.url, prefix=PREFIX, model=MODEL),
                     batch_settings=BatchSettings(batch_dir=str(tmp_path / "b"))) as bt:
            write_input(tmp_path / "in.jsonl", 4, bad=False, max_tokens=2)
            b = bt.create(tmp_path / "in.jsonl")
            assert bt.wait(b.id, timeout=60).status == "completed"
        s = samples(port)
        assert s["pagedq:batches", (("status", "completed"),)] == 1
        assert s["pagedq:batch_requests", (("state", "total"),)] == 0  # none running
        assert s[jobs("ingest", "ok")] >= 1 and s[jobs("tick", "ok")] >= 1
        assert s[jobs("ingest", "failed")] == s[jobs("tick", "failed")] == 0
        # each job counted and timed (a tick may end between the two: read again)
        until(lambda: (lambda s: s["pagedq:batch_rq_job_duration_seconds_count",
                                   (("function", "tick"),)] == s[jobs("tick", "ok")])(
            samples(port)), "every tick timed", 10, 0.05)
    finally:
        if rq:
            rq.stop()
        w.kill()
        w.stop()
        srv.cleanup()


def _try(port: int):
    try:
        return samples(port)
    except OSError:
        return None


def test_a_bad_metrics_port_is_one_line():
    r = subprocess.run([sys.executable, "-m", "pagedq", "batch", "worker", "--metrics-port",
                        "70000"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.strip().splitlines()[-1].endswith(
        "argument --metrics-port: '70000' is no port: use 0 (off) to 65535"), r.stderr
