"""BlockManager unit tests: exact block ids, ref counts and free-queue order."""
from __future__ import annotations

import itertools
from array import array

import pytest

import pagedq.engine.block_manager as bm_mod
from pagedq.engine.block_manager import ROOT_HASH, BlockManager
from pagedq.engine.sampling_params import SamplingParams
from pagedq.engine.sequence import Sequence

_ids = itertools.count()


def mkseq(tokens, priority: int = 0) -> Sequence:
    return Sequence(f"r{next(_ids)}", list(tokens), SamplingParams(max_tokens=8), priority)


def step(bm: BlockManager, seq: Sequence, n: int, computed=None) -> None:
    """allocate_slots + the model step that writes the K/V (advances computed)."""
    assert bm.allocate_slots(seq, n, computed)  # hits set num_computed to the hit tokens
    seq.num_computed_tokens += n


def refs(bm: BlockManager) -> list[int]:
    return [b.ref_cnt for b in bm.blocks]


def test_allocate_and_free_exact_order():
    bm = BlockManager(8, 4)
    s = mkseq(range(10))
    step(bm, s, 10)
    assert s.block_table == [0, 1, 2]
    assert refs(bm) == [1, 1, 1, 0, 0, 0, 0, 0]
    assert bm.free_block_ids() == [3, 4, 5, 6, 7]
    assert len(s.block_hashes) == 2  # blocks 0, 1 are full; block 2 holds 2 tokens
    assert bm.blocks[0].block_hash == s.block_hashes[0] and bm.blocks[0].parent_hash == ROOT_HASH
    assert bm.blocks[1].parent_hash == s.block_hashes[0]
    assert bm.blocks[2].block_hash is None
    assert bm.num_free_blocks == 5 and bm.usage == pytest.approx(3 / 8)
    bm.check_integrity([s])
    bm.free(s)
    assert s.block_table == [] and refs(bm) == [0] * 8
    assert bm.free_block_ids() == [3, 4, 5, 6, 7, 2, 1, 0]  # tail blocks evicted first
    assert set(bm.cached) == set(s.block_hashes)  # lazy: still cached after free
    bm.check_integrity([])


def test_failed_allocation_has_no_side_effects():
    bm = BlockManager(4, 4)
    a, b = mkseq(range(12)), mkseq(range(100, 108))
    step(bm, a, 12)
    before = (bm.free_block_ids(), refs(bm), dict(bm.cached))
    assert not bm.allocate_slots(b, 8)
    assert (bm.free_block_ids(), refs(bm), dict(bm.cached)) == before
    assert b.block_table == [] and b.block_hashes == [] and b.num_computed_tokens == 0
    assert bm.allocate_slots(b, 4)  # one block fits
    assert b.block_table == [3]
    bm.check_integrity([a, b])


def test_prefix_hit_counts_evictable_blocks_as_free():
    bm = BlockManager(4, 4)
    a = mkseq(range(1, 10))
    step(bm, a, 9)
    bm.free(a)
    assert bm.free_block_ids() == [3, 2, 1, 0]
    b = mkseq(list(range(1, 9)) + [50, 51, 52, 53, 54])  # 13 tokens, shares 2 blocks
    computed, hit = bm.get_computed_blocks(b)
    assert (computed, hit) == ([0, 1], 8)
    assert bm.free_block_ids() == [3, 2, 1, 0]  # get_computed_blocks has no side effects
    step(bm, b, 5, computed)  # 4 blocks needed, 2 hit (free) + 2 new: exactly fits
    assert b.block_table == [0, 1, 3, 2] and b.num_computed_tokens == 13
    assert b.num_cached_tokens == 8 and bm.free_block_ids() == []
    assert refs(bm) == [1, 1, 1, 1]
    c = mkseq(range(13))
    assert not bm.allocate_slots(c, 1)
    bm.check_integrity([b])


def test_fully_cached_prompt_hit_is_capped():
    bm = BlockManager(4, 16)
    a = mkseq(range(32))
    step(bm, a, 32)
    assert a.block_table == [0, 1] and len(bm.cached) == 2
    b = mkseq(range(32))
    computed, hit = bm.get_computed_blocks(b)
    assert (computed, hit) == ([0], 16)  # 31 tokens at most -> 1 whole block
    step(bm, b, 16, computed)
    assert b.block_table == [0, 2] and refs(bm) == [2, 1, 1, 0]
    assert bm.blocks[2].block_hash is None  # same content as block 1: first copy stays cached
    assert bm.cached[a.block_hashes[1]] is bm.blocks[1]
    assert b.block_hashes == a.block_hashes
    bm.check_integrity([a, b])
    # 33 tokens: both full blocks can be hit
    c = mkseq(list(range(32)) + [7])
    assert bm.get_computed_blocks(c) == ([0, 1], 32)


def test_hash_collision_never_gives_a_wrong_hit(monkeypatch):
    monkeypatch.setattr(bm_mod, "hash_block_tokens", lambda parent, toks: 7)
    bm = BlockManager(8, 4)
    a = mkseq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    step(bm, a, 9)
    assert len(bm.cached) == 1 and bm.cached[7] is bm.blocks[0]  # second block collided
    assert bm.get_computed_blocks(mkseq([9, 9, 9, 9, 0]))[0] == []  # tokens differ
    assert bm.get_computed_blocks(mkseq([1, 2, 3, 4, 5, 6, 7, 8, 0]))[0] == [0]
    bm.free(a)
    bm.check_integrity([])


def test_parent_hash_is_verified(monkeypatch):
    # a hash that ignores the parent: block [5..8] of a hashes like a first block [5..8]
    monkeypatch.setattr(bm_mod, "hash_block_tokens", lambda parent, toks: hash(toks))
    bm = BlockManager(8, 4)
    a = mkseq([1, 2, 3, 4, 5, 6, 7, 8, 9])
    step(bm, a, 9)
    b = mkseq([5, 6, 7, 8, 0])
    assert bm.cached[hash(array("q", (5, 6, 7, 8)).tobytes())] is bm.blocks[1]
    assert bm.get_computed_blocks(b) == ([], 0)


def test_lazy_eviction():
    bm = BlockManager(4, 4)
    a = mkseq(range(1, 10))
    step(bm, a, 9)
    bm.free(a)
    b = mkseq(list(range(1, 9)) + [100])
    computed, _ = bm.get_computed_blocks(b)
    step(bm, b, 1, computed)  # reuses freed cached blocks 0, 1; pops 3
    assert b.block_table == [0, 1, 3] and bm.free_block_ids() == [2]
    bm.free(b)
    assert bm.free_block_ids() == [2, 3, 1, 0]
    c = mkseq(range(50, 62))  # 3 new blocks: pops 2, 3, 1 -> block 1 evicted
    step(bm, c, 12)
    assert c.block_table == [2, 3, 1] and bm.free_block_ids() == [0]
    assert bm.blocks[0].block_hash == a.block_hashes[0]
    assert bm.cached[c.block_hashes[2]] is bm.blocks[1]  # block 1 now caches c's content
    assert a.block_hashes[1] not in bm.cached
    d = mkseq(list(range(1, 9)) + [7])
    assert bm.get_computed_blocks(d) == ([0], 4)
    bm.check_integrity([c])


def test_block_registered_when_it_fills_during_decode():
    bm = BlockManager(4, 4)
    s = mkseq([1, 2, 3])
    step(bm, s, 3)
    assert s.block_table == [0] and s.block_hashes == [] and not bm.cached
    s.append_token(4)
    step(bm, s, 1)  # block 0 becomes full now
    assert len(s.block_hashes) == 1 and bm.cached[s.block_hashes[0]] is bm.blocks[0]
    for tok in (5, 6, 7):
        s.append_token(tok)
        step(bm, s, 1)
        assert s.block_table == [0, 1] and len(bm.cached) == 1
    s.append_token(8)
    step(bm, s, 1)
    assert len(s.block_hashes) == 2 and bm.cached[s.block_hashes[1]] is bm.blocks[1]
    assert bm.blocks[1].parent_hash == s.block_hashes[0]
    assert bm.blocks[1].token_ids == array("q", (5, 6, 7, 8)).tobytes()
    bm.check_integrity([s])


def test_free_of_shared_blocks_drops_one_ref():
    bm = BlockManager(6, 4)
    a = mkseq(range(9))
    step(bm, a, 9)
    b = mkseq(list(range(8)) + [42, 43])
    computed, _ = bm.get_computed_blocks(b)
    step(bm, b, 2, computed)
    assert b.block_table == [0, 1, 3] and refs(bm) == [2, 2, 1, 1, 0, 0]
    bm.free(b)
    assert refs(bm) == [1, 1, 1, 0, 0, 0] and bm.free_block_ids() == [4, 5, 3]
    assert len(bm.cached) == 2
    bm.check_integrity([a])


def test_free_before_the_step_ran_uncaches_unwritten_blocks():
    bm = BlockManager(4, 4)
    a = mkseq(range(9))
    assert bm.allocate_slots(a, 9) and len(bm.cached) == 2
    bm.free(a)  # e.g. preempted in the step that scheduled it: K/V never written
    assert not bm.cached and bm.free_block_ids() == [3, 2, 1, 0]
    assert bm.get_computed_blocks(mkseq(range(9))) == ([], 0)


def test_stale_computed_blocks_are_rejected():
    bm = BlockManager(2, 4)
    a = mkseq(range(5))
    step(bm, a, 5)
    bm.free(a)
    b = mkseq(range(5))
    computed, _ = bm.get_computed_blocks(b)
    assert computed == [0]
    c = mkseq(range(100, 108))
    step(bm, c, 8)  # evicts block 0
    bm.free(c)
    with pytest.raises(ValueError, match="no longer cached"):
        bm.allocate_slots(b, 1, computed)


def test_preempted_sequence_does_not_count_as_cache_hit():
    bm = BlockManager(4, 4)
    s = mkseq(range(9))
    step(bm, s, 9)
    bm.free(s)
    s.num_computed_tokens, s.num_preemptions = 0, 1
    computed, hit = bm.get_computed_blocks(s)
    step(bm, s, 1, computed)
    assert computed == [0, 1] and s.block_table == [0, 1, 3] and s.num_cached_tokens == 0


def test_prefix_caching_disabled():
    bm = BlockManager(4, 4, enable_prefix_caching=False)
    a = mkseq(range(9))
    step(bm, a, 9)
    assert not bm.cached and a.block_hashes == []
    assert bm.get_computed_blocks(mkseq(range(9))) == ([], 0)


def test_reset_prefix_cache():
    bm = BlockManager(4, 4)
    a = mkseq(range(9))
    step(bm, a, 9)
    bm.reset_prefix_cache()
    assert not bm.cached and all(b.block_hash is None for b in bm.blocks)
    assert bm.get_computed_blocks(mkseq(range(9))) == ([], 0)
    bm.check_integrity([a])


def test_check_integrity_reports_corruption():
    bm = BlockManager(4, 4)
    a = mkseq(range(5))
    step(bm, a, 5)
    with pytest.raises(RuntimeError, match="ref_cnt 1 but held by 0"):
        bm.check_integrity([])
    bm.blocks[3].ref_cnt = 1
    with pytest.raises(RuntimeError, match="free block 3 has ref_cnt 1"):
        bm.check_integrity([a])
    bm.blocks[3].ref_cnt = 0
    bm.free_queue.size += 1
    with pytest.raises(RuntimeError, match="free queue size"):
        bm.check_integrity([a])
    bm.free_queue.size -= 1
    bm.free(a)
    a.block_table = [0]
    with pytest.raises(RuntimeError, match="double free"):
        bm.free(a)


def test_input_validation():
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 16)
    with pytest.raises(ValueError, match="block_size"):
        BlockManager(4, 0)
    bm = BlockManager(4, 4)
    s = mkseq(range(3))
    with pytest.raises(ValueError, match="only 3 known"):
        bm.allocate_slots(s, 4)
    with pytest.raises(ValueError, match=">= 0"):
        bm.allocate_slots(s, -1)
