"""Fused Gumbel-max sampling: one pass over the logits per step, instead of torch's ~8
full-vocabulary passes (divide, noise, clamp, log, neg, add, argmax, and the float copy).

Grid (R, ceil(V / BLOCK)): program (r, j) reads logits[r, j*BLOCK : (j+1)*BLOCK] in its own
dtype, adds the row's SplitMix64 Gumbel noise for those columns, and writes the block's
(max, argmax); a tiny torch argmax over the blocks picks the row's token. The noise is
computed per element from (key, column), the same integers as kernels/reference.py's twin,
so a seeded row samples the same token here and on the CPU up to float rounding of log.

Scores are taken in the log2 domain, logits * (log2(e) / T) - log2(E / ln 2): the twin's
logits / T - log(E), scaled by log2(e) and shifted by a constant, so the same argmax up to
rounding. On the GPU both logarithms are the hardware's approximate lg2 (one MUFU
instruction; accurate logf is ~12 FMAs each, and the kernel was bound by them, not by the
bytes it reads); the interpreter uses tl.log2.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triton.language.extra import libdevice

from pagedq.kernels.reference import C1, C2, GAMMA

_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _log2(x, FAST: tl.constexpr):
    if FAST:
        return libdevice.fast_log2f(x)
    return tl.log2(x)


@triton.jit
def _gumbel_kernel(x_ptr, s_xr, t_ptr, key_ptr, val_ptr, idx_ptr, V, n_blk,
                   BLOCK: tl.constexpr, G: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr,
                   FAST_LOG: tl.constexpr):
    r = tl.program_id(0)
    j = tl.program_id(1)
    offs = j * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    x = tl.load(x_ptr + r.to(tl.int64) * s_xr + offs, mask=mask, other=0.0).to(tl.float32)
    t = tl.load(t_ptr + r)
    scale = _LOG2E / tl.where(t > 0, t, 1.0)  # once per program, not a division per column
    z = tl.load(key_ptr + r).to(tl.uint64, bitcast=True) + (offs + 1).to(tl.uint64) * G
    z = (z ^ (z >> 30)) * M1
    z = (z ^ (z >> 27)) * M2
    z = z ^ (z >> 31)
    w = ((z >> 32).to(tl.float32) + 0.5) * 2.3283064365386963e-10
    # E / ln 2 = -log2(1 - w); the twin's series below 1e-3 (where 1 - w would round)
    e2 = tl.where(w < 1e-3, w * (1.0 + w * (0.5 + w * 0.33333334)) * _LOG2E,
                  -_log2(1.0 - w, FAST_LOG))
    y = tl.where(t > 0, x * scale - _log2(e2, FAST_LOG), x)
    y = tl.where(mask, y, float("-inf"))
    best, arg = tl.max(y, 0, return_indices=True)
    tl.store(val_ptr + r * n_blk + j, best)
    tl.store(idx_ptr + r * n_blk + j, j * BLOCK + arg)


def gumbel_argmax(logits: torch.Tensor, temperature: torch.Tensor, keys: torch.Tensor,
                  vocab_size: int) -> torch.Tensor:
    """See kernels/reference.py gumbel_argmax (same signature and semantics)."""
    def bad(msg: str):
        raise ValueError(f"gumbel_argmax: {msg}")

    if logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] < vocab_size:
        bad(f"logits must be [R, >= {vocab_size}] with contiguous rows, got "
            f"{tuple(logits.shape)} strides {logits.stride()}")
    R = logits.shape[0]
    if temperature.dtype != torch.float32 or temperature.shape != (R,):
        bad(f"temperature must be float32 [{R}], got {temperature.dtype} "
            f"{tuple(temperature.shape)}")
    if keys.dtype != torch.int64 or keys.shape != (R,):
        bad(f"keys must be int64 [{R}], got {keys.dtype} {tuple(keys.shape)}")
    if len({logits.device, temperature.device, keys.device}) != 1:
        bad("logits, temperature and keys must be on one device")
    if R == 0 or vocab_size < 1:
        return torch.zeros(R, dtype=torch.int64, device=logits.device)
    block = min(4096, triton.next_power_of_2(vocab_size))
    n_blk = triton.cdiv(vocab_size, block)
    vals = torch.empty(R, n_blk, dtype=torch.float32, device=logits.device)
    idx = torch.empty(R, n_blk, dtype=torch.int64, device=logits.device)
    _gumbel_kernel[(R, n_blk)](logits, logits.stride(0), temperature.contiguous(),
                               keys.contiguous(), vals, idx, vocab_size, n_blk,
                               BLOCK=block, G=GAMMA, M1=C1, M2=C2,
                               FAST_LOG=logits.device.type == "cuda", num_warps=8)
    return idx.gather(1, vals.argmax(dim=1, keepdim=True)).squeeze(1)
