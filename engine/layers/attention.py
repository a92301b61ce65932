"""Paged attention over the KV cache, and the per-step metadata every layer shares.

Layouts (kernels/__init__.py): k_cache/v_cache [num_blocks, block_size, Hkv, D] (an 8-bit
v_cache is a transposed view: kernels/layout.py; its scales: engine/kv_cache.py);
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

from pagedq.engine import kv_scales
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
    k_cache/v_cache are views of the runner's KV cache, and kv_quant its scales for the
    ops, assigned after allocation (engine/kv_cache.py; empty tensors until then).
    fit_scales: an fp8 e4m3 cache's scales are fitted to the next step that prefills
    (engine/kv_scales.py), run eagerly."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_dim, self.scale = head_dim, scale
        self.k_cache = self.v_cache = torch.tensor([])
        self.kv_quant: dict = {}
        self.fit_scales = False

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                positions: torch.Tensor, cos_sin_cache: torch.Tensor, meta: AttentionMetadata,
                q_weight: torch.Tensor | None = None, k_weight: torch.Tensor | None = None,
                eps: float = 0.0) -> torch.Tensor:
        """Per-head q/k RMSNorm by q_weight/k_weight (None: none), rotary, the step's K/V
        stored (one kernel on GPU: ops.qk_norm_rope_store), then attention of the rotated q
        over the cache. The store covers ALL tokens of the step before any attention reads,
        so sequences may read blocks filled this step."""
        # (never while engine/piecewise.py captures, split set; decode graphs never prefill)
        if self.fit_scales and meta.split is None and not meta.is_decode_only:
            return self.attend(self._fit_and_store(q, k, v, positions, cos_sin_cache, meta,
                                                   q_weight, k_weight, eps), meta)
        q, _ = ops.qk_norm_rope_store(q, k, v, positions, cos_sin_cache, self.k_cache,
                                      self.v_cache, meta.slot_mapping, q_weight, k_weight, eps,
                                      **self.kv_quant)
        if meta.split is not None:
            return meta.split(self, q)
        return self.attend(q, meta)

    def _fit_and_store(self, q, k, v, positions, cos_sin_cache, meta, q_weight, k_weight,
                       eps) -> torch.Tensor:
        """forward's norm, rotary and store, with the scales fitted to the rows stored
        (engine/kv_scales.py) in between; returns the rotated q."""
        unstored = torch.full_like(meta.slot_mapping, -1)
        q, k = ops.qk_norm_rope_store(q, k, v, positions, cos_sin_cache, self.k_cache,
                                      self.v_cache, unstored, q_weight, k_weight, eps)
        stored = meta.slot_mapping >= 0
        kv_scales.fit_(self.kv_quant["k_scale"], k[stored])
        kv_scales.fit_(self.kv_quant["v_scale"], v[stored])
        ops.store_kvcache(k, v, self.k_cache, self.v_cache, meta.slot_mapping, **self.kv_quant)
        self.fit_scales = False
        return q

    def attend(self, q: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention of the rotated q [T, Hq, D] over the cache (this step's K/V stored)."""
        if meta.is_decode_only:
            return ops.paged_decode_attention(q, self.k_cache, self.v_cache, meta.block_tables,
                                              meta.seq_lens, self.scale, meta.decode_order,
                                              **self.kv_quant)
        return ops.paged_attention(q, self.k_cache, self.v_cache, meta.block_tables,
                                   meta.seq_lens, meta.cu_seqlens_q, self.scale,
                                   **self.kv_quant)
