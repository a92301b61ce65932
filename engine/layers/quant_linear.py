"""Layers whose weight stays quantized (kernels/quant_layout.py): a linear layer and an
embedding / LM head. One rank only (no tensor parallelism).

QuantLinear stands in for a ColumnParallelLinear (a merged projection: its checkpoint
tensors side by side along N, as ColumnParallelLinear stacks their rows) or a
RowParallelLinear; y = x W (+ b) through ops.quant_matmul. Its buffers are allocated for
one QuantFormat; ``load_shard("weight", QuantTensor, k)`` fills shard k's columns, every
shard in that format and, for act-order, with the same row order (one perm per layer:
x is gathered once). QuantEmbedding holds the embedding table E [V, H] as W = E^T [H, V]:
a lookup dequantizes the columns of the ids, the logits are x W.

Buffers keep their dtypes: the layers are built on the meta device after the model's
cast to its dtype (engine/quant/model.py).
"""
from __future__ import annotations

import torch
from torch import nn

from pagedq.engine.layers import ops
from pagedq.engine.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    ShapeError,
    VocabParallelEmbedding,
)
from pagedq.engine.quant.spec import QuantFormat
from pagedq.engine.quant.tensor import QuantTensor
from pagedq.kernels import quant_layout

_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


class _Quantized(nn.Module):
    """The buffers of one quantized W [K, N] and what fills them."""

    def _alloc(self, k: int, n: int, fmt: QuantFormat, device: torch.device) -> None:
        p = quant_layout.pack_factor(fmt.bits)
        if k % p:
            raise ValueError(f"{k} inputs are not a multiple of {p} ({fmt.bits}-bit codes)")
        self.in_features, self.out_features, self.fmt = k, n, fmt
        self.bits, self.zero_point = fmt.bits, fmt.zero_point
        self.group_size = fmt.group_rows(k)
        g = fmt.groups(k)
        self.register_buffer("qweight", torch.empty(k // p, n, dtype=torch.int32, device=device))
        self.register_buffer("scales", torch.empty(g, n, dtype=_DTYPES[fmt.scales],
                                                   device=device))
        self.register_buffer("offsets", None if fmt.offsets is None else torch.empty(
            g, n, dtype=_DTYPES[fmt.offsets], device=device))
        self.register_buffer("perm", torch.empty(k, dtype=torch.int32, device=device)
                             if fmt.act_order else None)
        self._perm_host: torch.Tensor | None = None  # the row order loaded (act-order)

    def _fill(self, qt: QuantTensor, col: int, what: str) -> None:
        if not isinstance(qt, QuantTensor):
            raise ShapeError(f"is a plain {tuple(qt.shape)} tensor, but this layer is "
                             f"quantized ({self.fmt.label})")
        if qt.in_features != self.in_features or not qt.matches(self.fmt):
            raise ShapeError(f"is {qt.label} with {qt.in_features} inputs ({qt.bits}-bit, "
                             f"group {qt.group_size}), expected {self.fmt.label} with "
                             f"{self.in_features}")
        cols = slice(col, col + qt.out_features)
        self.qweight[:, cols].copy_(qt.qweight)
        self.scales[:, cols].copy_(qt.scales)
        if self.offsets is not None:
            self.offsets[:, cols].copy_(qt.offsets)
        if self.perm is not None or qt.perm is not None:
            self._set_perm(qt.perm, what)

    def _set_perm(self, perm: torch.Tensor | None, what: str) -> None:
        if self.perm is None:
            raise ShapeError("has an act-order row order, but the checkpoint's config has "
                             "no desc_act")
        order = perm if perm is not None else torch.arange(self.in_features, dtype=torch.int32)
        if self._perm_host is None:
            self._perm_host = order.clone()
            self.perm.copy_(order)
        elif not torch.equal(self._perm_host, order):
            raise ShapeError(f"has another act-order row order than the other parts of "
                             f"{what}, which one GEMM computes: not supported")

    def finish_load(self) -> None:
        """Drop an act-order perm that orders nothing (its gather would only cost)."""
        if self.perm is not None and (self._perm_host is None or torch.equal(
                self._perm_host, torch.arange(self.in_features, dtype=torch.int32))):
            self.perm = None

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        lead = x.shape[:-1]
        y = ops.quant_matmul(x.reshape(-1, self.in_features), self.qweight, self.scales,
                             self.offsets, self.bits, self.group_size, self.zero_point, bias,
                             self.perm)
        return y.reshape(*lead, self.out_features)

    def init_dummy(self, gen: torch.Generator) -> None:
        """Random codes, scales with the spread of normal(0, 0.02) weights."""
        q = torch.randint(-2**31, 2**31, self.qweight.shape, generator=gen,
                          device=self.qweight.device, dtype=torch.int64)
        self.qweight.copy_(q.to(torch.int32))
        half = 1 << (self.bits - 1)
        self.scales.uniform_(0.02 / half, 0.06 / half, generator=gen)
        if self.offsets is not None:
            self.offsets.copy_(-half * self.scales)
        if self.perm is not None:
            self.perm.copy_(torch.randperm(self.in_features, generator=gen,
                                           device=self.perm.device).to(torch.int32))


class QuantLinear(_Quantized):
    def __init__(self, dense: ColumnParallelLinear | RowParallelLinear, fmt: QuantFormat):
        super().__init__()
        if isinstance(dense, RowParallelLinear):
            if dense.tp.size != 1:
                raise ValueError("quantized layers run with tensor_parallel_size 1")
            k, n = dense.cols, dense.weight.shape[0]
            shards = [(n, 0, n)]
        else:
            k, shards = dense.in_features, dense.shards
            n = sum(r for _, _, r in shards)
            if any(r != full for full, _, r in shards):
                raise ValueError("quantized layers run with tensor_parallel_size 1")
        self.shards = list(shards)
        self.col = [sum(r for _, _, r in shards[:i]) for i in range(len(shards))]
        self._alloc(k, n, fmt, dense.weight.device)
        self.bias = None if dense.bias is None else nn.Parameter(torch.empty_like(dense.bias))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)

    def load_shard(self, name: str, src, shard: int = 0) -> None:
        full, _, _ = self.shards[shard]
        if name == "bias":
            if tuple(src.shape) != (full,):
                raise ShapeError(f"has shape {tuple(src.shape)}, expected ({full},)")
            self.bias.data.narrow(0, self.col[shard], full).copy_(src)
            return
        if tuple(src.shape) != (full, self.in_features):
            raise ShapeError(f"has shape {tuple(src.shape)}, expected {(full, self.in_features)}")
        self._fill(src, self.col[shard], "this merged projection")


class QuantEmbedding(_Quantized):
    """The table E [V, H] as W = E^T [H, V] (V the rows, of the one rank)."""

    def __init__(self, dense: VocabParallelEmbedding, fmt: QuantFormat):
        super().__init__()
        if dense.tp.size != 1:
            raise ValueError("quantized layers run with tensor_parallel_size 1")
        self.vocab_size, self.hidden_size = dense.vocab_size, dense.hidden_size
        self.dtype = dense.weight.dtype  # the model's: a lookup's rows come in it
        self._alloc(dense.hidden_size, dense.vocab_size, fmt, dense.weight.device)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = quant_layout.dequantize(self.qweight.index_select(1, ids),
                                    self.scales.index_select(1, ids),
                                    None if self.offsets is None else
                                    self.offsets.index_select(1, ids),
                                    self.bits, self.group_size, self.zero_point)
        return w.t().to(self.dtype).contiguous()  # [T, H] row-major, as F.embedding gives

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.matmul(hidden, None)

    def load_shard(self, name: str, src, shard: int = 0) -> None:
        if tuple(src.shape) != (self.vocab_size, self.hidden_size):
            raise ShapeError(f"has shape {tuple(src.shape)}, expected "
                             f"{(self.vocab_size, self.hidden_size)}")
        self._fill(src, 0, "the embedding")


def quantized_layers(model: nn.Module) -> dict[str, _Quantized]:
    """"<layer>.weight" -> layer, for every quantized layer (the names weights load under)."""
    return {f"{n}.weight": m for n, m in model.named_modules() if isinstance(m, _Quantized)}
