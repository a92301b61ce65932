"""Layout checks shared by the paged-attention wrappers (see kernels/__init__.py)."""
from __future__ import annotations

from collections.abc import Callable

import torch

FLOAT = (torch.float16, torch.bfloat16, torch.float32)
CACHE = FLOAT + (torch.float8_e4m3fn,)


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
            "caches fp16/bf16/fp32/float8_e4m3fn and k_cache.dtype == v_cache.dtype")
    if dk != d or d < 16 or d > 256 or d & (d - 1):
        bad(f"head_dim must match (q {d}, cache {dk}) and be a power of 2 in [16, 256]")
    if bs < 1 or bs & (bs - 1):
        bad(f"block_size must be a power of 2, got {bs}")
    if hkv == 0 or hq % hkv:
        bad(f"Hq={hq} must be a multiple of Hkv={hkv}")
    if q.stride(2) != 1:
        bad("q's last dim must be contiguous")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        bad("k_cache and v_cache must be contiguous")
    return hq, d, bs, hkv
