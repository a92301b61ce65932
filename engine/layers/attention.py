"""Paged attention over the KV cache, and the per-step metadata every layer shares.

Layouts (kernels/__init__.py): k_cache/v_cache [num_blocks, block_size, Hkv, D] (an fp8
v_cache is a transposed view: kernels/layout.py);
slot_mapping [T] int64 (-1 = skip); block_tables [B, max_blocks] int32 (-1 padded);
seq_lens [B] int32 (context incl. this step); cu_seqlens_q [B+1] int32.
Invariant (engine/batch.py): a layer writes the K/V of ALL tokens of the step before any
attention of that layer reads the cache (sequences may read blocks filled this step).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from engine.layers import ops


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    cu_seqlens_q: torch.Tensor
    max_seqlen_q: int
    is_decode_only: bool  # every sequence has exactly one query token
    positions: torch.Tensor  # [T] int64, token index of each query token in its sequence


class Attention(nn.Module):
    """q [T, Hq, D], k/v [T, Hkv, D] -> [T, Hq, D]. k_cache/v_cache are views of the
    runner's KV cache, assigned after allocation (empty tensors until then)."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.scale = head_dim, scale
        self.k_cache = self.v_cache = torch.tensor([])

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                meta: AttentionMetadata) -> torch.Tensor:
        """Store this step's k/v, then attend (q, k already rotated)."""
        ops.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping)
        return self.attend(q, meta)

    def norm_rope_store(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                        positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                        meta: AttentionMetadata, q_weight: torch.Tensor | None = None,
                        k_weight: torch.Tensor | None = None,
                        eps: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
        """forward's store with what precedes it fused in (one kernel on GPU): per-head q/k
        RMSNorm by q_weight/k_weight (None: none), rotary, then the step's K/V stored.
        Returns the rotated (q, k), possibly q and k themselves (rotated in place); follow
        with attend(q, meta)."""
        return ops.qk_norm_rope_store(q, k, v, positions, cos_sin_cache, self.k_cache,
                                      self.v_cache, meta.slot_mapping, q_weight, k_weight, eps)

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of q over the cache: the K/V of ALL tokens of the step must be stored
        already (forward or norm_rope_store), sequences may read blocks filled this step."""
        if meta.is_decode_only:
            return ops.paged_decode_attention(q, self.k_cache, self.v_cache, meta.block_tables,
                                              meta.seq_lens, self.scale)
        return ops.paged_attention(q, self.k_cache, self.v_cache, meta.block_tables,
                                   meta.seq_lens, meta.cu_seqlens_q, self.scale)
