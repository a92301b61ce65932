"""Write this step's K/V rows into the paged cache.

key, value : [T, Hkv, D]; token stride free (views of a fused qkv buffer are fine), each
             token's [Hkv, D] rows contiguous.
k_cache, v_cache : [num_blocks, block_size, Hkv, D], each contiguous or a transposed_view
             (kernels/layout.py): element (slot, h, d) is written through the cache's
             strides. slot_mapping [T] int64; -1 skips the token.
8-bit caches store what kernels/kv_quant.py says (fp8: divided by the head's scale and
saturated; int8: codes, and each (token, head)'s scale into the scale caches).
Grid (T, cdiv(Hkv*D, BLOCK)) (int8: (T,), a program quantizing all heads of a token);
values are cast to the cache dtype on store.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedq.kernels import kv_quant
from pagedq.kernels.layout import CACHE, FLOAT, is_paged_layout


@triton.jit
def fp8_scaled(x, inv, HEAD_SCALE: tl.constexpr, TOP: tl.constexpr):
    """x (times inv, the head's 1 / scale, when HEAD_SCALE) saturated at +-TOP (an fp8
    format's largest value; 0: a 16-bit cache, x as it is)."""
    if HEAD_SCALE:
        x = x.to(tl.float32) * inv
    if TOP > 0:
        x = tl.minimum(tl.maximum(x.to(tl.float32), -TOP), TOP)
    return x


@triton.jit
def int8_factors(amax):
    """(127 / amax, or 0 where amax == 0; amax / 127): kv_quant's int8 factors of rows whose
    max |x| is amax (IEEE quotients, as the twin's)."""
    pos = amax > 0
    inv = tl.where(pos, tl.math.div_rn(tl.full(amax.shape, 127.0, tl.float32),
                                       tl.where(pos, amax, 1.0)), 0.0)
    return inv, tl.math.div_rn(amax, tl.full(amax.shape, 127.0, tl.float32))


@triton.jit
def int8_codes(x, inv):
    """floor(x * inv + 0.5) within [-127, 127], as int8. Launch with enable_fp_fusion=False:
    a fused multiply-add would round once where the twin rounds twice."""
    c = tl.floor(x.to(tl.float32) * inv + 0.5)
    return tl.minimum(tl.maximum(c, -127.0), 127.0).to(tl.int8)


# slot_mapping is a slice of a packed buffer: its alignment changes with T, which must not
# compile a new variant mid-run; so do a layer's per-head scales (a view of all layers'
# [layers, 2, Hkv]: one variant for every layer). Cache strides equal to 1 are specialised
# (Triton's default), so a token-major cache keeps its vectorised row stores.
@triton.jit(do_not_specialize_on_alignment=["slot_ptr", "ks_ptr", "vs_ptr"])
def _store_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ks_ptr, vs_ptr, s_kt, s_vt,
                  s_kcb, s_kco, s_kch, s_kcd, s_vcb, s_vco, s_vch, s_vcd,
                  ROW: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                  BLOCK: tl.constexpr, HEAD_SCALE: tl.constexpr, TOP: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < ROW
    k = tl.load(k_ptr + t.to(tl.int64) * s_kt + offs, mask=mask)
    v = tl.load(v_ptr + t.to(tl.int64) * s_vt + offs, mask=mask)
    blk = slot // BS  # int64: no overflow on large caches
    off = slot % BS
    h = offs // D
    d = offs % D
    k_dst = blk * s_kcb + off * s_kco + h * s_kch + d * s_kcd
    v_dst = blk * s_vcb + off * s_vco + h * s_vch + d * s_vcd
    k_inv = 1.0
    v_inv = 1.0
    if HEAD_SCALE:
        one = tl.full([BLOCK], 1.0, tl.float32)
        k_inv = tl.math.div_rn(one, tl.load(ks_ptr + h, mask=mask, other=1.0))
        v_inv = tl.math.div_rn(one, tl.load(vs_ptr + h, mask=mask, other=1.0))
    k = fp8_scaled(k, k_inv, HEAD_SCALE, TOP)
    v = fp8_scaled(v, v_inv, HEAD_SCALE, TOP)
    tl.store(kc_ptr + k_dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + v_dst, v.to(vc_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _int8_rows(x_ptr, c_ptr, sc_ptr, blk, off, s_b, s_o, s_h, s_d, s_sb, s_so,
               H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr):
    """One token's [H, D] rows at x_ptr (contiguous) -> int8 codes at cache slot (blk,
    off), their scales at scale-cache slot (blk, off)."""
    h = tl.arange(0, H_PAD)[:, None]
    d = tl.arange(0, D_PAD)[None, :]
    mask = (h < H) & (d < D)
    x = tl.load(x_ptr + h * D + d, mask=mask, other=0.0).to(tl.float32)
    inv, scale = int8_factors(tl.max(tl.abs(x), 1))
    tl.store(c_ptr + blk * s_b + off * s_o + h * s_h + d * s_d, int8_codes(x, inv[:, None]),
             mask=mask)
    hs = tl.arange(0, H_PAD)
    tl.store(sc_ptr + blk * s_sb + off * s_so + hs, scale, mask=hs < H)


@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _store_int8_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, ksc_ptr, vsc_ptr, s_kt, s_vt,
                       s_kcb, s_kco, s_kch, s_kcd, s_vcb, s_vco, s_vch, s_vcd, s_sb, s_so,
                       H: tl.constexpr, H_PAD: tl.constexpr, D: tl.constexpr,
                       D_PAD: tl.constexpr, BS: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    blk = slot // BS
    off = slot % BS
    _int8_rows(k_ptr + t.to(tl.int64) * s_kt, kc_ptr, ksc_ptr, blk, off, s_kcb, s_kco, s_kch,
               s_kcd, s_sb, s_so, H, H_PAD, D, D_PAD)
    _int8_rows(v_ptr + t.to(tl.int64) * s_vt, vc_ptr, vsc_ptr, blk, off, s_vcb, s_vco, s_vch,
               s_vcd, s_sb, s_so, H, H_PAD, D, D_PAD)


def check_slots(bad, k_cache: torch.Tensor, v_cache: torch.Tensor,
                slot_mapping: torch.Tensor, T: int) -> None:
    """``bad(msg)`` (raises) unless the caches' layouts and slot_mapping [T] suit the store
    kernels (this one and kernels/rope_store.py)."""
    if not (is_paged_layout(k_cache) and is_paged_layout(v_cache)):
        bad("k_cache and v_cache must each be contiguous or a transposed_view, got strides "
            f"{k_cache.stride()} and {v_cache.stride()}")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (T,) \
            or not slot_mapping.is_contiguous():
        bad(f"slot_mapping must be contiguous int64 [T={T}], got {slot_mapping.dtype} "
            f"{tuple(slot_mapping.shape)}")


def store_kvcache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, *, k_scale=1.0,
                  v_scale=1.0, k_scale_cache: torch.Tensor | None = None,
                  v_scale_cache: torch.Tensor | None = None) -> None:
    """Write key/value [T, Hkv, D] into the caches at slot_mapping [T]; slot -1 is skipped.
    8-bit caches: kernels/kv_quant.py (k_scale / v_scale: an fp8 cache's per-head scales,
    floats or float32 [Hkv]; k_scale_cache / v_scale_cache: an int8 cache's scale caches).
    Slots must be < num_blocks * block_size (not checked: that would need a host sync)."""
    def bad(msg: str):
        raise ValueError(f"store_kvcache: {msg}")

    if key.dim() != 3 or key.shape != value.shape:
        bad(f"key and value must both be [T, Hkv, D], got {tuple(key.shape)} and "
            f"{tuple(value.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        bad("k_cache and v_cache must both be [num_blocks, block_size, Hkv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    T, h, d = key.shape
    if k_cache.shape[2:] != (h, d):
        bad(f"key rows [Hkv={h}, D={d}] do not match the cache's {tuple(k_cache.shape[2:])}")
    if key.dtype not in FLOAT or value.dtype not in FLOAT \
            or k_cache.dtype not in CACHE or v_cache.dtype != k_cache.dtype:
        bad(f"dtypes key={key.dtype} value={value.dtype} k_cache={k_cache.dtype} "
            f"v_cache={v_cache.dtype}; need fp16/bf16/fp32 inputs, caches of one dtype, "
            "also float8_e4m3fn/float8_e5m2/int8")
    for name, x in (("key", key), ("value", value)):
        if x.stride(2) != 1 or x.stride(1) != d:
            bad(f"{name}'s [Hkv, D] rows must be contiguous, got strides {x.stride()}")
    check_slots(bad, k_cache, v_cache, slot_mapping, T)
    kv_quant.check(bad, k_cache, k_scale, v_scale, k_scale_cache, v_scale_cache)
    devs = {x.device for x in (key, value, k_cache, v_cache, slot_mapping)}
    if len(devs) != 1:
        bad(f"all tensors must be on one device, got {devs}")
    if T == 0:
        return
    ks, vs, head, top, (ksc, vsc), s_sc = kv_quant.kernel_args(k_cache, k_scale, v_scale,
                                                     k_scale_cache, v_scale_cache)
    if k_cache.dtype == torch.int8:
        _store_int8_kernel[(T,)](
            key, value, k_cache, v_cache, slot_mapping, ksc, vsc, key.stride(0),
            value.stride(0), *k_cache.stride(), *v_cache.stride(), *s_sc,
            H=h, H_PAD=triton.next_power_of_2(h), D=d, D_PAD=triton.next_power_of_2(d),
            BS=k_cache.shape[1], num_warps=4, enable_fp_fusion=False)  # (int8_codes)
        return
    row = h * d
    block = min(triton.next_power_of_2(row), 4096)
    _store_kernel[(T, triton.cdiv(row, block))](
        key, value, k_cache, v_cache, slot_mapping, ks, vs, key.stride(0), value.stride(0),
        *k_cache.stride(), *v_cache.stride(),
        ROW=row, D=d, BS=k_cache.shape[1], BLOCK=block, HEAD_SCALE=head, TOP=top,
        num_warps=4)
