"""Lanes through a real worker process (tiny random Llama) on a real redis-server: a higher
lane goes ahead of a lower one across the queue (and may preempt it), a lower lane is not
starved, and the counters, caps and DLQ are kept per lane."""
from __future__ import annotations

import time

import pytest

from pagedq.wire.errors import InvalidRequest, Overloaded
from pagedq.wire.invariants import queue_counters
from pagedq.wire.keys import GROUP
from pagedq.worker.lanes import engine_priority, floor_seats, rooms
from tests.tiny_service import MODEL


def started_order(c, ids: list[str]) -> list[str]:
    recs = {j: c.result(j, timeout=120) for j in ids}
    assert all(r.status == "finished" for r in recs.values()), recs
    return sorted(ids, key=lambda j: recs[j].started_at)


def test_room_arithmetic():
    assert floor_seats(64, 0.1) == 7 and floor_seats(2, 0.1) == 1 and floor_seats(8, 0) == 0
    # idle: every lane may fill every seat (the worker reads lane by lane, highest first)
    assert rooms(4, [0, 0], 1, kv_room=True) == [4, 4]
    # batch holds every seat: interactive may take all but batch's floor, batch nothing more
    assert rooms(64, [0, 64], 7, kv_room=True) == [57, 0]
    assert rooms(64, [57, 7], 7, kv_room=True) == [0, 0]
    # interactive holds every seat: batch still gets its floor (it takes the next free seat)
    assert rooms(64, [64, 0], 7, kv_room=True) == [0, 7]
    # no KV room: only what can be taken from lower lanes above their floors
    assert rooms(8, [2, 6], 1, kv_room=False) == [5, 0]
    assert rooms(8, [8], 0, kv_room=True) == [0] and rooms(8, [3], 0, kv_room=True) == [5]
    # three lanes: each may take what the lanes below it hold above their floors
    assert rooms(10, [2, 2, 6], 1, kv_room=True) == [6, 5, 0]
    assert rooms(10, [0, 0, 10], 1, kv_room=True) == [9, 9, 0]
    assert engine_priority(0, 2, -1000) > engine_priority(1, 2, 1000)


def test_an_interactive_job_goes_ahead_of_a_queued_batch(svc):
    """The issue's case: six bulk jobs, then one urgent one, on --max-num-seqs 2."""
    svc.worker(extra=["--max-num-seqs", "2"], env={"PAGEDQ_FAILPOINTS": "step_sleep_s=0.01"})
    c = svc.client()
    bulk = [c.submit(f"bulk {i}", max_tokens=60, ignore_eos=True, lane="batch")
            for i in range(6)]
    deadline = time.monotonic() + 60
    while sum(c.status(j).status == "running" for j in bulk) < 2:  # both seats are bulk's
        assert time.monotonic() < deadline
        time.sleep(0.02)
    urgent = c.submit("urgent", max_tokens=4, ignore_eos=True)
    order = started_order(c, bulk + [urgent])
    assert order.index(urgent) <= 2, order  # at most the two bulk jobs running when it came
    ended = {j: c.status(j).finished_at for j in bulk + [urgent]}
    assert sum(ended[j] < ended[urgent] for j in bulk) <= 2, ended
    # token counts, not text: 4 random tokens of the tiny byte-level model may decode to
    # nothing printable (an unfinished UTF-8 sequence)
    assert c.result(urgent).usage.completion_tokens == 4
    assert all(c.result(j).usage.completion_tokens == 60 for j in bulk)
    for lane in ("interactive", "batch"):
        assert queue_counters(c.redis, c.keys, MODEL, lane).ok


def test_a_higher_lane_preempts_a_running_lower_one_for_its_seat(svc):
    # one seat for batch (floor 1 of 2), the other taken from batch by interactive jobs
    svc.worker(extra=["--max-num-seqs", "2"], env={"PAGEDQ_FAILPOINTS": "step_sleep_s=0.01"})
    c = svc.client()
    bulk = [c.submit(f"bulk {i}", max_tokens=200, ignore_eos=True, lane="batch")
            for i in range(2)]
    deadline = time.monotonic() + 60
    while not all(c.status(j).status == "running" for j in bulk):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    urgent = c.submit("urgent", max_tokens=3, ignore_eos=True)
    rec = c.result(urgent, timeout=120)
    assert rec.status == "finished"
    assert all(c.status(j).status == "running" for j in bulk)  # it did not wait for them
    for j in bulk:  # the preempted one was recomputed: still every token once
        r = c.result(j, timeout=120)
        assert r.status == "finished" and r.usage.completion_tokens == 200


def test_a_lower_lane_keeps_its_floor_under_a_flood(svc):
    """Interactive jobs keep every seat busy; the batch job still starts within about one
    interactive job's run, not after the flood."""
    svc.worker(extra=["--max-num-seqs", "2"],
               env={"PAGEDQ_FAILPOINTS": "step_sleep_s=0.01", "PAGEDQ_LANE_MIN_SHARE": "0.5"})
    c = svc.client()
    flood = [c.submit(f"chat {i}", max_tokens=20, ignore_eos=True) for i in range(12)]
    bulk = c.submit("bulk", max_tokens=5, ignore_eos=True, lane="batch")
    order = started_order(c, flood + [bulk])
    assert order.index(bulk) <= 3, order


def test_lanes_have_their_own_counters_caps_and_dlq(svc):
    c = svc.client(max_queued_jobs=2)
    # no worker yet: everything stays queued
    a = [c.submit("a", max_tokens=2) for _ in range(2)]
    with pytest.raises(Overloaded):
        c.submit("a", max_tokens=2)
    b = [c.submit("b", max_tokens=2, lane="batch") for _ in range(2)]  # its own cap
    assert queue_counters(c.redis, c.keys, MODEL, "interactive").queued_jobs == 2
    assert queue_counters(c.redis, c.keys, MODEL, "batch").queued_jobs == 2
    with pytest.raises(InvalidRequest, match="lane 'bulk' is not one of"):
        c.submit("x", lane="bulk")
    c.redis.xadd(c.keys.jobs(MODEL, "batch"),
                 {"job": "wrong-lane", "body": '{"prompt": "x", "lane": "interactive", '
                                               f'"model": "{MODEL}"}}'})
    svc.worker()
    for j in a + b:
        assert c.result(j, timeout=120).status == "finished"
    rec = c.result("wrong-lane", timeout=120)
    assert rec.status == "failed" and "lane" in rec.error
    (_, entry), = c.redis.xrange(c.keys.dlq(MODEL, "batch"))
    assert entry["job"] == "wrong-lane" and not c.redis.exists(c.keys.dlq(MODEL))
    for lane in ("interactive", "batch"):
        snap = queue_counters(c.redis, c.keys, MODEL, lane)
        assert snap.ok and snap.queued_jobs == 0, (lane, snap)
        assert c.redis.xpending(c.keys.jobs(MODEL, lane), GROUP)["pending"] == 0


def test_a_dead_workers_batch_jobs_are_taken_over(svc):
    a = svc.worker(env={"PAGEDQ_FAILPOINTS": "step_sleep_s=0.05"})
    c = svc.client()
    jobs = [c.submit(f"j{i}", max_tokens=30, ignore_eos=True, lane=lane)
            for i, lane in enumerate(["batch", "interactive", "batch"])]
    deadline = time.monotonic() + 60
    while not all(c.status(j).status == "running" for j in jobs):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    a.kill()
    svc.worker()
    for j in jobs:
        rec = c.result(j, timeout=120)
        assert rec.status == "finished" and rec.attempt == 2 and rec.usage.completion_tokens == 30


def test_worker_lane_flags_and_the_submit_cli_lane_and_priority(svc, monkeypatch, capsys):
    """--lanes, --lane-min-share and --scheduling-policy on a real worker; pagedq submit
    --lane/--priority through the CLI onto a lane only this deployment has."""
    from pagedq.cli import main

    w = svc.worker(extra=["--lanes", "urgent,interactive,batch", "--lane-min-share", "0.5",
                          "--scheduling-policy", "fcfs"])
    c = svc.client(lanes=("urgent", "interactive", "batch"))
    monkeypatch.setenv("PAGEDQ_LANES", "urgent,interactive,batch")
    args = ["--redis-url", svc.server.url, "--prefix", c.keys.prefix, "submit", "hi",
            "--model", MODEL, "--max-tokens", "3", "--lane", "urgent", "--priority", "5",
            "--wait", "--timeout", "120"]
    assert main(args) == 0, capsys.readouterr()
    job_id = capsys.readouterr().err.strip().splitlines()[-1]
    rec = c.status(job_id)
    assert rec.status == "finished" and rec.usage.completion_tokens == 3
    assert c.redis.hget(c.keys.job(job_id), "lane") == "urgent"
    assert c.keys.jobs(MODEL, "urgent") in w.log(None)  # the worker reads the lane it was given
    assert main([*args[:4], "submit", "x", "--lane", "nope"]) == 2  # one line, not a trace
    assert "lane 'nope' is not one of" in capsys.readouterr().err
    monkeypatch.delenv("PAGEDQ_LANES")
    assert main([*args[:4], "submit", "x", "--lane", "urgent"]) == 2  # not in the defaults
