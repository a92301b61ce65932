"""worker/intake.py, in process: a busy worker admits a burst in reads of BUSY_ADMIT_MAX on
its reader thread, and no lower lane is read while a higher one may hold more."""
from __future__ import annotations

from pagedq.producer import Client, JobRequest
from pagedq.wire.settings import Settings
from pagedq.worker.intake import BUSY_ADMIT_MAX
from pagedq.worker.service import Worker


def test_a_busy_worker_admits_a_burst_in_bounded_polls_higher_lane_first(redis_server,
                                                                           tiny_dir):
    from pagedq.engine.llm_engine import LLMEngine
    engine = LLMEngine(tiny_dir, device="cpu", dtype="float32", max_num_seqs=256,
                       num_kv_blocks=4096, block_size=8)
    s = Settings(redis_url=redis_server.url, prefix="t", model="m")
    w = Worker(engine, s, worker_id="w")
    try:
        w.faults.start_check()  # the groups, and the function library (Redis >= 7)
        top, low = w.ident.lanes
        n_top = 2 * BUSY_ADMIT_MAX + 5
        with Client(settings=s) as c:
            c.submit_many([JobRequest(prompt=[1, 2, 3], max_tokens=4, lane=lane, model="m")
                           for lane in [top] * n_top + [low] * 3])
        engine.add_request("running", [1, 2, 3])  # busy: polls do not block
        admitted = []  # (top lane, lower lane) jobs admitted after each read
        for _ in range(4):
            before = len(w.jobs)
            w.intake.poll(False)  # busy: starts a read and returns before it ends
            assert len(w.jobs) == before  # nothing read on the engine thread
            w.intake.settle()  # waits for it, admits its entries
            lanes = [j.lane for j in w.jobs.values()]
            admitted.append((lanes.count(top), lanes.count(low)))
        # the top lane BUSY_ADMIT_MAX at a time; the lower lane only once the top ran short
        assert admitted == [(BUSY_ADMIT_MAX, 0), (2 * BUSY_ADMIT_MAX, 0), (n_top, 0),
                            (n_top, 3)]
        # each read (MOVE from the inbox and XREADGROUP, in one round trip) and its
        # STARTs in one more; the engine thread made none
        assert w.intake.read_round_trips == 2 * 4 and w.intake.round_trips == 0
    finally:
        w.intake.close()
        w.r.close()
