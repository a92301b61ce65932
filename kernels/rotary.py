"""NeoX / HF-Llama rotary embedding (rotate_half), applied IN PLACE to q and k.

q [T, Hq, D], k [T, Hkv, D]: last dim contiguous, token and head strides free (views of a
fused qkv buffer are fine). cos_sin_cache [max_position, D] float32: first half cos, second
half sin (reference.rotary_cos_sin). positions [T] int32/int64. One program per token
rotates all its q and k heads; math in fp32, one rounding to the input dtype, so the
returned (q, k) equal the reference twin's results.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedq.kernels.layout import FLOAT


@triton.jit
def _rot_heads(x_ptr, t, s_t, s_h, cos, sin, NH: tl.constexpr, NH_PAD: tl.constexpr,
               HALF: tl.constexpr):
    offs_h = tl.arange(0, NH_PAD)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < NH)[:, None]
    p1 = x_ptr + t * s_t + offs_h[:, None] * s_h + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    a = x1.to(tl.float32)
    b = x2.to(tl.float32)
    tl.store(p1, (a * cos - b * sin).to(x1.dtype), mask=mask)
    tl.store(p1 + HALF, (b * cos + a * sin).to(x1.dtype), mask=mask)


# positions is a slice of a packed buffer: its alignment changes with T (no new variant).
@triton.jit(do_not_specialize_on_alignment=["pos_ptr"])
def _rotary_kernel(q_ptr, k_ptr, pos_ptr, cs_ptr, s_qt, s_qh, s_kt, s_kh,
                   HQ: tl.constexpr, HQ_PAD: tl.constexpr, HK: tl.constexpr,
                   HK_PAD: tl.constexpr, HALF: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + pos * (2 * HALF) + offs_d)[None, :]
    sin = tl.load(cs_ptr + pos * (2 * HALF) + HALF + offs_d)[None, :]
    _rot_heads(q_ptr, t, s_qt, s_qh, cos, sin, HQ, HQ_PAD, HALF)
    _rot_heads(k_ptr, t, s_kt, s_kh, cos, sin, HK, HK_PAD, HALF)




def check_rotary_inputs(bad, positions: torch.Tensor, cos_sin_cache: torch.Tensor, T: int,
                        d: int) -> None:
    """``bad(msg)`` (raises) unless positions [T] and cos_sin_cache [max_position, d] suit
    the kernels (this one and kernels/rope_store.py)."""
    if cos_sin_cache.dtype != torch.float32 or cos_sin_cache.dim() != 2 \
            or cos_sin_cache.shape[1] != d or not cos_sin_cache.is_contiguous():
        bad(f"cos_sin_cache must be contiguous float32 [max_position, D={d}], got "
            f"{cos_sin_cache.dtype} {tuple(cos_sin_cache.shape)}")
    if positions.dtype not in (torch.int32, torch.int64) or positions.shape != (T,) \
            or not positions.is_contiguous():
        bad(f"positions must be contiguous int32/int64 [T={T}], got {positions.dtype} "
            f"{tuple(positions.shape)}")


def apply_rotary(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                 cos_sin_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotates q [T, Hq, D] and k [T, Hkv, D] in place and returns (q, k).
    positions must be < max_position (not checked: that would need a host sync)."""
    def bad(msg: str):
        raise ValueError(f"apply_rotary: {msg}")

    if q.dim() != 3 or k.dim() != 3 or q.shape[0] != k.shape[0] or q.shape[2] != k.shape[2]:
        bad(f"q [T, Hq, D] and k [T, Hkv, D] must share T and D, got {tuple(q.shape)} "
            f"and {tuple(k.shape)}")
    T, hq, d = q.shape
    if q.dtype not in FLOAT or k.dtype not in FLOAT:
        bad(f"q and k must be fp16/bf16/fp32, got {q.dtype} and {k.dtype}")
    if d < 2 or d & (d - 1):
        bad(f"head_dim must be a power of 2, got {d}")
    if q.stride(2) != 1 or k.stride(2) != 1:
        bad("q's and k's last dim must be contiguous")
    check_rotary_inputs(bad, positions, cos_sin_cache, T, d)
    devs = {x.device for x in (q, k, positions, cos_sin_cache)}
    if len(devs) != 1:
        bad(f"all tensors must be on one device, got {devs}")
    if T == 0:
        return q, k
    hk = k.shape[1]
    _rotary_kernel[(T,)](q, k, positions, cos_sin_cache, q.stride(0), q.stride(1),
                         k.stride(0), k.stride(1), HQ=hq, HQ_PAD=triton.next_power_of_2(hq),
                         HK=hk, HK_PAD=triton.next_power_of_2(hk), HALF=d // 2,
                         num_warps=4)
    return q, k
