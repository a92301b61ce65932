"""MKL-packed float32 weights for the CPU's linear layers.

A CPU decode step multiplies a few rows (one per sequence) by every weight matrix. At 16
rows F.linear reaches ~90 GFLOP/s on the 2-core development machine, MKL's packed GEMM
(``cblas_sgemm_pack`` once at load, ``cblas_sgemm_compute`` per call: torch.ops.mkl)
~125: a decode step of the bundled SmolLM2 spends ~35 ms in its GEMMs instead of ~50. From
about 40 rows up (prefill chunks) F.linear is as fast or faster, so ``linear`` packs only
up to PACKED_MAX_ROWS rows. The packed results equal F.linear's bit for bit from 16 rows
up, and differ by float rounding below that (F.linear takes another MKL path there).

A layer whose weight is packed keeps the plain weight too (the embedding reads it, and so
do weight loading and tensor-parallel slicing): the CPU model holds its linear weights
twice and reads one copy per step. Nothing is packed on other devices, for other dtypes,
or where torch has no MKL; ``linear`` is then ``F.linear``.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

PACKED_MAX_ROWS = 32


def available() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_linear")


def pack(weight: torch.Tensor) -> torch.Tensor | None:
    """The packed copy of a float32 CPU weight [out, in], or None when MKL's result does not
    match F.linear's on a probe (the packed layout is documented per batch size; one
    packing serving every batch size is checked here, not assumed)."""
    if not (available() and weight.device.type == "cpu" and weight.dtype == torch.float32
            and weight.dim() == 2 and weight.is_contiguous()):
        return None
    w = weight.detach()
    packed = torch.ops.mkl._mkl_reorder_linear_weight(w, 16)
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 3, 16, 40):
        x = torch.randn(rows, w.shape[1], generator=gen)
        ref = F.linear(x, w)
        got = torch.ops.mkl._mkl_linear(x, packed, w, None, rows)
        if not torch.allclose(got, ref, rtol=1e-4, atol=1e-4 * float(ref.abs().max()) + 1e-30):
            return None
    return packed


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
           packed: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, weight, bias), through the packed copy when there is one and x [M, in]
    has at most PACKED_MAX_ROWS rows."""
    if packed is None or x.dim() != 2 or x.shape[0] > PACKED_MAX_ROWS:
        return F.linear(x, weight, bias)
    return torch.ops.mkl._mkl_linear(x, packed, weight, bias, x.shape[0])


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
