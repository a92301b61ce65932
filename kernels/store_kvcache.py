"""Write this step's K/V rows into the paged cache.

key, value : [T, Hkv, D]; token stride free (views of a fused qkv buffer are fine), each
             token's [Hkv, D] rows contiguous.
k_cache, v_cache : [num_blocks, block_size, Hkv, D], each contiguous or a transposed_view
             (kernels/layout.py): element (slot, h, d) is written through the cache's
             strides. slot_mapping [T] int64; -1 skips the token.
Grid (T, cdiv(Hkv*D, BLOCK)); values are cast to the cache dtype on store.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedq.kernels.layout import CACHE, FLOAT, is_paged_layout


# slot_mapping is a slice of a packed buffer: its alignment changes with T, which must not
# compile a new variant mid-run. Cache strides equal to 1 are specialised (Triton's
# default), so a token-major cache keeps its vectorised row stores.
@triton.jit(do_not_specialize_on_alignment=["slot_ptr"])
def _store_kernel(k_ptr, v_ptr, kc_ptr, vc_ptr, slot_ptr, s_kt, s_vt, k_inv, v_inv,
                  s_kcb, s_kco, s_kch, s_kcd, s_vcb, s_vco, s_vch, s_vcd,
                  ROW: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                  BLOCK: tl.constexpr, SCALED: tl.constexpr):
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
    if SCALED:
        k = k.to(tl.float32) * k_inv
        v = v.to(tl.float32) * v_inv
    tl.store(kc_ptr + k_dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    tl.store(vc_ptr + v_dst, v.to(vc_ptr.dtype.element_ty), mask=mask)




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
                  v_cache: torch.Tensor, slot_mapping: torch.Tensor, *, k_scale: float = 1.0,
                  v_scale: float = 1.0) -> None:
    """Write key/value [T, Hkv, D] into the caches at slot_mapping [T]; slot -1 is skipped.
    Stores key / k_scale and value / v_scale (float8_e4m3fn caches; 1.0 = reference).
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
            or k_cache.dtype not in CACHE or v_cache.dtype not in CACHE:
        bad(f"dtypes key={key.dtype} value={value.dtype} k_cache={k_cache.dtype} "
            f"v_cache={v_cache.dtype}; need fp16/bf16/fp32 inputs, caches also float8_e4m3fn")
    for name, x in (("key", key), ("value", value)):
        if x.stride(2) != 1 or x.stride(1) != d:
            bad(f"{name}'s [Hkv, D] rows must be contiguous, got strides {x.stride()}")
    check_slots(bad, k_cache, v_cache, slot_mapping, T)
    devs = {x.device for x in (key, value, k_cache, v_cache, slot_mapping)}
    if len(devs) != 1:
        bad(f"all tensors must be on one device, got {devs}")
    if T == 0:
        return
    row = h * d
    block = min(triton.next_power_of_2(row), 4096)
    _store_kernel[(T, triton.cdiv(row, block))](
        key, value, k_cache, v_cache, slot_mapping, key.stride(0), value.stride(0),
        1.0 / k_scale, 1.0 / v_scale, *k_cache.stride(), *v_cache.stride(),
        ROW=row, D=d, BS=k_cache.shape[1], BLOCK=block,
        SCALED=k_scale != 1.0 or v_scale != 1.0, num_warps=4)
