"""Scheduler tests: a model-free step loop with exact block ids, budgets and preemption order."""
from __future__ import annotations

import itertools

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagedq.engine.batch import ScheduledBatch
from pagedq.engine.config import EngineConfig
from pagedq.engine.sampling_params import SamplingParams
from pagedq.engine.scheduler import MAX_HELD_STEPS, Scheduler
from pagedq.engine.sequence import SeqStatus, Sequence

_ids = itertools.count()


def make(num_blocks=16, bs=4, budget=64, max_seqs=8, chunked=True, prefix=True,
         policy="priority", wait=None):
    # set after construction: these tiny blocks and budgets keep the arithmetic small,
    # below what an engine allows (construction validates; the scheduler takes any config)
    cfg = EngineConfig()
    for name, value in dict(block_size=bs, max_num_seqs=max_seqs, max_num_batched_tokens=budget,
                            num_kv_blocks=num_blocks, enable_chunked_prefill=chunked,
                            enable_prefix_caching=prefix, scheduling_policy=policy,
                            prefill_wait_steps=wait).items():
        setattr(cfg, name, value)
    sched = Scheduler(cfg, num_blocks)
    return sched, sched.bm


def req(sched: Scheduler, tokens, max_tokens=4, priority=0) -> Sequence:
    seq = Sequence(f"q{next(_ids)}", list(tokens), SamplingParams(max_tokens=max_tokens),
                   priority)
    sched.add(seq)
    return seq


def run_step(sched: Scheduler) -> ScheduledBatch:
    """schedule -> (model) -> update -> append a fake token to samplers -> finish at max_tokens."""
    cfg = sched.config
    batch = sched.schedule()
    assert batch.total_tokens <= cfg.max_num_batched_tokens
    assert len(batch.seqs) <= cfg.max_num_seqs and sched.num_running <= cfg.max_num_seqs
    assert all(n > 0 for n in batch.num_new_tokens)
    for s, n in zip(batch.seqs, batch.num_new_tokens, strict=True):
        assert len(s.block_table) * cfg.block_size >= s.num_computed_tokens + n
    expected = [s for i, s in enumerate(batch.seqs) if batch.samples(i)]
    sampling = sched.update_after_step(batch)
    assert sampling == expected
    for s in sampling:
        s.append_token(1000 + s.num_output_tokens)
        if s.num_output_tokens >= s.params.max_tokens:
            sched.finish(s, "length")
    sched.bm.check_integrity(sched.running + sched.waiting)
    return batch


def scheduled(batch: ScheduledBatch) -> list[tuple[Sequence, int]]:
    return list(zip(batch.seqs, batch.num_new_tokens, strict=True))


def test_chunked_prefill_splits_a_long_prompt():
    sched, bm = make(budget=8)
    s = req(sched, range(20), max_tokens=2)
    assert scheduled(run_step(sched)) == [(s, 8)] and s.block_table == [0, 1]
    assert scheduled(run_step(sched)) == [(s, 8)] and s.block_table == [0, 1, 2, 3]
    assert scheduled(run_step(sched)) == [(s, 4)] and s.num_tokens == 21
    assert scheduled(run_step(sched)) == [(s, 1)]
    assert s.status is SeqStatus.FINISHED and s.finish_reason == "length"
    assert not sched.has_unfinished() and bm.num_free_blocks == 16
    assert bm.free_block_ids()[-6:] == [5, 4, 3, 2, 1, 0]


def test_budget_and_max_num_seqs_are_respected():
    sched, bm = make(budget=6, max_seqs=2)
    a, b, c = (req(sched, range(i * 10, i * 10 + 4), max_tokens=2) for i in range(3))
    assert scheduled(run_step(sched)) == [(a, 4), (b, 2)]
    assert sched.num_running == 2 and sched.num_waiting == 1
    assert scheduled(run_step(sched)) == [(a, 1), (b, 2)]  # no seat for c
    assert scheduled(run_step(sched)) == [(b, 1), (c, 4)]  # a finished last step
    assert scheduled(run_step(sched)) == [(c, 1)]


def test_same_prefix_twice_in_one_step_hits_blocks_registered_by_the_first():
    sched, bm = make()
    a = req(sched, list(range(8)) + [100])
    b = req(sched, list(range(8)) + [200])
    batch = run_step(sched)
    assert scheduled(batch) == [(a, 9), (b, 1)]
    assert a.block_table == [0, 1, 2] and b.block_table == [0, 1, 3]
    assert b.num_cached_tokens == 8 and a.num_cached_tokens == 0
    assert [blk.ref_cnt for blk in bm.blocks[:4]] == [2, 2, 1, 1]
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (18, 8)


def test_fully_cached_prompt_recomputes_the_last_block():
    sched, bm = make(num_blocks=8, bs=16)
    a = req(sched, range(32), max_tokens=1)
    run_step(sched)
    assert a.is_finished and bm.free_block_ids() == [2, 3, 4, 5, 6, 7, 1, 0]
    b = req(sched, range(32))
    assert scheduled(run_step(sched)) == [(b, 16)]  # hit capped at 31 tokens -> 1 block
    assert b.block_table == [0, 2] and b.num_cached_tokens == 16


def test_chunked_prefill_with_a_prefix_hit():
    sched, bm = make(budget=8)
    a = req(sched, range(16), max_tokens=1)
    run_step(sched), run_step(sched)
    assert a.is_finished
    b = req(sched, list(range(16)) + list(range(50, 60)))
    assert scheduled(run_step(sched)) == [(b, 8)]
    assert b.num_cached_tokens == 16 and b.block_table[:4] == [0, 1, 2, 3]
    assert scheduled(run_step(sched)) == [(b, 2)] and b.num_tokens == 27


def test_block_filling_during_decode_is_registered():
    sched, bm = make()
    s = req(sched, [1, 2, 3], max_tokens=8)
    run_step(sched)
    assert s.num_tokens == 4 and not bm.cached
    run_step(sched)  # computes token 4: block 0 full
    assert bm.cached[s.block_hashes[0]] is bm.blocks[0]
    for _ in range(3):
        run_step(sched)
        assert s.block_table == [0, 1] and len(bm.cached) == 1
    run_step(sched)  # computes token 8
    assert bm.cached[s.block_hashes[1]] is bm.blocks[1]


def test_preempted_request_rehits_its_own_prefix():
    sched, bm = make(num_blocks=5)
    a = req(sched, range(8), max_tokens=3)
    b = req(sched, range(100, 108), max_tokens=3)
    run_step(sched)
    assert a.block_table == [0, 1] and b.block_table == [2, 3]
    batch = run_step(sched)  # a takes block 4; b finds none and is its own victim
    assert scheduled(batch) == [(a, 1)] and batch.preempted == [b]
    assert b.status is SeqStatus.PREEMPTED and b.num_computed_tokens == 0 and b.block_table == []
    assert b.num_preemptions == 1 and sched.num_preemptions_total == 1
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (16, 0)
    assert sched.waiting == [b] and bm.free_block_ids() == [3, 2]
    assert scheduled(run_step(sched)) == [(a, 1)]  # a finishes; b still does not fit
    assert bm.free_block_ids() == [3, 2, 4, 1, 0]
    assert scheduled(run_step(sched)) == [(b, 1)]  # 8 of its 9 tokens re-hit
    assert b.block_table == [2, 3, 4] and b.num_cached_tokens == 0
    # its own blocks re-hit on resuming: no query, no hit of the prefix cache
    assert (sched.prefix_cache_queries, sched.prefix_cache_hits) == (16, 0)


def test_victim_is_lowest_priority_then_latest_arrival():
    sched, bm = make(num_blocks=4)
    a = req(sched, range(4), priority=0)
    b = req(sched, range(10, 14), priority=1)
    c = req(sched, range(20, 24), priority=0)
    assert scheduled(run_step(sched)) == [(b, 4)]  # b's prefill holds lower prefills back
    assert scheduled(run_step(sched)) == [(b, 1), (a, 4), (c, 4)]
    assert (b.block_table, a.block_table, c.block_table) == ([0, 1], [2], [3])
    assert sched.running == [b, a, c]  # running order is queue order too
    batch = run_step(sched)
    assert batch.preempted == [c] and scheduled(batch) == [(b, 1), (a, 1)]
    assert a.block_table == [2, 3]
    batch = run_step(sched)  # a, b both fit (7, 8 tokens in 2 blocks)
    assert batch.preempted == [] and scheduled(batch) == [(b, 1), (a, 1)]


def test_a_prefill_holds_lower_priority_prefills_back_a_few_steps_at_most():
    sched, bm = make(num_blocks=64, budget=64, max_seqs=16)
    sched.step_token_budget = 4
    low = req(sched, range(8), max_tokens=20)
    assert scheduled(run_step(sched)) == [(low, 4)]  # half its prompt
    sched.step_token_budget = 64
    steps = []
    for i in range(6):  # a new higher-priority prompt every step
        high = req(sched, range(100 + 10 * i, 104 + 10 * i), max_tokens=20, priority=1)
        steps.append(scheduled(run_step(sched)))
        assert (high, 4) in steps[-1]
    low_prefill = [i for i, st in enumerate(steps) if (low, 4) in st]
    assert low_prefill == [MAX_HELD_STEPS]  # held back that many steps, then it runs
    assert all((low, 1) in st for st in steps[MAX_HELD_STEPS + 1:])  # and then decodes
    fcfs, _ = make(num_blocks=64, budget=8, max_seqs=8, policy="fcfs")
    x, y = req(fcfs, range(4)), req(fcfs, range(10, 14), priority=1)
    assert scheduled(run_step(fcfs)) == [(x, 4), (y, 4)]  # fcfs holds nothing back


def test_preempting_an_already_scheduled_request_refunds_and_uncaches():
    sched, bm = make(num_blocks=3, budget=7)
    a = req(sched, range(8), priority=0)
    assert scheduled(run_step(sched)) == [(a, 7)] and a.block_table == [0, 1]
    b = req(sched, range(10, 17), priority=1)  # needs 2 blocks, 1 free
    batch = run_step(sched)  # a is scheduled its 8th token (fills block 1), then displaced
    assert batch.preempted == [a] and scheduled(batch) == [(b, 7)]  # a's token refunded
    assert a.num_computed_tokens == 0 and b.block_table == [2, 1]
    assert len(a.block_hashes) == 2 and a.block_hashes[0] in bm.cached  # written in step 1
    assert a.block_hashes[1] not in bm.cached  # never written
    assert bm.free_block_ids() == [0]


def test_budget_of_a_preempted_scheduled_victim_goes_to_later_requests():
    sched, bm = make(num_blocks=4, budget=6)
    v = req(sched, range(4), max_tokens=8, priority=0)
    run_step(sched)
    x = req(sched, range(10, 14), max_tokens=8, priority=1)
    y = req(sched, range(20, 28), max_tokens=8, priority=1)
    assert scheduled(run_step(sched)) == [(v, 1), (x, 4), (y, 1)]
    assert (v.block_table, x.block_table, y.block_table) == ([0, 1], [2], [3])
    batch = run_step(sched)  # v scheduled (1 token), x finds no block -> v preempted
    assert batch.preempted == [v]
    assert scheduled(batch) == [(x, 1), (y, 5)]  # y gets v's refunded token
    assert (x.block_table, y.block_table) == ([2, 1], [3, 0])


def test_no_admission_in_a_preempting_step():
    sched, bm = make(num_blocks=5)
    a = req(sched, range(8), max_tokens=5)
    b = req(sched, range(100, 108), max_tokens=5)
    run_step(sched)
    d = req(sched, [7, 7], priority=5)  # would fit in the blocks b frees
    batch = run_step(sched)
    assert batch.preempted == [b] and scheduled(batch) == [(a, 1)]
    assert sched.waiting == [d, b] and bm.num_free_blocks == 2
    assert scheduled(run_step(sched)) == [(a, 1), (d, 2)]


def test_abort_of_a_request_sharing_blocks():
    sched, bm = make(num_blocks=8)
    a = req(sched, list(range(8)) + [1])
    b = req(sched, list(range(8)) + [2])
    run_step(sched)
    assert [blk.ref_cnt for blk in bm.blocks[:4]] == [2, 2, 1, 1]
    assert sched.abort(b.request_id) is b
    assert b.status is SeqStatus.FINISHED and b.finish_reason == "abort" and b.block_table == []
    assert [blk.ref_cnt for blk in bm.blocks[:4]] == [1, 1, 1, 0]
    assert bm.free_block_ids() == [4, 5, 6, 7, 3] and sched.running == [a]
    assert sched.abort(b.request_id) is None and sched.abort("nope") is None
    sched.finish(b, "stop")  # idempotent on finished requests
    assert b.finish_reason == "abort"
    w = req(sched, range(50, 70))
    assert sched.abort(w.request_id) is w and sched.waiting == []
    bm.check_integrity(sched.running)


def test_without_chunked_prefill_a_prompt_waits_for_budget():
    sched, bm = make(budget=8, chunked=False)
    a = req(sched, range(4))
    b = req(sched, range(10, 16))
    assert scheduled(run_step(sched)) == [(a, 4)]
    assert scheduled(run_step(sched)) == [(a, 1), (b, 6)]


def test_waiting_order_is_priority_then_arrival():
    sched, bm = make(max_seqs=1)
    low = req(sched, [1, 2], max_tokens=1)
    high = req(sched, [3, 4], max_tokens=1, priority=2)
    assert scheduled(run_step(sched)) == [(high, 2)]
    assert scheduled(run_step(sched)) == [(low, 2)]


def test_fcfs_policy_ignores_priority():
    sched, bm = make(max_seqs=1, policy="fcfs")
    low = req(sched, [1, 2], max_tokens=2)
    assert scheduled(run_step(sched)) == [(low, 2)]
    high = req(sched, [3, 4], max_tokens=1, priority=2)
    assert scheduled(run_step(sched)) == [(low, 1)]  # no seat: high waits, low runs on
    assert scheduled(run_step(sched)) == [(high, 2)]


def test_higher_priority_takes_a_seat_from_a_running_lower_one():
    sched, bm = make(max_seqs=2)
    low1 = req(sched, [1, 2], max_tokens=8)
    low2 = req(sched, [3, 4], max_tokens=8)
    run_step(sched)
    high = req(sched, [5, 6], max_tokens=2, priority=3)
    peer = req(sched, [7, 8], max_tokens=2)  # same priority as the running ones: waits
    batch = run_step(sched)
    assert batch.preempted == [low2] and low2.status is SeqStatus.PREEMPTED
    assert scheduled(batch) == [(low1, 1), (high, 2)]  # low2's decode token refunded
    assert sched.waiting == [low2, peer]  # the victim goes back ahead of later arrivals
    run_step(sched)
    assert high.is_finished and scheduled(run_step(sched))[1] == (low2, 3)  # recomputed


def test_higher_priority_takes_kv_blocks_from_a_running_lower_one():
    sched, bm = make(num_blocks=4, max_seqs=4)
    low = req(sched, range(12), max_tokens=8)  # 3 of the 4 blocks, one more to decode
    run_step(sched)
    high = req(sched, range(100, 108), max_tokens=1, priority=1)  # needs 2 blocks, 1 free
    batch = run_step(sched)
    assert batch.preempted == [low] and scheduled(batch) == [(high, 8)]
    equal = req(sched, range(200, 208), max_tokens=1, priority=1)  # equal: never displaces
    assert sched.waiting == [equal, low] or sched.waiting == [low, equal]


def test_add_rejects_prompts_that_can_never_fit():
    sched, bm = make(num_blocks=2, bs=4)
    with pytest.raises(ValueError, match="cannot fit in the KV cache"):
        req(sched, range(8))
    s = req(sched, range(7))
    with pytest.raises(ValueError, match="already scheduled"):
        sched.add(s)
    assert bm.block_size == sched.config.block_size  # built from the config: one source


def test_request_outgrowing_the_whole_cache_finishes_with_length():
    sched, bm = make(num_blocks=2, bs=4)
    s = req(sched, range(7), max_tokens=10)
    run_step(sched), run_step(sched)
    assert s.num_tokens == 9 and not s.is_finished
    batch = run_step(sched)
    assert batch.is_empty and sched.finished_in_schedule == [s]
    assert s.finish_reason == "length" and bm.num_free_blocks == 2 and not sched.has_unfinished()
    w = req(sched, range(7))
    w.token_ids.extend([1, 1])  # e.g. grew, then preempted: waiting, longer than the cache
    batch = run_step(sched)
    assert batch.is_empty and sched.finished_in_schedule == [w] and not sched.has_unfinished()


def test_can_admit():
    sched, bm = make(num_blocks=4, max_seqs=2)
    assert sched.can_admit()
    req(sched, range(8))
    assert sched.can_admit()  # 3 blocks needed by the waiting one, 4 free
    req(sched, range(4))
    assert not sched.can_admit()  # no seat


def decoding(sched: Scheduler, tokens=range(4), max_tokens=50) -> Sequence:
    """A request already past its prefill: the next steps only decode."""
    seq = req(sched, tokens, max_tokens=max_tokens)
    run_step(sched)
    assert seq.num_computed_tokens == seq.num_prompt_tokens
    return seq


def admitted(batch: ScheduledBatch, *seqs: Sequence) -> bool:
    return all(s in batch.seqs for s in seqs)


def test_arrivals_wait_while_the_batch_decodes_then_join_together():
    sched, _ = make(wait=3)
    a = decoding(sched)
    b = req(sched, range(10, 16))
    assert scheduled(run_step(sched)) == [(a, 1)]  # b held once
    c = req(sched, range(20, 26))
    assert scheduled(run_step(sched)) == [(a, 1)]  # b twice, c once
    assert scheduled(run_step(sched)) == [(a, 1)]  # b three times
    batch = run_step(sched)  # b goes in, and c with it
    assert scheduled(batch) == [(a, 1), (b, 6), (c, 6)]


def test_arrivals_are_not_held_by_default_or_with_zero():
    for wait in (None, 0):
        sched, _ = make(wait=wait)
        a = decoding(sched)
        b = req(sched, range(10, 16))
        assert scheduled(run_step(sched)) == [(a, 1), (b, 6)]


def test_a_step_that_prefills_anyway_admits_at_once():
    sched, _ = make(wait=5, budget=10)
    a = req(sched, range(4), max_tokens=50)
    long = req(sched, range(100, 112))
    run_step(sched)  # a's 4 and 6 of long's 12: long's prefill goes on in the next step
    assert long.num_computed_tokens == 6
    b = req(sched, range(10, 13))
    assert scheduled(run_step(sched)) == [(a, 1), (long, 6), (b, 3)]


def test_arrivals_that_fill_every_free_seat_go_in_at_once():
    sched, _ = make(wait=10, max_seqs=3)
    a = decoding(sched)
    b, c = req(sched, range(10, 14)), req(sched, range(20, 24))  # 2 waiting, 2 free seats
    assert admitted(run_step(sched), a, b, c)


def test_an_arrival_that_outranks_a_running_request_is_not_held():
    sched, _ = make(wait=10)
    a = decoding(sched)
    low = req(sched, range(10, 14), priority=0)
    assert scheduled(run_step(sched)) == [(a, 1)]
    high = req(sched, range(20, 24), priority=5)  # goes to the head of the queue
    batch = run_step(sched)
    assert admitted(batch, a, high) and low not in batch.seqs


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=st.lists(st.tuples(st.integers(1, 3), st.integers(1, 14), st.integers(1, 6),
                               st.integers(0, 2), st.integers(0, 12)), min_size=1, max_size=8),
       num_blocks=st.integers(5, 12), budget=st.integers(4, 16), chunked=st.booleans(),
       policy=st.sampled_from(["fcfs", "priority"]), wait=st.sampled_from([None, 0, 1, 4]))
def test_random_workloads_all_finish(reqs, num_blocks, budget, chunked, policy, wait):
    """Requests arriving at random steps all finish, whatever prefill_wait_steps."""
    if not chunked:  # like EngineConfig.validate: the budget must hold the longest request
        budget = num_blocks * 4
    sched, bm = make(num_blocks=num_blocks, budget=budget, max_seqs=4, chunked=chunked,
                     policy=policy, wait=wait)
    arrivals = sorted((at, k) for k, (*_, at) in enumerate(reqs))
    seqs = []
    for step in range(500):
        while arrivals and arrivals[0][0] <= step:
            p, n, m, pr, _ = reqs[arrivals.pop(0)[1]]
            if 4 + n + 1 <= bm.capacity_tokens:
                seqs.append(req(sched, [p] * 4 + list(range(n)), max_tokens=m, priority=pr))
        if not sched.has_unfinished() and not arrivals:
            break
        run_step(sched)
    assert not sched.has_unfinished()
    for s in seqs:
        assert s.is_finished and s.block_table == []
        assert s.finish_reason == "length"
        assert s.num_output_tokens == s.params.max_tokens or s.num_tokens > bm.capacity_tokens
    assert bm.num_free_blocks == num_blocks
