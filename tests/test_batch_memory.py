"""Redis memory follows a batch's work (issue 43): after a batch is cancelled, or after it
completes, Redis's key count and used_memory return to where they were before it, within
the configured TTLs (run short here). A real redis-server, a real pagedq worker on the
tiny model, a real `pagedq batch worker`; every wait polls with a deadline."""
from __future__ import annotations

import pytest

from pagedq.batch import Batches, BatchSettings
from pagedq.wire.settings import Settings
from pagedq.worker.redis_server import RedisServer
from tests.test_batch_e2e import PREFIX, RqWorker, write_input
from tests.tiny_service import MODEL
from tests.waiting import until
from tests.worker_proc import WorkerProc

TTL_S = 2  # PAGEDQ_CANCELLED_TTL_S and PAGEDQ_BATCH_COLLECTED_TTL_S here
SHORT = {"PAGEDQ_CANCELLED_TTL_S": str(TTL_S), "PAGEDQ_BATCH_COLLECTED_TTL_S": str(TTL_S)}
# what a batch leaves on purpose: its record, its id in the batches index, rq's ingest job
# results (an hour) and registries; a few hundred jobs left behind would be far above this
KEY_SLACK = 12
# bytes: Redis keeps ~0.15-0.6 MB after a burst of keys whatever its size (its tables
# are not shrunk at once, client buffers): 3,000 cancelled jobs left 0.15 MB, 300 as many
MEMORY_SLACK = 1024 * 1024
LINES = 600  # their records and queue entries alone are well above the slack


@pytest.fixture(scope="module")
def service(tiny_dir, tmp_path_factory):
    srv = RedisServer().start()
    batch_dir = tmp_path_factory.mktemp("batches")
    w = WorkerProc(srv.url, PREFIX, model=tiny_dir,
                   extra=["--served-name", MODEL, "--max-num-seqs", "8"],
                   env={"PAGEDQ_FAILPOINTS": "step_sleep_s=0.02", **SHORT})
    rq = None
    try:
        w.start()
        rq = RqWorker(srv.url, batch_dir, SHORT).start()
        yield srv, batch_dir
    finally:
        if rq:
            rq.stop()
        w.stop(10)
        srv.cleanup()


def footprint(r) -> tuple[int, int]:
    return r.dbsize(), r.info("memory")["used_memory"]


def batches(url: str, batch_dir) -> Batches:
    return Batches(url, prefix=PREFIX, model=MODEL,
                   settings=Settings(redis_url=url, prefix=PREFIX, model=MODEL,
                                     cancelled_ttl_s=TTL_S),
                   batch_settings=BatchSettings(batch_dir=str(batch_dir),
                                                batch_collected_ttl_s=TTL_S))


def back_to(r, base: tuple[int, int], bid: str, what: str) -> tuple[int, int]:
    """Waits until no key of the batch's jobs is left and the footprint is within the
    slack of ``base``; returns the footprint then."""
    def settled():
        left = [k for k in r.scan_iter(f"*{bid}.*", count=1000)]
        keys, mem = footprint(r)
        return (keys, mem) if (not left and keys <= base[0] + KEY_SLACK
                               and mem <= base[1] + MEMORY_SLACK) else None
    try:
        return until(settled, what, timeout=TTL_S + 30, every=0.2)
    except AssertionError:
        left = sorted(r.scan_iter(f"*{bid}.*", count=1000))[:5]
        sizes = sorted(((r.memory_usage(k, samples=0) or 0, k)
                        for k in r.scan_iter(count=1000)), reverse=True)[:5]
        raise AssertionError(f"{what}: base {base}, now {footprint(r)}, left {left}, "
                             f"largest keys {sizes}") from None


def test_cancelled_batch_leaves_only_its_record(service, tmp_path):
    srv, batch_dir = service
    with batches(srv.url, batch_dir) as bt:
        r = bt.client.redis
        base = footprint(r)
        src = tmp_path / "in.jsonl"
        write_input(src, LINES, bad=False, max_tokens=16)
        b = bt.create(src)
        until(lambda: bt.retrieve(b.id).submitted == LINES, "every line submitted")
        peak = footprint(r)
        assert peak[1] - base[1] > MEMORY_SLACK  # the batch's work shows above the slack
        bt.cancel(b.id)
        end = bt.wait(b.id, timeout=120)
        assert end.status == "cancelled" and end.request_counts.total == LINES
        # queued jobs never started: no out stream was ever made for them, and the
        # collected ones' streams are gone by the end
        assert not list(r.scan_iter(f"*:out:{b.id}.*", count=1000))
        after = back_to(r, base, b.id, "Redis back to its footprint after the cancel")
        print(f"cancel: base {base}, peak {peak}, after {after}")


def test_completed_batch_releases_its_jobs(service, tmp_path):
    srv, batch_dir = service
    with batches(srv.url, batch_dir) as bt:
        r = bt.client.redis
        base = footprint(r)
        src = tmp_path / "in.jsonl"
        write_input(src, 200, bad=False, max_tokens=2)
        b = bt.create(src)
        end = bt.wait(b.id, timeout=240)
        assert end.status == "completed" and end.request_counts.completed == 200
        assert len(list(bt.results(b.id))) == 200
        after = back_to(r, base, b.id, "Redis back to its footprint after the completion")
        print(f"complete: base {base}, after {after}")
