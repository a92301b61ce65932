"""Paged KV-cache block manager with a prefix cache (vLLM v1 KVCacheManager-like; no torch).

Public API:
    BlockManager(num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_known_tokens: Callable[[Sequence], int] | None = None)
    .get_computed_blocks(seq) -> tuple[list[int], int]
    .allocate_slots(seq, num_new_tokens: int, computed_blocks: list[int] | None = None) -> bool
    .free(seq) -> None
    .check_integrity(seqs) -> None               # raises RuntimeError on any violation
    .reset_prefix_cache() -> None
    .num_free_blocks: int, .usage: float, .capacity_tokens: int, .free_block_ids() -> list[int]
    hash_block_tokens(parent_hash, tokens) -> int   # module function (tests may patch it)
    block_bytes(token_ids, i, block_size) -> bytes  # block i's ids as hashed and stored

Invariants (check_integrity verifies them):
  * A block is in the free queue iff its ref_cnt is 0; free + used == num_blocks.
  * ref_cnt == number of block tables holding the block (one table holds a block at most once).
  * Free queue is LRU: freed blocks go to the tail, allocation pops the head. A sequence's
    blocks are freed last-first, so its tail blocks are evicted before its prefix.
  * Prefix cache (lazy eviction): ``cached[h]`` is a FULL block whose K/V is computed, or is
    written in the step that registered it (see engine/batch.py). A freed cached block keeps
    its hash and can be hit until it is popped for a new allocation; then its hash is dropped.
  * A hit must match the block's stored tokens (as int64 bytes: compared and hashed without
    a Python int per token) AND parent hash, so a collision of
    ``hash_block_tokens`` can cost a hit but never serve wrong K/V. The hash itself is 128
    bits of SHA-256, so a collision of a parent hash (which token checks cannot see) is
    not constructible.
  * ``seq.block_hashes[i]`` is the chained hash of ``seq.token_ids[: (i+1)*block_size]`` (only
    full blocks; a memo of a pure function of the tokens, so it survives preemption).
  * Only tokens whose values the host knows are hashed: ``num_known_tokens(seq)`` (default
    all of them; the async pipeline, engine/pipeline.py, gives its own, which leaves out a
    token still on the device). A block completed by such a token is registered later, by
    ``cache_resolved_block``.
"""
from __future__ import annotations

import hashlib
from array import array
from collections.abc import Callable, Iterable

from pagedq.engine.kv_blocks import FreeBlockQueue, KVBlock
from pagedq.engine.sequence import Sequence

ROOT_HASH = 0  # parent hash of block 0


def hash_block_tokens(parent_hash: int, tokens: bytes) -> int:
    """Chained hash of one full block: 128 bits of sha256(parent_hash, tokens), ``tokens``
    its ids as ``block_bytes`` gives them."""
    data = parent_hash.to_bytes(16, "little") + tokens
    return int.from_bytes(hashlib.sha256(data).digest()[:16], "little")


def block_bytes(token_ids: array, i: int, block_size: int) -> bytes:
    """Block i of a sequence's ``token_ids`` (an array('q')) as int64 bytes: one slice and
    one copy in C (a tuple of the same ids made an int object per token: at 256 admissions
    of a 2,048-token shared prefix, most of the first schedule's ~0.2 s on a 2-core CPU)."""
    return token_ids[i * block_size:(i + 1) * block_size].tobytes()


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _all_tokens(seq: Sequence) -> int:
    return len(seq.token_ids)


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 num_known_tokens: Callable[[Sequence], int] | None = None):
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1 (got {num_blocks})")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1 (got {block_size})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.num_known_tokens = num_known_tokens or _all_tokens
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[int, KVBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref 0, including evictable cached ones."""
        return len(self.free_queue)

    @property
    def usage(self) -> float:
        return 1.0 - len(self.free_queue) / self.num_blocks

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def free_block_ids(self) -> list[int]:
        """Free queue, head (next evicted) first."""
        return [b.block_id for b in self.free_queue]

    def _block_hashes(self, seq: Sequence, num_full: int) -> list[int]:
        """seq.block_hashes, extended (memoized) to at least its first ``num_full`` blocks."""
        hashes, bs, toks = seq.block_hashes, self.block_size, seq.token_ids
        for i in range(len(hashes), num_full):
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash_block_tokens(parent, block_bytes(toks, i, bs)))
        return hashes

    def get_computed_blocks(self, seq: Sequence) -> tuple[list[int], int]:
        """Longest verified cached prefix of seq: (block ids, tokens covered).

        No side effects on the cache (it only memoizes seq.block_hashes). Capped at
        num_tokens - 1, rounded down to whole blocks: the last token is always computed so
        the request has logits to sample from.
        """
        if (not self.enable_prefix_caching or seq.num_computed_tokens or seq.block_table
                or seq.scores_prompt):  # prompt logprobs need every position's logits
            return [], 0
        bs = self.block_size
        num_full = (seq.num_tokens - 1) // bs
        hashes = self._block_hashes(seq, num_full)
        hit: list[int] = []
        parent, toks = ROOT_HASH, seq.token_ids
        for i in range(num_full):
            b = self.cached.get(hashes[i])
            if b is None or b.parent_hash != parent or b.token_ids != block_bytes(toks, i, bs):
                break
            hit.append(b.block_id)
            parent = hashes[i]
        return hit, len(hit) * bs

    def allocate_slots(self, seq: Sequence, num_new_tokens: int,
                       computed_blocks: list[int] | None = None) -> bool:
        """Grow seq.block_table to cover num_computed + num_new tokens (after taking hits).

        Returns False, changing nothing, when free blocks (evictable cached ones count) do not
        suffice. Registers every block that is full within the covered, known tokens.
        """
        bs = self.block_size
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0 (got {num_new_tokens})")
        if not computed_blocks:  # hot path (every running request, every step): no hits
            num_computed = seq.num_computed_tokens
            total = num_computed + num_new_tokens
            if total > len(seq.token_ids):
                raise ValueError(f"{seq.request_id}: {total} tokens asked, only "
                                 f"{len(seq.token_ids)} known")
            table = seq.block_table
            num_new_blocks = -(-total // bs) - len(table)
            if num_new_blocks > 0:
                if num_new_blocks > self.free_queue.size:
                    return False
                for _ in range(num_new_blocks):
                    b = self.free_queue.popleft()
                    self._evict(b)
                    b.ref_cnt = 1
                    table.append(b.block_id)
            # most steps fill no block: only one that does asks which tokens are known
            if self.enable_prefix_caching and total // bs > num_computed // bs:
                self._cache_full_blocks(seq, num_computed // bs, self._num_known(seq, total) // bs)
            return True
        computed = computed_blocks
        if computed and (seq.block_table or seq.num_computed_tokens):
            raise ValueError(f"{seq.request_id}: computed blocks given to a sequence with blocks")
        num_computed = len(computed) * bs if computed else seq.num_computed_tokens
        total = num_computed + num_new_tokens
        if total > seq.num_tokens:
            raise ValueError(f"{seq.request_id}: {total} tokens asked, only {seq.num_tokens} known")
        if computed:  # stale hits (evicted since get_computed_blocks) would serve wrong K/V
            hashes = self._block_hashes(seq, len(computed))
            for i, bid in enumerate(computed):
                if self.cached.get(hashes[i]) is not self.blocks[bid]:
                    raise ValueError(f"{seq.request_id}: computed block {bid} is no longer cached")
        num_new_blocks = max(0, _cdiv(total, bs) - len(seq.block_table) - len(computed))
        reusable = sum(1 for bid in computed if self.blocks[bid].ref_cnt == 0)
        if num_new_blocks > len(self.free_queue) - reusable:
            return False

        for bid in computed:
            b = self.blocks[bid]
            if b.ref_cnt == 0:
                self.free_queue.remove(b)
            b.ref_cnt += 1
            seq.block_table.append(bid)
        if computed:
            seq.num_computed_tokens = num_computed
            if seq.num_preemptions == 0:  # a resumed request re-hitting itself is not a "cache hit"
                seq.num_cached_tokens = min(num_computed, seq.num_prompt_tokens)
        for _ in range(num_new_blocks):
            b = self.free_queue.popleft()
            self._evict(b)
            b.ref_cnt = 1
            seq.block_table.append(b.block_id)
        if self.enable_prefix_caching:
            self._cache_full_blocks(seq, num_computed // bs, self._num_known(seq, total) // bs)
        return True

    def _num_known(self, seq: Sequence, total: int) -> int:
        """Of the first ``total`` tokens, how many the host knows (see num_known_tokens)."""
        return min(total, self.num_known_tokens(seq))

    def cache_resolved_block(self, seq: Sequence) -> None:
        """seq's last token was not known on the host when its slot was allocated and is
        known now: register the block it completes, if that block is full and computed (its K/V is
        written by the step in flight, which precedes any reader on the device stream)."""
        bs, n = self.block_size, len(seq.token_ids)
        if self.enable_prefix_caching and n % bs == 0 and seq.num_computed_tokens >= n \
                and len(seq.block_table) * bs >= n:
            self._cache_full_blocks(seq, n // bs - 1, n // bs)

    def _cache_full_blocks(self, seq: Sequence, start: int, num_full: int) -> None:
        """Register blocks [start, num_full) of seq; blocks before ``start`` were handled
        when they became full (or are hits)."""
        if num_full <= start:
            return
        hashes = self._block_hashes(seq, num_full)
        bs = self.block_size
        for i in range(start, num_full):
            b, h = self.blocks[seq.block_table[i]], hashes[i]
            if b.block_hash is not None or h in self.cached:
                continue  # already cached, or same content (or collision) cached elsewhere first
            b.block_hash, b.parent_hash = h, hashes[i - 1] if i else ROOT_HASH
            b.token_ids = block_bytes(seq.token_ids, i, bs)
            self.cached[h] = b

    def _evict(self, b: KVBlock) -> None:
        if b.block_hash is not None:
            if self.cached.get(b.block_hash) is b:
                del self.cached[b.block_hash]
            b.block_hash = b.parent_hash = b.token_ids = None

    def free(self, seq: Sequence) -> None:
        """Drop seq's refs, last block first; clears seq.block_table.

        Call before resetting seq.num_computed_tokens: a block registered for tokens this
        sequence never computed (scheduled, then preempted or aborted before the step ran)
        is uncached when its last ref goes, since its K/V was never written.
        """
        bs = self.block_size
        for i in range(len(seq.block_table) - 1, -1, -1):
            b = self.blocks[seq.block_table[i]]
            if b.ref_cnt <= 0:
                raise RuntimeError(f"{seq.request_id}: double free of block {b.block_id}")
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                if (i + 1) * bs > seq.num_computed_tokens:
                    self._evict(b)
                self.free_queue.append(b)
        seq.block_table = []

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their K/V; only future hits are lost)."""
        for b in self.blocks:
            self._evict(b)

    def check_integrity(self, seqs: Iterable[Sequence]) -> None:
        """``seqs`` must be every sequence holding blocks. Raises RuntimeError on a violation."""
        refs = [0] * self.num_blocks
        for s in seqs:
            if len(set(s.block_table)) != len(s.block_table):
                raise RuntimeError(f"{s.request_id}: block table repeats a block {s.block_table}")
            if len(s.block_table) * self.block_size < s.num_computed_tokens:
                raise RuntimeError(f"{s.request_id}: block table shorter than computed tokens")
            for bid in s.block_table:
                if not 0 <= bid < self.num_blocks:
                    raise RuntimeError(f"{s.request_id}: block id {bid} out of range")
                refs[bid] += 1
        free_ids = set()
        for b in self.free_queue:
            if b.ref_cnt != 0:
                raise RuntimeError(f"free block {b.block_id} has ref_cnt {b.ref_cnt}")
            if b.block_id in free_ids:
                raise RuntimeError(f"block {b.block_id} twice in the free queue")
            free_ids.add(b.block_id)
        if len(free_ids) != len(self.free_queue):
            raise RuntimeError(f"free queue size {len(self.free_queue)} != {len(free_ids)} linked")
        used = sum(1 for b in self.blocks if b.ref_cnt > 0)
        if len(free_ids) + used != self.num_blocks:
            raise RuntimeError(f"free {len(free_ids)} + used {used} != total {self.num_blocks}")
        for b in self.blocks:
            if b.ref_cnt != refs[b.block_id]:
                raise RuntimeError(f"block {b.block_id}: ref_cnt {b.ref_cnt} but held by "
                                   f"{refs[b.block_id]} block tables")
            if b.block_hash is not None and self.cached.get(b.block_hash) is not b:
                raise RuntimeError(f"block {b.block_id} has a hash but is not the cached entry")
        for h, b in self.cached.items():
            if b.block_hash != h:
                raise RuntimeError(f"cache entry points at block {b.block_id} with another hash")
