"""Stateful property test: BlockManager against a plain-dict/list reference model.

The model keys its prefix cache by the full token prefix (no hashing), keeps the free queue
as a plain list and tracks what K/V each block holds (``kv``: the token prefix ending at the
block, once a step has written it). It predicts exact block ids, ref counts, free-queue order,
hits and allocation success. Steps follow the scheduler's contract: every allocation of a
step is followed by one ``step`` (the forward pass); a sequence scheduled in a step may only
be freed before that step runs if nobody hit a prefix in it (the scheduler preempts before
it admits).
"""
from __future__ import annotations

import itertools

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from pagedq.engine.block_manager import BlockManager
from pagedq.engine.sampling_params import SamplingParams
from pagedq.engine.sequence import Sequence

_ids = itertools.count()
tokens_st = st.lists(st.integers(0, 1), min_size=1, max_size=10)  # small alphabet: shared prefixes


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


# rule guards: each rule is enabled only when it has a candidate sequence
def admissible(m, s):
    return not s.block_table and id(s) not in m.pending


def extendable(m, s):
    return bool(s.block_table) and id(s) not in m.pending and s.num_computed_tokens < s.num_tokens


def appendable(m, s):
    return bool(s.block_table) and id(s) not in m.pending and s.num_computed_tokens == s.num_tokens


def freeable(m, s):  # the scheduler preempts a scheduled seq only before it admits anyone
    return bool(s.block_table) and (id(s) not in m.pending or not m.hit_this_step)


def has(pred):
    return precondition(lambda m: any(pred(m, s) for s in m.seqs))


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(2, 8), bs=st.sampled_from([1, 2, 3, 4]),
                prefix=st.booleans())
    def setup(self, num_blocks, bs, prefix):
        self.bm = BlockManager(num_blocks, bs, prefix)
        self.bs, self.prefix = bs, prefix
        self.seqs: list[Sequence] = []
        self.pending: dict[int, int] = {}  # id(seq) -> tokens scheduled in the current step
        self.hit_this_step = False
        # reference model
        self.free = list(range(num_blocks))
        self.refs = [0] * num_blocks
        self.tables: dict[int, list[int]] = {}
        self.cache: dict[tuple[int, ...], int] = {}  # full prefix -> block
        self.key: dict[int, tuple[int, ...]] = {}  # block -> its cache key
        self.kv: dict[int, tuple[int, ...] | None] = {}  # written content
        self.future: dict[int, tuple[int, ...]] = {}  # content written by the pending step

    # ---- model ----------------------------------------------------------------------
    def prefix_of(self, seq, j):
        return tuple(seq.token_ids[:(j + 1) * self.bs])

    def model_hits(self, seq):
        hits = []
        if self.prefix:
            for j in range((seq.num_tokens - 1) // self.bs):
                b = self.cache.get(self.prefix_of(seq, j))
                if b is None:
                    break
                hits.append(b)
        return hits

    def model_alloc(self, seq, computed, n) -> bool:
        table = self.tables.setdefault(id(seq), [])
        c = len(computed) * self.bs if computed else seq.num_computed_tokens
        total = c + n
        need = max(0, cdiv(total, self.bs) - len(table) - len(computed))
        if need > len(self.free) - sum(1 for b in computed if self.refs[b] == 0):
            return False
        for b in computed:
            if self.refs[b] == 0:
                self.free.remove(b)
            self.refs[b] += 1
            table.append(b)
        for _ in range(need):
            b = self.free.pop(0)
            if b in self.key:
                del self.cache[self.key.pop(b)]
            self.refs[b], self.kv[b] = 1, None
            table.append(b)
        for j in range(c // self.bs, total // self.bs):
            k, b = self.prefix_of(seq, j), table[j]
            self.future[b] = k
            if self.prefix and b not in self.key and k not in self.cache:
                self.cache[k], self.key[b] = b, k
        return True

    def model_free(self, seq):
        table = self.tables.pop(id(seq))
        for j in range(len(table) - 1, -1, -1):
            b = table[j]
            self.refs[b] -= 1
            if self.refs[b] == 0:
                if (j + 1) * self.bs > seq.num_computed_tokens and b in self.key:
                    del self.cache[self.key.pop(b)]
                self.free.append(b)
        if self.pending.pop(id(seq), None) is not None:  # its step never runs
            for b in table[seq.num_computed_tokens // self.bs:]:
                self.future.pop(b, None)

    # ---- rules ----------------------------------------------------------------------
    def pick(self, data, pred):
        return data.draw(st.sampled_from([s for s in self.seqs if pred(self, s)]))

    @precondition(lambda self: len(self.seqs) < 6)
    @rule(tokens=tokens_st)
    def new_seq(self, tokens):
        self.seqs.append(Sequence(f"p{next(_ids)}", tokens, SamplingParams()))

    @has(admissible)
    @rule(data=st.data())
    def admit(self, data):
        seq = self.pick(data, admissible)
        computed, hit = self.bm.get_computed_blocks(seq)
        assert computed == self.model_hits(seq) and hit == len(computed) * self.bs
        assert hit < seq.num_tokens
        for j, b in enumerate(computed):  # a hit must hold exactly this prefix's K/V
            want = self.prefix_of(seq, j)
            assert self.kv.get(b) == want or self.future.get(b) == want
        n = data.draw(st.integers(1, seq.num_tokens - hit))
        self.allocate(seq, n, computed)
        self.hit_this_step |= bool(computed)

    @has(extendable)
    @rule(data=st.data())
    def extend(self, data):
        seq = self.pick(data, extendable)
        self.allocate(seq, data.draw(st.integers(1, seq.num_tokens - seq.num_computed_tokens)))

    def allocate(self, seq, n, computed=None):
        before = (list(seq.block_table), seq.num_computed_tokens)
        ok = self.bm.allocate_slots(seq, n, computed)
        assert ok == self.model_alloc(seq, computed or [], n)
        if ok:
            self.pending[id(seq)] = n
        else:
            assert (seq.block_table, seq.num_computed_tokens) == before

    @precondition(lambda self: self.pending)
    @rule()
    def step(self):
        for seq in self.seqs:
            n = self.pending.pop(id(seq), None)
            if n is None:
                continue
            c, bs = seq.num_computed_tokens, self.bs
            for j in range(c // bs, (c + n) // bs):
                b = seq.block_table[j]
                assert self.future.pop(b) == self.prefix_of(seq, j)
                self.kv[b] = self.prefix_of(seq, j)
            seq.num_computed_tokens = c + n
        self.future.clear()
        self.hit_this_step = False

    @has(appendable)
    @rule(data=st.data(), tok=st.integers(0, 1))
    def append(self, data, tok):
        self.pick(data, appendable).append_token(tok)

    @has(freeable)
    @rule(data=st.data(), finish=st.booleans())
    def free_or_preempt(self, data, finish):
        seq = self.pick(data, freeable)
        self.bm.free(seq)
        self.model_free(seq)
        seq.num_computed_tokens = 0  # preempted: re-admission re-hits its own prefix
        if finish:
            self.seqs.remove(seq)

    # ---- invariants -----------------------------------------------------------------
    @invariant()
    def matches_model(self):
        bm = self.bm
        bm.check_integrity(self.seqs)
        assert bm.free_block_ids() == self.free and bm.num_free_blocks == len(self.free)
        assert [b.ref_cnt for b in bm.blocks] == self.refs
        for s in self.seqs:
            assert s.block_table == self.tables.get(id(s), [])
        assert {b.block_id for b in bm.cached.values()} == set(self.cache.values())

    @invariant()
    def shared_blocks_are_cached_identical_prefixes(self):
        where: dict[int, tuple[Sequence, int]] = {}
        for s in self.seqs:
            for j, b in enumerate(s.block_table):
                if b in where:
                    other, oj = where[b]
                    assert oj == j and self.prefix_of(other, j) == self.prefix_of(s, j)
                    assert len(s.token_ids) >= (j + 1) * self.bs  # a full block
                    assert self.bm.blocks[b].block_hash is not None
                where[b] = (s, j)


BlockManagerMachine.TestCase.settings = settings(
    max_examples=100, stateful_step_count=50, deadline=None)
TestBlockManagerMachine = BlockManagerMachine.TestCase
