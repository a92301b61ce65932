"""Sampling kernels: the fused Gumbel-max sampler and the grammar's token mask.

Fused Gumbel-max sampling: one pass over the logits per step, instead of torch's ~8
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


@triton.jit
def _bitmask_kernel(x_ptr, s_xr, mask_ptr, s_mr, rows_ptr, V, BLOCK: tl.constexpr):
    g = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    inside = offs < V
    words = tl.load(mask_ptr + g.to(tl.int64) * s_mr + offs // 32, mask=inside, other=-1)
    banned = ((words >> (offs % 32)) & 1) == 0
    r = tl.load(rows_ptr + g).to(tl.int64)
    tl.store(x_ptr + r * s_xr + offs, float("-inf"), mask=inside & banned)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor,
                        vocab_size: int) -> None:
    """See kernels/reference.py apply_token_bitmask (same signature and semantics). Grid
    (G, ceil(V / BLOCK)): each program reads BLOCK / 32 mask words of its row and writes
    -inf where a bit is 0; allowed logits are not touched."""
    def bad(msg: str):
        raise ValueError(f"apply_token_bitmask: {msg}")

    words = triton.cdiv(vocab_size, 32)
    if logits.dim() != 2 or logits.stride(1) != 1 or logits.shape[1] < vocab_size:
        bad(f"logits must be [R, >= {vocab_size}] with contiguous rows, got "
            f"{tuple(logits.shape)} strides {logits.stride()}")
    G = rows.shape[0]
    if bitmask.dtype != torch.int32 or bitmask.shape != (G, words) or bitmask.stride(1) != 1:
        bad(f"bitmask must be int32 [{G}, {words}] with contiguous rows, got "
            f"{bitmask.dtype} {tuple(bitmask.shape)}")
    if rows.dtype != torch.int64 or rows.dim() != 1:
        bad(f"rows must be int64 [G], got {rows.dtype} {tuple(rows.shape)}")
    if len({logits.device, bitmask.device, rows.device}) != 1:
        bad("logits, bitmask and rows must be on one device")
    if G == 0:
        return
    block = min(4096, triton.next_power_of_2(vocab_size))
    _bitmask_kernel[(G, triton.cdiv(vocab_size, block))](
        logits, logits.stride(0), bitmask, bitmask.stride(0), rows.contiguous(), vocab_size,
        BLOCK=block, num_warps=4)
