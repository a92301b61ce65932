"""RMSNorm and fused residual-add + RMSNorm over the last dim; one program per row.

x [..., H] with a contiguous last dim; weight [H]. A 3-D x [T, N, H] is read in place
through its two outer strides (Qwen3's per-head q/k norm on views of the fused qkv output:
no copy); other shapes are flattened to rows. Statistics in fp32; the fused form rounds
x + residual to x.dtype first and normalises that rounded sum, exactly as the reference
twin does. Outputs are new tensors.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedq.kernels.layout import FLOAT


@triton.jit
def _rms_kernel(x_ptr, r_ptr, w_ptr, y_ptr, s_ptr, eps, s_x, s_xn, n_inner, s_r,
                H: tl.constexpr, BLOCK: tl.constexpr, ADD: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    mask = offs < H
    x = tl.load(x_ptr + (row // n_inner) * s_x + (row % n_inner) * s_xn + offs, mask=mask,
                other=0.0)
    if ADD:
        r = tl.load(r_ptr + row * s_r + offs, mask=mask, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(s_ptr + row * H + offs, x, mask=mask)
    xf = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(xf * xf, 0) / H + eps)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptr + row * H + offs, (xf * inv * w).to(y_ptr.dtype.element_ty), mask=mask)




def _rows(name: str, x: torch.Tensor, weight: torch.Tensor):
    """(x or a 2-D view of it, outer row stride, inner row stride, rows per outer index)."""
    if x.dtype not in FLOAT or weight.dtype not in FLOAT:
        raise ValueError(f"{name}: need fp16/bf16/fp32, got x {x.dtype}, weight {weight.dtype}")
    if x.dim() < 1 or weight.dim() != 1 or weight.shape[0] != x.shape[-1]:
        raise ValueError(f"{name}: weight must be [H={x.shape[-1] if x.dim() else '?'}], "
                         f"got {tuple(weight.shape)} for x {tuple(x.shape)}")
    if not weight.is_contiguous() or weight.device != x.device:
        raise ValueError(f"{name}: weight must be contiguous and on x's device")
    if x.shape[-1] > 65536:
        raise ValueError(f"{name}: hidden size {x.shape[-1]} > 65536 not supported")
    if x.dim() == 3 and x.stride(-1) == 1:
        return x, x.stride(0), x.stride(1), max(1, x.shape[1])
    x2 = x.reshape(-1, x.shape[-1]) if x.dim() != 2 else x
    if x2.stride(-1) != 1:
        raise ValueError(f"{name}: x's last dim must be contiguous, got strides {x.stride()}")
    return x2, x2.stride(0), 0, 1


def _launch(x, sx, sxn, inner, r2, weight, y, s, eps, add):
    n, h = x.numel() // max(1, x.shape[-1]), x.shape[-1]
    if n == 0:
        return
    block = triton.next_power_of_2(h)
    warps = 4 if block <= 2048 else 8 if block <= 8192 else 16
    _rms_kernel[(n,)](x, r2, weight, y, s, eps, sx, sxn, inner, r2.stride(0),
                      H=h, BLOCK=block, ADD=add, num_warps=warps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x2, sx, sxn, inner = _rows("rms_norm", x, weight)
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x2, sx, sxn, inner, y.view(-1, x.shape[-1]), weight, y, y, eps, False)
    return y


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                       eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (rms_norm(x + residual), x + residual)."""
    x2, sx, sxn, inner = _rows("fused_add_rms_norm", x, weight)
    if residual.shape != x.shape or residual.dtype not in FLOAT \
            or residual.device != x.device:
        raise ValueError(f"fused_add_rms_norm: residual {tuple(residual.shape)} "
                         f"{residual.dtype} must match x {tuple(x.shape)} on {x.device}")
    r2 = residual.reshape(-1, x.shape[-1]) if residual.dim() != 2 else residual
    if r2.stride(-1) != 1:
        raise ValueError("fused_add_rms_norm: residual's last dim must be contiguous")
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    s = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    _launch(x2, sx, sxn, inner, r2, weight, y, s, eps, True)
    return y, s
