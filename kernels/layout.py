"""Layout checks shared by the paged-attention wrappers (see kernels/__init__.py).

A cache is always indexed as [num_blocks, block_size, Hkv, D]; two memory layouts exist:
  token-major (contiguous): slot s of a block holds its Hkv*D values together;
  transposed (``transposed_view``): block b, KV head h holds one [D, block_size] tile, the
    tokens of each dimension contiguous. 8-bit V caches (fp8, int8) use it: the decode
    kernel's P.V product needs V with tokens contiguous, and 8-bit values cannot be
    transposed on the fly by the tensor-core loads (kernels/decode_attention.py).
Every kernel and twin reads and writes through the strides, so both work anywhere.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import torch

FLOAT = (torch.float16, torch.bfloat16, torch.float32)
CACHE = FLOAT + (torch.float8_e4m3fn, torch.float8_e5m2, torch.int8)  # kernels/kv_quant.py


def check_paged_qkv(bad: Callable[[str], None], q: torch.Tensor, k_cache: torch.Tensor,
                    v_cache: torch.Tensor) -> tuple[int, int, int, int]:
    """Validate q [*, Hq, D] against the paged caches; returns (Hq, D, block_size, Hkv).
    ``bad(msg)`` raises the caller's ValueError."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        bad("k_cache and v_cache must both be [num_blocks, block_size, Hkv, D], got "
            f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    _, hq, d = q.shape
    _, bs, hkv, dk = k_cache.shape
    if q.dtype not in FLOAT or k_cache.dtype not in CACHE or v_cache.dtype != k_cache.dtype:
        bad(f"dtypes q={q.dtype} k={k_cache.dtype} v={v_cache.dtype}; need q fp16/bf16/fp32, "
            "caches fp16/bf16/fp32/float8_e4m3fn/float8_e5m2/int8 and k_cache.dtype == "
            "v_cache.dtype")
    if dk != d or d < 16 or d > 256 or d & (d - 1):
        bad(f"head_dim must match (q {d}, cache {dk}) and be a power of 2 in [16, 256]")
    if bs < 1 or bs & (bs - 1):
        bad(f"block_size must be a power of 2, got {bs}")
    if hkv == 0 or hq % hkv:
        bad(f"Hq={hq} must be a multiple of Hkv={hkv}")
    if q.stride(2) != 1:
        bad("q's last dim must be contiguous")
    if not (is_paged_layout(k_cache) and is_paged_layout(v_cache)):
        bad("k_cache and v_cache must each be contiguous or a transposed_view, got strides "
            f"{k_cache.stride()} and {v_cache.stride()}")
    return hq, d, bs, hkv


def transposed_view(storage: torch.Tensor) -> torch.Tensor:
    """The [num_blocks, block_size, Hkv, D] cache whose memory is ``storage``'s (any
    contiguous tensor of that shape), laid out per block and head as [D, block_size]."""
    nb, bs, h, d = storage.shape
    return storage.view(nb, h, d, bs).permute(0, 3, 1, 2)


def is_transposed(cache: torch.Tensor) -> bool:
    return cache.dim() == 4 and cache.permute(0, 2, 3, 1).is_contiguous() \
        and not cache.is_contiguous()


def is_paged_layout(cache: torch.Tensor) -> bool:
    return cache.dim() == 4 and (cache.is_contiguous() or is_transposed(cache))


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device, interpreter: int) -> int:
    """The device's multiprocessors; ``interpreter`` on the CPU (Triton's interpreter), kept
    small by the caller so that its tests reach the paths a GPU's many SMs choose."""
    if device.type == "cuda":
        return _sm_count(device.index if device.index is not None else 0)
    return interpreter
