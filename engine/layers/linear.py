"""Tensor-parallel linear layers, the vocab-parallel embedding and LM head
(engine/parallel.py says which slice each rank holds).

Parameters keep nn.Linear's / nn.Embedding's names (``weight``, ``bias``), so checkpoint
names map onto them unchanged. ``load_shard(name, src, shard)`` copies this rank's slice of the
checkpoint tensor ``src`` into parameter ``name``: ``src`` is a tensor or a
loader.LazyTensor (then only the slice is read from the file). A checkpoint tensor of the
wrong full shape is a ShapeError.

With one rank every layer is the plain single-device layer: F.linear / F.embedding on
the whole weight, no mask, no collective. ``packed``: the weight's MKL-packed copy that a
CPU float32 model multiplies with instead (engine/layers/packed.py; None elsewhere).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedq.engine.layers.packed import linear
from pagedq.engine.parallel import SINGLE, TensorParallel


class ShapeError(ValueError):
    """A checkpoint tensor's shape is not the one the model expects."""


def _check(src, want: tuple[int, ...]) -> None:
    if tuple(src.shape) != tuple(want):
        raise ShapeError(f"has shape {tuple(src.shape)}, expected {tuple(want)}")


class ColumnParallelLinear(nn.Module):
    """y = x W^T + b over this rank's output rows. A merged projection (qkv, gate_up) stacks
    several checkpoint tensors along the rows: ``shards[k] = (full_rows, start, rows)`` says
    checkpoint tensor k has ``full_rows`` rows, of which this rank holds [start, start +
    rows), stored after the rows it holds of shards 0..k-1."""

    def __init__(self, in_features: int, shards: list[tuple[int, int, int]],
                 bias: bool) -> None:
        super().__init__()
        self.in_features = in_features
        self.shards = list(shards)
        self.offsets = [sum(r for _, _, r in self.shards[:k]) for k in range(len(self.shards))]
        out = sum(r for _, _, r in self.shards)
        self.weight = nn.Parameter(torch.empty(out, in_features))
        self.bias = nn.Parameter(torch.empty(out)) if bias else None
        self.packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.packed)

    def load_shard(self, name: str, src, shard: int = 0) -> None:
        full, start, rows = self.shards[shard]
        param = self.weight if name == "weight" else self.bias
        _check(src, (full, self.in_features) if name == "weight" else (full,))
        param.data.narrow(0, self.offsets[shard], rows).copy_(src.narrow(0, start, rows))


class RowParallelLinear(nn.Module):
    """y = sum over ranks of x_r W_r^T, + b once. The rank holds input columns [start,
    start + cols) of ``in_features``; x is its slice of the input (a column-parallel
    layer's output). The bias is replicated and added after the all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool,
                 tp: TensorParallel = SINGLE, start: int = 0, cols: int | None = None) -> None:
        super().__init__()
        self.tp, self.full_in, self.start = tp, in_features, start
        self.cols = in_features if cols is None else cols
        self.weight = nn.Parameter(torch.empty(out_features, self.cols))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        self.packed: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return linear(x, self.weight, self.bias, self.packed)
        y = self.tp.all_reduce(linear(x, self.weight, None, self.packed))
        return y + self.bias if self.bias is not None else y

    def load_shard(self, name: str, src, shard: int = 0) -> None:
        out = self.weight.shape[0]
        if name == "bias":
            _check(src, (out,))
            self.bias.data.copy_(src.narrow(0, 0, out))
            return
        _check(src, (out, self.full_in))
        self.weight.data.copy_(src.narrow(1, self.start, self.cols))


class VocabParallelEmbedding(nn.Module):
    """Rows [start, start + per) of the (vocab, hidden) table, per = ceil(vocab / ranks);
    rows past the vocabulary (the last rank's tail) are zero and never looked up. Each rank
    embeds the ids in its range (zeros elsewhere); the all-reduce assembles the rows."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = SINGLE) -> None:
        super().__init__()
        self.tp, self.vocab_size, self.hidden_size = tp, vocab_size, hidden_size
        self.per = -(-vocab_size // tp.size)
        self.start = tp.rank * self.per
        self.real = max(0, min(self.per, vocab_size - self.start))  # rows inside the vocab
        self.weight = nn.Parameter(torch.empty(self.per, hidden_size))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per)
        h = F.embedding(local.masked_fill(outside, 0), self.weight)
        h.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.tp.all_reduce(h)

    def load_shard(self, name: str, src, shard: int = 0) -> None:
        _check(src, (self.vocab_size, self.hidden_size))
        self.weight.data[:self.real].copy_(src.narrow(0, self.start, self.real))
        self.weight.data[self.real:].zero_()


class ParallelLMHead(VocabParallelEmbedding):
    """An untied LM head: the same row partition as the embedding (see ``logits``)."""


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, tp: TensorParallel,
                          packed: torch.Tensor | None = None) -> torch.Tensor | None:
    """hidden [N, H] x this rank's vocab rows -> rank 0: logits [N, per * ranks] (columns
    >= vocab are padding, never read by the sampler); other ranks: None. One rank: the
    plain [N, vocab] product."""
    return tp.gather_last_dim(linear(hidden, weight, None, packed))
