"""`pagedq batch worker` ends within a few seconds of SIGTERM in every state: idle, between
batches, in the middle of an ingest held back by backpressure, and between the ticks of a
running batch; each time after the process has run batches. A real redis-server, a real
pagedq worker serving the tiny model and real rq worker processes; nothing mocked.

About 30 s: every stop needs an rq worker that has run batches, and each rq worker start
imports rq and registers (a second or two on a busy machine)."""
from __future__ import annotations

import signal
import subprocess
import time

import pytest
import redis

from pagedq.batch import Batches, BatchSettings
from pagedq.wire.settings import Settings
from pagedq.worker.redis_server import RedisServer
from tests.test_batch_e2e import PREFIX, RqWorker, check_once, write_input
from tests.tiny_service import MODEL
from tests.waiting import until
from tests.worker_proc import WorkerProc

STOP_S = 5.0  # "within a few seconds": rq's pub/sub thread polls every second
# a queue cap the ingest meets at once (its chunks are 5 lines): with the pagedq worker
# frozen it waits on backpressure, inside its rq job, for as long as the window lasts
CAPPED = {"PAGEDQ_MAX_QUEUED_JOBS": "8", "PAGEDQ_BATCH_CHUNK_LINES": "5"}


@pytest.fixture
def stack(tiny_dir, tmp_path):
    srv = RedisServer().start()
    w = WorkerProc(srv.url, PREFIX, model=tiny_dir,
                   extra=["--served-name", MODEL, "--max-num-seqs", "16"],
                   env={"PAGEDQ_LEASE_S": "2", "PAGEDQ_HEARTBEAT_TTL_S": "3"})
    started: list[RqWorker] = []

    class Stack:
        url, dir, pagedq_worker = srv.url, tmp_path / "batches", w

        def rq(self, **env: str) -> RqWorker:
            started.append(RqWorker(self.url, self.dir, env).start())
            return started[-1]

        def batches(self) -> Batches:
            return Batches(self.url, prefix=PREFIX, model=MODEL,
                           settings=Settings(redis_url=self.url, prefix=PREFIX, model=MODEL),
                           batch_settings=BatchSettings(batch_dir=str(self.dir)))

    try:
        w.start()
        yield Stack()
    finally:
        w.signal(signal.SIGCONT)
        for rq in started:
            rq.stop()
        w.kill()
        w.stop()
        srv.cleanup()


def stop_within(rq: RqWorker, seconds: float = STOP_S) -> float:
    """SIGTERM ``rq``; asserts it exits 0 within ``seconds``, with its scheduler child.
    Sent once rq's handlers are in (registered is not enough: rq installs them after its
    birth and its scheduler's start; a SIGTERM before ends the process by the default
    action, at once, but not with 0)."""
    until(lambda: _catches_sigterm(rq.proc.pid), "rq's SIGTERM handler", 30, 0.02)
    kids = rq.children()
    t0 = time.monotonic()
    rq.proc.send_signal(signal.SIGTERM)
    try:
        code = rq.proc.wait(seconds)
    except subprocess.TimeoutExpired:
        raise AssertionError(f"still running {seconds} s after SIGTERM:\n{rq.log()}") from None
    took = time.monotonic() - t0
    assert code == 0, rq.log()
    for pid in kids:  # rq's scheduler process is gone too
        until(lambda pid=pid: not _alive(pid), f"scheduler child {pid} gone", seconds, 0.05)
    return took


def _catches_sigterm(pid: int) -> bool:
    with open(f"/proc/{pid}/status") as f:
        caught = next(line for line in f if line.startswith("SigCgt:")).split()[1]
    return bool(int(caught, 16) & (1 << (signal.SIGTERM - 1)))


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def rq_job(rq: RqWorker) -> str | None:
    """The id of the rq job ``rq`` is running now, as rq records it."""
    from rq import Worker

    with redis.Redis.from_url(rq.url) as conn:  # rq reads bytes
        w = Worker.find_by_key(Worker.redis_worker_namespace_prefix + rq.name, connection=conn)
        return w.get_current_job_id() if w else None


def run_batches(bt: Batches, tmp_path, n: int, tag: str) -> None:
    for k in range(n):
        src = tmp_path / f"{tag}-{k}.jsonl"
        valid, _ = write_input(src, 4, bad=False, max_tokens=2)
        b = bt.create(src)
        assert bt.wait(b.id, timeout=60).status == "completed"
        assert {r["custom_id"] for r in bt.results(b.id)} == valid


def test_sigterm_stops_the_batch_worker_in_every_state(stack, tmp_path):
    idle = stack.rq()
    stop_within(idle)  # idle, never ran a job

    with stack.batches() as bt:
        between = stack.rq()
        run_batches(bt, tmp_path, 3, "a")
        stop_within(between)  # between batches

        busy = stack.rq(**CAPPED)
        run_batches(bt, tmp_path, 2, "b")
        src = tmp_path / "big.jsonl"
        valid, _ = write_input(src, 100, bad=False, max_tokens=2)
        stack.pagedq_worker.signal(signal.SIGSTOP)  # nothing ends: the queue cap holds
        b = bt.create(src)
        until(lambda: int(bt.store.get(b.id).get("submitted") or 0) >= 5,
              "the ingest's first chunk in")
        until(lambda: (rq_job(busy) or "").startswith("pagedq-ingest"),
              "the rq worker inside the ingest")  # waiting on the cap
        stop_within(busy)  # during an rq job
        stack.pagedq_worker.signal(signal.SIGCONT)

        ticking = stack.rq(**CAPPED)  # takes the ingest over, from its cursor
        until(lambda: bt.retrieve(b.id).request_counts.completed >= 10, "10 lines done", 60)
        stack.pagedq_worker.signal(signal.SIGSTOP)  # the batch surely stays in progress
        assert bt.retrieve(b.id).status == "in_progress"
        stop_within(ticking)  # during a batch: its ticks, the ingest's slices
        stack.pagedq_worker.signal(signal.SIGCONT)

        stack.rq()
        end = bt.wait(b.id, timeout=90)
        assert end.status == "completed"
        check_once(list(bt.results(b.id)), list(bt.errors(b.id)), valid, set())
