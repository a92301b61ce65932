"""Pre-packed float32 weights for the CPU's linear layers (oneDNN).

A CPU decode step multiplies a few rows (one per sequence) by every weight matrix, each
read from memory once per step (the bundled SmolLM2's 540 MB do not stay in cache).
oneDNN's inner product over a weight reordered once at load
(``torch.ops.mkldnn._reorder_linear_weight``, then ``_linear_pointwise`` per call) streams
those weights about twice as fast as F.linear (MKL sgemm) at 16 rows on the AMD EPYC
development machine, and is faster at every row count up to a 640-token prefill, so every
call goes through it (docs/benchmarks.md; MKL's own packed GEMM, used before, was slower
than F.linear there with cold weights). The results differ from F.linear's by float
rounding (another summation order), ~1e-6 relative. The first call at a row count not
seen before builds oneDNN's primitive for it (~1 ms per weight shape), cached after.

A layer whose weight is packed keeps the plain weight too (the embedding reads it, and so
do weight loading and tensor-parallel slicing): the CPU model holds its linear weights
twice and reads one copy per step. Nothing is packed on other devices, for other dtypes,
or where torch has no oneDNN; ``linear`` is then ``F.linear``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn,
                                                             "_reorder_linear_weight")


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of a float32 CPU weight [out, in], or None when oneDNN's result does
    not match F.linear's on a probe (the layout is reordered for a batch size hint; one
    packing serving every batch size is checked here, not assumed)."""
    if not (available() and weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.dim() == 2 and weight.is_contiguous()):
        return None
    w = weight.detach()
    packed = torch.ops.mkldnn._reorder_linear_weight(w, 16)
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 3, 16, 40):
        x = torch.randn(rows, w.shape[1], generator=gen)
        ref = F.linear(x, w)
        got = _packed_linear(x, packed, None)
        if not torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()) + 1e-30):
            return None
    return packed


def _packed_linear(x: torch.Tensor, packed: torch.Tensor,
                   bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the packed copy when there is one."""
    if packed is None:
        return F.linear(x, weight, bias)
    return _packed_linear(x, packed, bias)


@torch.no_grad()
def pack_model(model: nn.Module) -> int:
    """Pack the weight of every module with a ``packed`` attribute (linear layers, the LM
    head / tied embedding); returns how many were packed. Call after loading weights."""
    n = 0
    for module in model.modules():
        if hasattr(module, "packed"):
            module.packed = pack(module.weight)
            n += module.packed is not None
    return n
