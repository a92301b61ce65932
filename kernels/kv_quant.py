"""The 8-bit KV caches' contract: how a stored value maps to the real one, shared by every
kernel, twin and the CPU path. The kind of a cache is its dtype:

  fp16 / bf16 / fp32: stored = real.
  float8_e4m3fn, float8_e5m2: real = stored * scale, one scale per KV head: ``k_scale`` /
    ``v_scale`` a float (every head) or a float32 [Hkv] tensor on the cache's device (the
    engine's form: kernels read it through a pointer, so a CUDA graph captured before the
    scale was set reads the value it holds when replayed). A store writes x * (1 / scale)
    (float32, IEEE quotient), saturated at the format's largest finite value (448; 57,344),
    so a value out of range is clamped, never NaN or inf.
  int8: real = stored * s, one float32 s per token and KV head, in a scale cache beside
    each cache (``k_scale_cache`` / ``v_scale_cache``: [num_blocks, block_size, Hkv],
    contiguous, indexed by slot as the cache is), written by the store with the codes:
    over a head's D values, a = max |x|, s = a / 127, code = floor(x * (127 / a) + 0.5)
    (0 where a = 0), clamped to [-127, 127]; both quotients IEEE float32.
The attention kernels fold the scales into the scores and the softmax weights (an fp8
head's k_scale into the score scale; int8's per-token scales into the scores' and p's
columns), so no cache element is multiplied by its scale.
Standard torch only (the CPU path imports this; the Triton wrappers do too).
"""
from __future__ import annotations

import torch

FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)
FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}
INT8_MAX = 127.0
EIGHT_BIT = FP8 + (torch.int8,)


def kind(cache_dtype: torch.dtype) -> str:
    """"fp8" (float8_e4m3fn), "fp8_e5m2", "int8" or "16bit" (fp16/bf16/fp32): the decode
    kernel's cache kinds (kernels/decode_attention.py DEFAULTS)."""
    return {torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8_e5m2",
            torch.int8: "int8"}.get(cache_dtype, "16bit")


def _is_unit(s) -> bool:
    return not isinstance(s, torch.Tensor) and float(s) == 1.0


def check(bad, k_cache: torch.Tensor, k_scale, v_scale, k_scale_cache, v_scale_cache) -> None:
    """``bad(msg)`` (raises) unless the scales suit a cache of k_cache's dtype, shape and
    device (module doc). Values are not read (no host sync)."""
    dt, (nb, bs, hkv, _) = k_cache.dtype, k_cache.shape
    tok = (k_scale_cache, v_scale_cache)
    if dt == torch.int8:
        if not (_is_unit(k_scale) and _is_unit(v_scale)):
            bad("an int8 cache takes per-token scale caches, not k_scale / v_scale")
        for name, t in zip(("k_scale_cache", "v_scale_cache"), tok, strict=True):
            if t is None or t.dtype != torch.float32 or t.shape != (nb, bs, hkv) \
                    or not t.is_contiguous() or t.device != k_cache.device:
                bad(f"an int8 cache needs {name}: contiguous float32 [{nb}, {bs}, {hkv}] on "
                    f"{k_cache.device}, got "
                    + ("None" if t is None else f"{t.dtype} {tuple(t.shape)} on {t.device}"))
        return
    if any(t is not None for t in tok):
        bad(f"scale caches are for int8 caches, not {dt}")
    for name, s in (("k_scale", k_scale), ("v_scale", v_scale)):
        if _is_unit(s):
            continue
        if dt not in FP8:
            bad(f"{name} is for 8-bit float caches, not {dt} (got {s!r})")
        if isinstance(s, torch.Tensor):
            if s.dtype != torch.float32 or s.shape != (hkv,) or not s.is_contiguous() \
                    or s.device != k_cache.device:
                bad(f"{name} must be a float or contiguous float32 [Hkv={hkv}] on "
                    f"{k_cache.device}, got {s.dtype} {tuple(s.shape)} on {s.device}")
        elif not float(s) > 0:
            bad(f"{name} must be > 0, got {s}")


def head_scale(s, hkv: int, device) -> torch.Tensor | None:
    """A per-head scale as the Triton kernels take it: float32 [Hkv] on ``device``, or None
    for 1.0 (the kernels skip it)."""
    if isinstance(s, torch.Tensor):
        return s
    return None if float(s) == 1.0 else torch.full((hkv,), float(s), dtype=torch.float32,
                                                   device=device)


def kernel_args(k_cache: torch.Tensor, k_scale, v_scale, k_scale_cache, v_scale_cache):
    """The Triton kernels' scale arguments (check first): (per-head scales K, V (the cache
    where there are none: unread), HEAD_SCALE, TOP: the fp8 format's largest value (0: not
    fp8), (scale caches K, V, or the cache twice: unread), their block and slot strides)."""
    hkv, dev = k_cache.shape[2], k_cache.device
    ks, vs = (head_scale(s, hkv, dev) for s in (k_scale, v_scale))
    head = ks is not None or vs is not None
    if head:
        ones = torch.ones(hkv, dtype=torch.float32, device=dev)
        ks, vs = (ones if x is None else x for x in (ks, vs))
    else:
        ks = vs = k_cache
    top = FP8_MAX.get(k_cache.dtype, 0.0)
    sc = (k_scale_cache, v_scale_cache) if k_scale_cache is not None else (k_cache, k_cache)
    strides = k_scale_cache.stride()[:2] if k_scale_cache is not None else (0, 0)
    return ks, vs, head, top, sc, strides


def per_head(s, hkv: int, device) -> torch.Tensor:
    """float32 [Hkv] of a scale given as a float or as such a tensor (twins)."""
    return s if isinstance(s, torch.Tensor) else torch.full((hkv,), float(s), device=device)


def quantize_fp8(x: torch.Tensor, dtype: torch.dtype, scale) -> torch.Tensor:
    """x [T, Hkv, D] -> ``dtype`` (float8_e4m3fn or e5m2): x * (1 / scale[h]) saturated."""
    s = per_head(scale, x.shape[1], x.device)
    inv = torch.ones_like(s) / s  # (tensor / tensor: see quantize_int8)
    top = FP8_MAX[dtype]
    return (x.float() * inv[:, None]).clamp_(-top, top).to(dtype)


def quantize_int8(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, Hkv, D] -> (int8 codes [T, Hkv, D], float32 scales [T, Hkv]) (module doc)."""
    xf = x.float()
    a = xf.abs().amax(-1)
    # tensor / tensor only: torch computes a number / a tensor, and on CUDA a tensor / a
    # number, as a product with a reciprocal, not the IEEE quotient the kernels take
    top = torch.full_like(a, INT8_MAX)
    inv = torch.where(a > 0, top / torch.where(a > 0, a, 1.0), 0.0)
    codes = torch.floor(xf * inv[..., None] + 0.5).clamp_(-INT8_MAX, INT8_MAX)
    return codes.to(torch.int8), a / top


def quantize(x: torch.Tensor, cache_dtype: torch.dtype, scale=1.0):
    """(the values a cache of ``cache_dtype`` stores for x [T, Hkv, D], their int8 scales
    [T, Hkv] or None)."""
    if cache_dtype == torch.int8:
        return quantize_int8(x)
    if cache_dtype in FP8:
        return quantize_fp8(x, cache_dtype, scale), None
    return x.to(cache_dtype), None


def dequantize(x: torch.Tensor, scale=1.0, token_scale: torch.Tensor | None = None):
    """float32 real values of cache rows x [..., Hkv, D] (an fp8 cache's per-head ``scale``,
    or an int8 cache's scales [..., Hkv] of the same rows)."""
    xf = x.float()
    if token_scale is not None:
        return xf * token_scale[..., None]
    if _is_unit(scale):
        return xf
    return xf * per_head(scale, x.shape[-2], x.device)[:, None]


def quantized_cache(cache: torch.Tensor, dtype: torch.dtype, scale=1.0):
    """A float cache [num_blocks, block_size, Hkv, D] as a cache of ``dtype`` (benchmarks,
    tests): (codes of the same shape, contiguous; int8 scale cache or None)."""
    nb, bs, h, d = cache.shape
    codes, s = quantize(cache.reshape(nb * bs, h, d), dtype, scale)
    return codes.view(nb, bs, h, d), None if s is None else s.view(nb, bs, h)
