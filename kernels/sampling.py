"""Fused Gumbel-max sampling: one pass over the logits per step, instead of torch's ~8
full-vocabulary passes (divide, noise, clamp, log, neg, add, argmax, and the float copy).

Grid (R, ceil(V / BLOCK)): program (r, j) reads logits[r, j*BLOCK : (j+1)*BLOCK] in its own
dtype, adds the row's SplitMix64 Gumbel noise for those columns, and writes the block's
(max, argmax); a tiny torch argmax over the blocks picks the row's token. The noise is
computed per element from (key, column), the same integers as kernels/reference.py's twin,
so a seeded row samples the same token here and on the CPU up to float rounding of log.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import C1, C2, GAMMA


@triton.jit
def _gumbel_kernel(x_ptr, s_xr, t_ptr, key_ptr, val_ptr, idx_ptr, V, n_blk,
                   BLOCK: tl.constexpr, G: tl.constexpr, M1: tl.constexpr, M2: tl.constexpr):
    r = tl.program_id(0)
    j = tl.program_id(1)
    offs = j * BLOCK + tl.arange(0, BLOCK)
    mask = offs < V
    x = tl.load(x_ptr + r.to(tl.int64) * s_xr + offs, mask=mask, other=0.0).to(tl.float32)
    t = tl.load(t_ptr + r)
    z = tl.load(key_ptr + r).to(tl.uint64, bitcast=True) + (offs + 1).to(tl.uint64) * G
    z = (z ^ (z >> 30)) * M1
    z = (z ^ (z >> 27)) * M2
    z = z ^ (z >> 31)
    w = ((z >> 32).to(tl.float32) + 0.5) * 2.3283064365386963e-10
    e = tl.where(w < 1e-3, w * (1.0 + w * (0.5 + w * 0.33333334)), -tl.log(1.0 - w))
    y = tl.where(t > 0, x / tl.where(t > 0, t, 1.0) - tl.log(e), x)
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
                               BLOCK=block, G=GAMMA, M1=C1, M2=C2, num_warps=8)
    return idx.gather(1, vals.argmax(dim=1, keepdim=True)).squeeze(1)
