"""Paged attention over the KV cache, and the per-step metadata every layer shares.

Layouts (kernels/__init__.py): k_cache/v_cache [num_blocks, block_size, Hkv, D] (an fp8
v_cache is a transposed view: kernels/layout.py);
slot_mapping [T] int64 (-1 = skip); block_tables [B, max_blocks] int32 (-1 padded);
seq_lens [B] int32 (context incl. this step); cu_seqlens_q [B+1] int32.
Invariant (engine/batch.py): a layer writes the K/V of ALL tokens of the step before any
attention of that layer reads the cache (sequences may read blocks filled this step).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from pagedq.engine.layers import ops


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    is_decode_only: bool  # every sequence has exactly one query token
    positions: torch.Tensor  # [T] int64, token index of each query token in its sequence
    # decode-only: the rows in the decode kernel's launch order (ops.decode_order), set once
    # per step by the model runner; None: row order. Never changes a result.
    decode_order: torch.Tensor | None = None
    # set only while engine/piecewise.py captures the model: called as split(attention, q)
    # in place of the attention itself, it returns the buffer the attention output will be
    # in when the captured pieces replay
    split: Callable[[Attention, torch.Tensor], torch.Tensor] | None = None


class Attention(nn.Module):
    """q [T, Hq, D], k/v [T, Hkv, D] (as the qkv projection made them) -> [T, Hq, D].
    k_cache/v_cache are views of the runner's KV cache, assigned after allocation (empty
    tensors until then)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.scale = head_dim, scale
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor, cos_sin_cache: torch.Tensor, meta: AttentionMetadata,
                q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                eps: float = 0.0) -> torch.Tensor:
        """Per-head q/k RMSNorm by q_weight/k_weight (None: none), rotary, the step's K/V
        stored (one kernel on GPU: ops.qk_norm_rope_store), then attention of the rotated q
        over the cache. The store covers ALL tokens of the step before any attention reads,
        so sequences may read blocks filled this step."""
        q, _ = ops.qk_norm_rope_store(q, k, v, positions, cos_sin_cache, self.k_cache,
                                      self.v_cache, meta.slot_mapping, q_weight, k_weight, eps)
        if meta.split is not None:
            return meta.split(self, q)
        return self.attend(q, meta)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of the rotated q [T, Hq, D] over the cache (this step's K/V stored)."""
        if meta.is_decode_only:
            return ops.paged_decode_attention(q, self.k_cache, self.v_cache, meta.block_tables,
                                              meta.seq_lens, self.scale, meta.decode_order)
        return ops.paged_attention(q, self.k_cache, self.v_cache, meta.block_tables,
                                   meta.seq_lens, meta.cu_seqlens_q, self.scale)
