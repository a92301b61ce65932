"""Tensor parallelism inside one model: which slice of each weight a rank holds, and the
collectives the parallel layers (engine/layers/linear.py) call.

Megatron-style partition of a Llama-family layer over ``size`` ranks:
  * attention: contiguous groups of KV heads per rank, each with the query heads that attend
    to them (GQA groups never straddle ranks). KV heads split as evenly as they go (rank r
    gets one more while r < nkv % size), so 3 KV heads over 2 ranks is 2 + 1 (SmolLM2:
    9 query heads -> 6 + 3). With fewer KV heads than ranks each KV head is replicated on
    size // nkv ranks, which then split its query heads evenly;
  * MLP: gate/up columns and down rows split as evenly as they go;
  * vocabulary (embedding rows, LM-head rows): ceil(vocab / size) rows per rank, the last
    rank's tail padded (embedding rows never looked up, logit columns >= vocab never read).
Every rank computes the full hidden state [T, H]: row-parallel outputs are all-reduced.

``TensorParallel(0, 1)`` (``SINGLE``) is one rank: every method is the identity and no
collective is ever called, so TP=1 runs exactly the single-device code.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def split(n: int, parts: int, i: int) -> tuple[int, int]:
    """(start, size) of part i when n items are split into ``parts`` contiguous parts as
    evenly as possible (the first n % parts parts get one more)."""
    base, extra = divmod(n, parts)
    return i * base + min(i, extra), base + (i < extra)


@dataclass(frozen=True, slots=True)
class HeadSlice:
    q_start: int  # first query head of this rank
    q_count: int
    kv_start: int  # first KV head of this rank
    kv_count: int


def check_heads(num_heads: int, num_kv_heads: int, size: int) -> None:
    """ValueError with what would fit when ``size`` ranks cannot share the heads."""
    if size == 1:
        return
    if num_kv_heads >= size:
        return  # contiguous KV-head groups, as even as they go
    if size % num_kv_heads or num_heads % size:
        fits = [t for t in range(2, num_heads + 1)
                if (num_kv_heads >= t) or (t % num_kv_heads == 0 and num_heads % t == 0)]
        raise ValueError(
            f"tensor_parallel_size {size} does not fit the model's {num_heads} attention heads "
            f"and {num_kv_heads} KV heads: with fewer KV heads than ranks, "
            f"tensor_parallel_size must be a multiple of the KV heads and divide the attention "
            f"heads (sizes that fit: {', '.join(map(str, fits)) or 'none'})")


def head_slice(num_heads: int, num_kv_heads: int, size: int, rank: int) -> HeadSlice:
    """The query and KV heads rank ``rank`` of ``size`` holds (check_heads first)."""
    group = num_heads // num_kv_heads  # query heads per KV head
    if num_kv_heads >= size:
        kv0, nkv = split(num_kv_heads, size, rank)
        return HeadSlice(kv0 * group, nkv * group, kv0, nkv)
    per = num_heads // size  # ranks per KV head = size // num_kv_heads, each gets `per` q heads
    q0 = rank * per
    return HeadSlice(q0, per, q0 // group, 1)


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """This process's place in the tensor-parallel group. ``group`` is the torch.distributed
    process group (None when size == 1)."""

    rank: int = 0
    size: int = 1
    group: Any = None

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of ``x`` over the ranks, in place (every rank gets it)."""
        if self.size > 1:
            torch.distributed.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor | None:
        """Rank 0: the ranks' ``x`` [N, C] side by side [N, size * C]; other ranks: None."""
        if self.size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)] if self.rank == 0 else None
        torch.distributed.gather(x, parts, dst=0, group=self.group)
        return torch.cat(parts, dim=-1) if parts is not None else None

    def broadcast(self, x: torch.Tensor) -> None:
        """Rank 0's ``x`` into every rank's ``x`` (in place; x contiguous)."""
        if self.size > 1:
            torch.distributed.broadcast(x, src=0, group=self.group)


SINGLE = TensorParallel()
