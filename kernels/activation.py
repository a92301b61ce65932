"""Fused SiLU-and-multiply of the merged gate_up projection: one read of [T, 2I], one write of
[T, I], instead of torch's silu kernel, its [T, I] intermediate and a multiply kernel.
Computed in fp32 and rounded once, as the reference twin does.

Grid (T, ceil(I / BLOCK)).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedq.kernels.layout import FLOAT


@triton.jit
def _silu_mul_kernel(x_ptr, y_ptr, s_x, s_y, inter, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inter
    g = tl.load(x_ptr + t * s_x + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + t * s_x + inter + offs, mask=mask, other=0.0).to(tl.float32)
    y = g / (1.0 + tl.exp(-g)) * u
    tl.store(y_ptr + t * s_y + offs, y.to(y_ptr.dtype.element_ty), mask=mask)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2I] = [gate | up] -> silu(gate) * up [..., I]."""
    if x.dtype not in FLOAT:
        raise ValueError(f"silu_and_mul: need fp16/bf16/fp32, got {x.dtype}")
    if x.dim() < 1 or x.shape[-1] % 2:
        raise ValueError(f"silu_and_mul: last dim must be even ([gate | up]), got {tuple(x.shape)}")
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1:
        raise ValueError("silu_and_mul: x's last dim must be contiguous")
    inter = x.shape[-1] // 2
    y = torch.empty(*x.shape[:-1], inter, dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    block = min(1024, triton.next_power_of_2(inter))
    _silu_mul_kernel[(x2.shape[0], triton.cdiv(inter, block))](
        x2, y, x2.stride(0), inter, inter, BLOCK=block, num_warps=4)
    return y
