"""Qwen3 per-head q/k RMSNorm + rotary + K/V cache store in ONE launch (per layer and step).

Replaces norm.rms_norm on q and on k (Qwen3 only), rotary.apply_rotary and
store_kvcache.store_kvcache. Rounds where they do: the normalised head is rounded to its
dtype, rotated in fp32 from that rounded value and rounded again; the cache gets the
rotated k (and v) as store_kvcache stores them (8-bit caches: kernels/kv_quant.py). Without the norm
the result is theirs bit for bit; the norm's sum of squares adds the two halves of a head
separately, so its statistic may differ from rms_norm's in the last bit.

q [T, Hq, D], k and v [T, Hkv, D]: last dim contiguous, token and head strides free (views
of a fused qkv buffer are fine). q and k are rotated IN PLACE and returned. positions [T]
int32/int64; cos_sin_cache [max_position, D] float32 (reference.rotary_cos_sin).
k_cache, v_cache [num_blocks, block_size, Hkv, D]: contiguous or a transposed_view
(kernels/layout.py), written through their strides; slot_mapping [T] int64, -1 = the token's
K/V are not stored (its q and k are still rotated).
Grid (T, 2): program (t, 0) does token t's q heads, (t, 1) its k heads (stored too) and
stores its v heads: two programs per token of all its heads (one per head was ~2x slower
on the H200: 5.7 us per layer at 180 tokens).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedq.kernels import kv_quant
from pagedq.kernels.layout import CACHE, FLOAT
from pagedq.kernels.rotary import check_rotary_inputs
from pagedq.kernels.store_kvcache import (
    check_slots,
    fp8_scaled,
    int8_codes,
    int8_factors,
)


@triton.jit
def _norm_rope(x_ptr, s_h, w_ptr, eps, cos, sin, H: tl.constexpr, H_PAD: tl.constexpr,
               D: tl.constexpr, HALF: tl.constexpr, NORM: tl.constexpr):
    """All H heads of one token at x_ptr (head stride s_h): (RMSNorm per head, rounded to
    the dtype,) rotated, rounded, stored in place. Returns the stored halves [H_PAD, HALF]."""
    offs_h = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, HALF)
    mask = (offs_h < H)[:, None]
    p1 = x_ptr + offs_h[:, None] * s_h + offs_d[None, :]
    x1 = tl.load(p1, mask=mask, other=0.0)
    x2 = tl.load(p1 + HALF, mask=mask, other=0.0)
    if NORM:
        a = x1.to(tl.float32)
        b = x2.to(tl.float32)
        ss = tl.sum(a * a, 1) + tl.sum(b * b, 1)
        inv = (1.0 / tl.sqrt(ss / D + eps))[:, None]
        w1 = tl.load(w_ptr + offs_d).to(tl.float32)[None, :]
        w2 = tl.load(w_ptr + HALF + offs_d).to(tl.float32)[None, :]
        x1 = (a * inv * w1).to(x1.dtype)
        x2 = (b * inv * w2).to(x2.dtype)
    a = x1.to(tl.float32)  # rotary._rot_heads' arithmetic
    b = x2.to(tl.float32)
    r1 = (a * cos - b * sin).to(x1.dtype)
    r2 = (b * cos + a * sin).to(x1.dtype)
    tl.store(p1, r1, mask=mask)
    tl.store(p1 + HALF, r2, mask=mask)
    return r1, r2


@triton.jit
def _store_rows(c_ptr, slot, x, d0, inv, s_b, s_o, s_h, s_d, H: tl.constexpr,
                H_PAD: tl.constexpr, N: tl.constexpr, BS: tl.constexpr,
                HEAD_SCALE: tl.constexpr, TOP: tl.constexpr, INT8: tl.constexpr):
    """x [H_PAD, N] -> cache elements (slot, h, d0 .. d0 + N - 1) of heads h < H, as
    store_kvcache stores them (inv: [H_PAD, 1], the heads' 1 / scale or int8 factor)."""
    blk = slot // BS  # int64: no overflow on large caches
    off = slot % BS
    h = tl.arange(0, H_PAD)[:, None]
    d = d0 + tl.arange(0, N)[None, :]
    if INT8:
        y = int8_codes(x, inv)
    else:
        y = fp8_scaled(x, inv, HEAD_SCALE, TOP).to(c_ptr.dtype.element_ty)
    tl.store(c_ptr + blk * s_b + off * s_o + h * s_h + d * s_d, y, mask=h < H)


@triton.jit
def _inverses(s_ptr, offs_h, hmask):
    """[H_PAD, 1]: 1 / the heads' scales (IEEE quotients)."""
    s = tl.load(s_ptr + offs_h, mask=hmask, other=1.0)
    return tl.math.div_rn(tl.full(s.shape, 1.0, tl.float32), s)[:, None]


# positions and slot_mapping are slices of packed buffers: their alignment changes with T,
# which must not compile a new variant mid-run (CUDA graphs capture several T).
@triton.jit(do_not_specialize_on_alignment=["pos_ptr", "slot_ptr", "ks_ptr", "vs_ptr"])
def _rope_store_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, cs_ptr, kc_ptr, vc_ptr, slot_ptr,
                       qw_ptr, kw_ptr, eps, ks_ptr, vs_ptr, ksc_ptr, vsc_ptr,
                       s_qt, s_qh, s_kt, s_kh, s_vt, s_vh,
                       s_kcb, s_kco, s_kch, s_kcd, s_vcb, s_vco, s_vch, s_vcd, s_sb, s_so,
                       HQ: tl.constexpr, HQ_PAD: tl.constexpr, HK: tl.constexpr,
                       HK_PAD: tl.constexpr, D: tl.constexpr, HALF: tl.constexpr,
                       BS: tl.constexpr, NORM: tl.constexpr, HEAD_SCALE: tl.constexpr,
                       TOP: tl.constexpr, INT8: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t).to(tl.int64)
    offs_d = tl.arange(0, HALF)
    cos = tl.load(cs_ptr + pos * (2 * HALF) + offs_d)[None, :]
    sin = tl.load(cs_ptr + pos * (2 * HALF) + HALF + offs_d)[None, :]
    if tl.program_id(1) == 0:
        _norm_rope(q_ptr + t * s_qt, s_qh, qw_ptr, eps, cos, sin, HQ, HQ_PAD, D, HALF, NORM)
    else:
        k1, k2 = _norm_rope(k_ptr + t * s_kt, s_kh, kw_ptr, eps, cos, sin, HK, HK_PAD, D,
                            HALF, NORM)
        slot = tl.load(slot_ptr + t)
        if slot >= 0:
            offs_h = tl.arange(0, HK_PAD)
            hmask = offs_h < HK
            v = tl.load(v_ptr + t * s_vt + offs_h[:, None] * s_vh + tl.arange(0, D)[None, :],
                        mask=hmask[:, None], other=0.0)
            k_inv = 1.0
            v_inv = 1.0
            if INT8:  # a head's max |x| over both halves of k
                k_inv, k_s = int8_factors(tl.maximum(tl.max(tl.abs(k1.to(tl.float32)), 1),
                                                     tl.max(tl.abs(k2.to(tl.float32)), 1)))
                v_inv, v_s = int8_factors(tl.max(tl.abs(v.to(tl.float32)), 1))
                k_inv = k_inv[:, None]
                v_inv = v_inv[:, None]
                so = (slot // BS) * s_sb + (slot % BS) * s_so + offs_h
                tl.store(ksc_ptr + so, k_s, mask=hmask)
                tl.store(vsc_ptr + so, v_s, mask=hmask)
            elif HEAD_SCALE:
                k_inv = _inverses(ks_ptr, offs_h, hmask)
                v_inv = _inverses(vs_ptr, offs_h, hmask)
            _store_rows(kc_ptr, slot, k1, 0, k_inv, s_kcb, s_kco, s_kch, s_kcd, HK, HK_PAD,
                        HALF, BS, HEAD_SCALE, TOP, INT8)
            _store_rows(kc_ptr, slot, k2, HALF, k_inv, s_kcb, s_kco, s_kch, s_kcd, HK,
                        HK_PAD, HALF, BS, HEAD_SCALE, TOP, INT8)
            _store_rows(vc_ptr, slot, v, 0, v_inv, s_vcb, s_vco, s_vch, s_vcd, HK, HK_PAD, D,
                        BS, HEAD_SCALE, TOP, INT8)


def qk_norm_rope_store(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                       positions: torch.Tensor, cos_sin_cache: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor,
                       slot_mapping: torch.Tensor, q_weight: torch.Tensor | None,
                       k_weight: torch.Tensor | None, eps: float, *, k_scale=1.0,
                       v_scale=1.0, k_scale_cache: torch.Tensor | None = None,
                       v_scale_cache: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor]:
    """RMS-normalise each q head by q_weight [D] and each k head by k_weight [D] (both None:
    no norm), rotate q and k in place, store k and v at slot_mapping (-1 skipped) as
    store_kvcache does (its k_scale ... v_scale_cache). Returns (q, k). Positions must be
    < max_position and slots < num_blocks * block_size (not checked: that would need a
    host sync)."""
    def bad(msg: str):
        raise ValueError(f"qk_norm_rope_store: {msg}")

    if q.dim() != 3 or k.dim() != 3 or k.shape != v.shape or q.shape[0] != k.shape[0] \
            or q.shape[2] != k.shape[2]:
        bad(f"q [T, Hq, D], k and v [T, Hkv, D] must share T and D, got {tuple(q.shape)}, "
            f"{tuple(k.shape)} and {tuple(v.shape)}")
    T, hq, d = q.shape
    hk = k.shape[1]
    if q.dtype not in FLOAT or k.dtype not in FLOAT or v.dtype not in FLOAT:
        bad(f"q, k and v must be fp16/bf16/fp32, got {q.dtype}, {k.dtype} and {v.dtype}")
    if d < 2 or d & (d - 1):
        bad(f"head_dim must be a power of 2, got {d}")
    if q.stride(2) != 1 or k.stride(2) != 1 or v.stride(2) != 1:
        bad("q's, k's and v's last dim must be contiguous")
    if (q_weight is None) != (k_weight is None):
        bad("q_weight and k_weight must both be given (q/k norm) or both be None")
    for name, w in (("q_weight", q_weight), ("k_weight", k_weight)):
        if w is not None and (w.dtype not in FLOAT or w.shape != (d,) or not w.is_contiguous()):
            bad(f"{name} must be a contiguous fp16/bf16/fp32 [D={d}], got {w.dtype} "
                f"{tuple(w.shape)}")
    check_rotary_inputs(bad, positions, cos_sin_cache, T, d)
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape or k_cache.shape[2:] != (hk, d):
        bad(f"k_cache and v_cache must both be [num_blocks, block_size, Hkv={hk}, D={d}], "
            f"got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if k_cache.dtype not in CACHE or v_cache.dtype != k_cache.dtype:
        bad(f"caches must be fp16/bf16/fp32/float8_e4m3fn/float8_e5m2/int8, both one dtype, "
            f"got {k_cache.dtype} and {v_cache.dtype}")
    check_slots(bad, k_cache, v_cache, slot_mapping, T)
    kv_quant.check(bad, k_cache, k_scale, v_scale, k_scale_cache, v_scale_cache)
    tensors = (q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping)
    devs = {x.device for x in tensors + tuple(w for w in (q_weight, k_weight) if w is not None)}
    if len(devs) != 1:
        bad(f"all tensors must be on one device, got {devs}")
    if T == 0:
        return q, k
    norm = q_weight is not None
    ks, vs, head, top, (ksc, vsc), s_sc = kv_quant.kernel_args(k_cache, k_scale, v_scale,
                                                     k_scale_cache, v_scale_cache)
    _rope_store_kernel[(T, 2)](
        q, k, v, positions, cos_sin_cache, k_cache, v_cache, slot_mapping,
        q_weight if norm else q, k_weight if norm else k, float(eps), ks, vs, ksc, vsc,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1),
        v.stride(0), v.stride(1), *k_cache.stride(), *v_cache.stride(), *s_sc,
        HQ=hq, HQ_PAD=triton.next_power_of_2(hq), HK=hk, HK_PAD=triton.next_power_of_2(hk),
        D=d, HALF=d // 2, BS=k_cache.shape[1], NORM=norm, HEAD_SCALE=head, TOP=top,
        INT8=k_cache.dtype == torch.int8, num_warps=4,
        enable_fp_fusion=k_cache.dtype != torch.int8)  # (store_kvcache.int8_codes)
    return q, k
