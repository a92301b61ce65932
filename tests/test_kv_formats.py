"""The 8-bit KV caches (kernels/kv_quant.py) through every kernel that touches the cache,
against the pure-torch twins (kernels/reference.py): float8_e5m2, int8 with per-token,
per-head scale caches, and float8_e4m3fn with per-head scale tensors (the engine's form).
Under TRITON_INTERPRET=1 (no CUDA) on small and odd shapes; the `gpu` grid on CUDA.

Caches are built from float caches whose unowned slots are NaN (tests/test_kernels.py
make_batch), quantized on the host by the contract itself: an fp8 NaN stays NaN, an int8
row of NaN gets a NaN scale, so a kernel that reads a slot no sequence owns (or a scale of
one) makes a non-finite output. (The interpreter rounds float -> fp8 wrongly when a
mantissa carries into the exponent, see tests/test_kernels.py check_store: the fp8 stores
are checked on values the format holds exactly.)
"""
from __future__ import annotations

import pytest
import torch

from pagedq.kernels import kv_quant  # (no triton: before test_kernels sets the interpreter)
from tests.test_kernels import (
    BF,
    CTX,
    DEV,
    F32,
    FP8,
    GPU_CTX,
    HEADS,
    HF,
    INTERP,
    TOL,
    R,
    as_transposed,
    cpu,
    dec,
    make_batch,
    needs_cuda,
    poison,
    pre,
    relerr,
    rs,
    store,
    triton,
)

__all__ = ["poison"]  # the fixture, used by name
E5M2, I8 = torch.float8_e5m2, torch.int8
# (cache dtype, per-head scales?) of every 8-bit kind; e4m3 with tensors is the engine's
KINDS = [(E5M2, False), (I8, False), (FP8, True)]
KIND_IDS = ["e5m2", "int8", "e4m3-head-scales"]


def quantized_batch(ctx, qlens, hq, hkv, d, bs, dtype, kv_dtype, head_scales, v_t):
    """make_batch's float caches as caches of kv_dtype, and their scale keywords."""
    q, kc, vc, bt, lens, cu = make_batch(ctx, qlens, hq, hkv, d, bs, dtype, kv_dtype=F32)
    kq = {}
    if head_scales:  # per KV head, some below 1 (values scaled up), some above
        ks = torch.linspace(0.25, 3.0, hkv, device=DEV)
        vs = torch.linspace(2.0, 0.5, hkv, device=DEV)
        kq = dict(k_scale=ks, v_scale=vs)
    kc, ksc = kv_quant.quantized_cache(kc * 4, kv_dtype, kq.get("k_scale", 1.0))
    vc, vsc = kv_quant.quantized_cache(vc, kv_dtype, kq.get("v_scale", 1.0))
    if ksc is not None:
        kq = dict(k_scale_cache=ksc, v_scale_cache=vsc)
    if v_t:
        vc = as_transposed(vc)
    return q, kc, vc, bt, lens, cu, kq


def check_decode8(ctx, hq, hkv, d, bs, dtype, kv_dtype, head_scales=False, v_t=True,
                  **knobs):
    q, kc, vc, bt, lens, _, kq = quantized_batch(ctx, [1] * len(ctx), hq, hkv, d, bs, dtype,
                                                 kv_dtype, head_scales, v_t)
    ref = R.paged_decode_attention(q.float(), kc, vc, bt, lens, d ** -0.5, **kq)
    out = dec.decode_launch(q, kc, vc, bt, lens, d ** -0.5, **kq, **knobs)
    assert out.dtype == dtype and out.shape == q.shape
    assert relerr(out, ref) < TOL[dtype]
    return q, kc, vc, bt, lens, kq


def check_prefill8(ctx, qlens, hq, hkv, d, bs, dtype, kv_dtype, head_scales=False, v_t=True):
    q, kc, vc, bt, lens, cu, kq = quantized_batch(ctx, qlens, hq, hkv, d, bs, dtype, kv_dtype,
                                                  head_scales, v_t)
    ref = R.paged_attention(q.float(), kc, vc, bt, lens, cu, d ** -0.5, **kq)
    out = pre.paged_attention(q, kc, vc, bt, lens, cu, d ** -0.5, **kq)
    assert out.dtype == dtype and out.shape == q.shape
    assert relerr(out, ref) < TOL[dtype]


def bits(x):
    return x.view(torch.uint8) if x.element_size() == 1 else x


def empty_caches(nb, bs, hkv, d, kv_dtype, v_t):
    """Caches and scale caches filled with a pattern (1s; scale caches 7.0), so that a slot
    the store must not write shows its old contents."""
    kc = torch.ones(nb, bs, hkv, d, device=DEV).to(kv_dtype)
    vc = torch.ones(nb, bs, hkv, d, device=DEV).to(kv_dtype)
    if v_t:
        vc = as_transposed(vc)
    sc = {}
    if kv_dtype == I8:
        sc = dict(k_scale_cache=torch.full((nb, bs, hkv), 7.0, device=DEV),
                  v_scale_cache=torch.full((nb, bs, hkv), 7.0, device=DEV))
    return kc, vc, sc


def clone_caches(kc, vc, sc, v_t):
    return kc.clone(), as_transposed(vc) if v_t else vc.clone(), \
        {k: t.clone() for k, t in sc.items()}


def assert_same_caches(a, b):
    for x, y in zip(a[:2], b[:2], strict=True):
        assert torch.equal(bits(x), bits(y))
    for name in a[2]:
        assert torch.equal(a[2][name], b[2][name]), name


def exact_values(x, kv_dtype, scale):
    """x made of values an fp8 cache stores exactly after the division by scale (the
    interpreter's fp8 rounding is wrong; int8's floor is not)."""
    if kv_dtype == I8 or not INTERP:
        return x
    s = kv_quant.per_head(scale, x.shape[1], x.device).view(1, -1, 1)
    return ((x.float() / s).to(kv_dtype).float() * s).to(x.dtype)


def check_store8(T, hkv, d, bs, dtype, kv_dtype, head_scales=False, v_t=True, mul=1.0):
    """store_kvcache against the twin, bit for bit (codes and scale caches), slot -1 rows
    skipped, other slots untouched."""
    nb = triton.cdiv(T, bs) + 2
    kq = {}
    if head_scales:
        kq = dict(k_scale=torch.linspace(0.5, 2.0, hkv, device=DEV).pow(2).round(decimals=2),
                  v_scale=torch.full((hkv,), 0.25, device=DEV))
    qkv = (mul * torch.randn(T, (2 + 2 * hkv) * d, device=DEV)).to(dtype)
    key = qkv[:, 2 * d:(2 + hkv) * d].view(T, hkv, d)
    val = qkv[:, (2 + hkv) * d:].view(T, hkv, d)
    key = exact_values(key, kv_dtype, kq.get("k_scale", 1.0))
    val = exact_values(val, kv_dtype, kq.get("v_scale", 1.0))
    slots = torch.randperm(nb * bs, device=DEV)[:T]
    slots[::3] = -1
    kc, vc, sc = empty_caches(nb, bs, hkv, d, kv_dtype, v_t)
    twin = clone_caches(kc, vc, sc, v_t)
    store.store_kvcache(key, val, kc, vc, slots, **kq, **sc)
    R.store_kvcache(key, val, twin[0], twin[1], slots, **kq, **twin[2])
    assert_same_caches((kc, vc, sc), twin)
    untouched = torch.ones(nb * bs, dtype=torch.bool, device=DEV)
    untouched[slots[slots >= 0]] = False
    assert (bits(kc).reshape(nb * bs, -1)[untouched] == bits(torch.ones(
        1, dtype=kv_dtype, device=DEV))).all()
    return kc, vc, sc, slots, key, val


def check_rope_store8(T, hq, hkv, d, bs, dtype, kv_dtype, qk_norm, head_scales=False,
                      v_t=True):
    """The fused norm + rotary + store on views of one qkv buffer: its caches equal, bit for
    bit, what store_kvcache stores of its rotated k and of v; its rotated q/k and its
    caches' values are the twin's (up to the norm's summation order; fp8 under the
    interpreter: see the module doc)."""
    nb = triton.cdiv(T, bs) + 2
    cs = R.rotary_cos_sin(d, 4096, 10000.0).to(DEV)
    qkv = (2 * torch.randn(T, (hq + 2 * hkv) * d, device=DEV)).to(dtype)
    pos = torch.randint(0, 4096, (T,), device=DEV)
    slots = torch.randperm(nb * bs, device=DEV)[:T]
    slots[::3] = -1
    w = [(1 + 0.1 * torch.randn(d, device=DEV)).to(dtype) for _ in range(2)] if qk_norm \
        else [None, None]
    kq = dict(k_scale=torch.linspace(0.5, 4.0, hkv, device=DEV),
              v_scale=torch.full((hkv,), 0.25, device=DEV)) if head_scales else {}

    def views(buf):
        return (buf[:, :hq * d].view(T, hq, d), buf[:, hq * d:(hq + hkv) * d].view(T, hkv, d),
                buf[:, (hq + hkv) * d:].view(T, hkv, d))
    fused, unfused, twin = qkv.clone(), qkv.clone(), qkv.clone()
    base = empty_caches(nb, bs, hkv, d, kv_dtype, v_t)
    c1, c2, c3 = (clone_caches(*base, v_t) for _ in range(3))
    q, k, v = views(fused)
    qo, ko = rs.qk_norm_rope_store(q, k, v, pos, cs, c1[0], c1[1], slots, *w, 1e-6, **kq,
                                   **c1[2])
    assert torch.equal(fused[:, (hq + hkv) * d:], qkv[:, (hq + hkv) * d:])
    _, _, v2 = views(unfused)
    store.store_kvcache(ko.clone(), v2, c2[0], c2[1], slots, **kq, **c2[2])
    assert_same_caches(c1, c2)
    q3, k3, v3 = views(twin)
    q3, k3 = R.qk_norm_rope_store(q3, k3, v3, pos, cs, c3[0], c3[1], slots, *w, 1e-6, **kq,
                                  **c3[2])
    assert relerr(qo, q3.float()) < TOL[dtype] and relerr(ko, k3.float()) < TOL[dtype]
    if kv_dtype != I8 and INTERP:
        return
    keep = slots >= 0
    blk, off = slots[keep] // bs, slots[keep] % bs
    for c, t, s in ((c1[0], c3[0], "k_scale_cache"), (c1[1], c3[1], "v_scale_cache")):
        got = kv_quant.dequantize(c[blk, off], kq.get(s[:7], 1.0),
                                  c1[2][s][blk, off] if s in c1[2] else None)
        ref = kv_quant.dequantize(t[blk, off], kq.get(s[:7], 1.0),
                                  c3[2][s][blk, off] if s in c3[2] else None)
        assert relerr(got, ref) < 2e-2  # (a rotated value 1 ulp off may flip a code)


# ---------------------------------------------------------------- CPU, interpreter
@cpu
@pytest.mark.parametrize("kv_dtype,head_scales", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_decode_8bit_cpu(poison, kv_dtype, head_scales, splits):
    check_decode8(CTX, 8, 2, 64, 16, BF, kv_dtype, head_scales, num_splits=splits)
    check_decode8(CTX, 9, 3, 32, 8, HF, kv_dtype, head_scales, num_splits=splits)
    check_decode8([1, 3, 33], 4, 1, 16, 16, F32, kv_dtype, head_scales, v_t=False,
                  num_splits=splits)


@cpu
@pytest.mark.parametrize("kv_dtype,head_scales", KINDS, ids=KIND_IDS)
def test_decode_8bit_variants_and_order_cpu(poison, kv_dtype, head_scales):
    """swap (tokens as rows) on every 8-bit cache; rows in any launch order, bit for bit."""
    check_decode8(CTX, 8, 2, 64, 16, BF, kv_dtype, head_scales, variant="swap", num_splits=3)
    q, kc, vc, bt, lens, kq = check_decode8([9, 30, 1, 47], 8, 2, 32, 16, BF, kv_dtype,
                                            head_scales)
    plain = dec.decode_launch(q, kc, vc, bt, lens, 32 ** -0.5, num_splits=2, **kq)
    shuffled = torch.randperm(4, device=DEV).int()
    for order in (dec.longest_first(lens), shuffled):
        got = dec.decode_launch(q, kc, vc, bt, lens, 32 ** -0.5, order=order, num_splits=2,
                                **kq)
        assert torch.equal(got, plain)


@cpu
def test_swap8_takes_head_scale_tensors_and_refuses_other_8bit_caches(poison):
    check_decode8(CTX, 8, 2, 64, 16, BF, FP8, True, variant="swap8", num_splits=2)
    for kv_dtype in (E5M2, I8):
        q, kc, vc, bt, lens, _, kq = quantized_batch([5, 9], [1, 1], 4, 2, 32, 16, BF,
                                                     kv_dtype, False, True)
        with pytest.raises(ValueError, match="needs a float8_e4m3fn cache"):
            dec.decode_launch(q, kc, vc, bt, lens, 0.1, variant="swap8", **kq)


@cpu
@pytest.mark.parametrize("kv_dtype,head_scales", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("v_t", [True, False])
def test_prefill_8bit_cpu(poison, kv_dtype, head_scales, v_t):
    # prefill from 0, decode rows, chunked prefill over a cached prefix, an empty query
    check_prefill8([5, 21, 47, 3, 1, 70], [5, 1, 30, 0, 1, 2], 4, 2, 32, 16, HF, kv_dtype,
                   head_scales, v_t)
    check_prefill8([9, 30, 17], [9, 4, 17], 9, 3, 16, 8, BF, kv_dtype, head_scales, v_t)


@cpu
@pytest.mark.parametrize("kv_dtype,head_scales", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("v_t", [True, False])
def test_store_8bit_cpu(kv_dtype, head_scales, v_t):
    check_store8(11, 3, 32, 16, BF, kv_dtype, head_scales, v_t)
    check_store8(7, 2, 24, 8, F32, kv_dtype, head_scales, v_t)  # D not a power of 2


@cpu
def test_store_int8_rows_of_zeros_and_extremes():
    """A row of zeros stores code 0 with scale 0 (no 0/0); the largest |x| of a row is
    +-127; a row's scale is its max |x| / 127."""
    kc, vc, sc, slots, key, val = check_store8(6, 2, 32, 16, F32, I8, mul=50.0)
    kc2, vc2, sc2 = empty_caches(3, 16, 2, 32, I8, False)
    x = torch.zeros(2, 2, 32, device=DEV)
    x[1, 0, 5], x[1, 1] = -3.0, torch.linspace(-1, 2, 32)
    store.store_kvcache(x, x, kc2, vc2, torch.tensor([4, 9], device=DEV), **sc2)
    assert (kc2[0, 4] == 0).all() and (sc2["k_scale_cache"][0, 4] == 0).all()
    assert kc2[0, 9, 0, 5] == -127 and kc2[0, 9, 1, -1] == 127
    assert torch.allclose(sc2["v_scale_cache"][0, 9], torch.tensor([3 / 127, 2 / 127]))


@cpu
@pytest.mark.parametrize("kv_dtype", [FP8, E5M2])
def test_fp8_stores_saturate(kv_dtype):
    """Values past the format's largest (448, 57,344; after the scale) store that value,
    never NaN or inf, in the kernels and the twin alike."""
    top = kv_quant.FP8_MAX[kv_dtype]
    kc, vc, sc = empty_caches(2, 8, 2, 16, kv_dtype, True)
    x = torch.full((3, 2, 16), 2 * top, device=DEV)
    x[1] = -4 * top
    slots = torch.tensor([0, 5, 9], device=DEV)
    store.store_kvcache(x, x, kc, vc, slots)
    twin = clone_caches(*empty_caches(2, 8, 2, 16, kv_dtype, True), True)
    R.store_kvcache(x, x, twin[0], twin[1], slots)
    assert_same_caches((kc, vc, sc), twin)
    got = kc.float().view(16, 2, 16)[slots]
    assert (got[0] == top).all() and (got[1] == -top).all()
    k_inv = torch.tensor([0.5, 2.0], device=DEV)  # with scales: 2 * top / 0.5 saturates too
    store.store_kvcache(x, x, kc, vc, slots, k_scale=k_inv, v_scale=1.0)
    assert (kc.float().view(16, 2, 16)[slots[0]] == top).all()


@cpu
@pytest.mark.parametrize("kv_dtype,head_scales", KINDS, ids=KIND_IDS)
@pytest.mark.parametrize("qk_norm", [True, False])
def test_rope_store_8bit_cpu(kv_dtype, head_scales, qk_norm):
    check_rope_store8(9, 4, 2, 32, 8, F32, kv_dtype, qk_norm, head_scales)
    check_rope_store8(6, 3, 3, 16, 4, BF, kv_dtype, qk_norm, head_scales, v_t=False)


def test_scale_arguments_are_checked():
    q, kc, vc, bt, lens, cu, kq = quantized_batch([5, 9], [1, 1], 4, 2, 32, 16, F32, I8,
                                                  False, True)
    _, k8, v8, *_ = quantized_batch([5, 9], [1, 1], 4, 2, 32, 16, F32, FP8, False, True)
    s = 32 ** -0.5
    good = torch.ones(2, device=DEV)
    bad_calls = [
        lambda: dec.paged_decode_attention(q, kc, vc, bt, lens, s),  # int8 without scales
        lambda: dec.paged_decode_attention(q, kc, vc, bt, lens, s, k_scale=2.0, **kq),
        lambda: dec.paged_decode_attention(q, kc, vc, bt, lens, s, k_scale_cache=kq[
            "k_scale_cache"], v_scale_cache=kq["v_scale_cache"][:, :, :1]),
        lambda: dec.paged_decode_attention(q, k8, v8, bt, lens, s, **kq),  # on an fp8 cache
        lambda: dec.paged_decode_attention(q, k8, v8, bt, lens, s, k_scale=torch.ones(3)),
        lambda: dec.paged_decode_attention(q, k8, v8, bt, lens, s, v_scale=good.double()),
        lambda: pre.paged_attention(q, k8, v8, bt, lens, cu, s, k_scale=-1.0),
        lambda: pre.paged_attention(q, kc.float(), vc.float(), bt, lens, cu, s, k_scale=good),
        lambda: store.store_kvcache(q[:, :2], q[:, :2], kc, vc, torch.zeros(2).long()),
        lambda: rs.qk_norm_rope_store(q, q[:, :2], q[:, 2:], torch.zeros(2).long(),
                                      torch.ones(64, 32), k8, v8, torch.zeros(2).long(), None,
                                      None, 0.0, k_scale=0.0),
    ]
    for i, call in enumerate(bad_calls):
        with pytest.raises(ValueError):
            call()
            pytest.fail(f"bad call {i} did not raise")


# ---------------------------------------------------------------- GPU grid
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("kv_dtype,head_scales", KINDS, ids=KIND_IDS)
def test_8bit_caches_gpu(poison, kv_dtype, head_scales):
    """Every GQA shape, split and single, the engine's layout (V transposed) and
    token-major; a batch of uneven contexts; prefill; the stores."""
    for hq, hkv, d in HEADS:
        check_decode8(GPU_CTX, hq, hkv, d, 16, BF, kv_dtype, head_scales)
        check_decode8(GPU_CTX, hq, hkv, d, 16, HF, kv_dtype, head_scales, num_splits=1)
    check_decode8(GPU_CTX, 16, 8, 128, 16, BF, kv_dtype, head_scales, v_t=False)
    ctx = torch.randint(1, 4097, (64,)).tolist()
    check_decode8(ctx, 16, 8, 128, 16, BF, kv_dtype, head_scales)
    check_decode8(ctx, 16, 8, 128, 32, BF, kv_dtype, head_scales, num_splits=5)
    check_prefill8([1000, 300, 4077, 1, 642], [1, 300, 77, 1, 513], 16, 8, 128, 16, BF,
                   kv_dtype, head_scales)
    check_store8(1000, 8, 128, 16, BF, kv_dtype, head_scales)
    check_store8(77, 3, 64, 32, F32, kv_dtype, head_scales, v_t=False)
    for qk_norm in (True, False):
        check_rope_store8(300, 16, 8, 128, 16, BF, kv_dtype, qk_norm, head_scales)
