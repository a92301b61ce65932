"""The decode kernel's variants (kernels/decode_attention.py VARIANTS, kernels/decode_tile.py)
against the reference twin, as tests/test_kernels.py checks the default one: "swap" (tokens
as the dots' rows) on every cache, "swap8" (e4m3 dots, q and p split in two e4m3 terms) on
the engine's fp8 cache. Under TRITON_INTERPRET=1 (no CUDA) swap8's dots run on the same e4m3
terms in fp32. Also: the variant a process runs (DEFAULTS, use_variant) and its errors."""
from __future__ import annotations

import pytest
import torch

from tests.test_kernels import (
    BF,
    CTX,
    DEV,
    F32,
    FP8,
    GPU_CTX,
    HEADS,
    HF,
    TOL,
    check_decode,
    check_decode_order,
    cpu,
    dec,
    make_batch,
    needs_cuda,
    poison,
)

__all__ = ["poison"]  # the fixture, used by name


@cpu
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_swap_cpu(poison, splits):
    check_decode(CTX, 8, 2, 64, 16, F32, variant="swap", num_splits=splits)
    check_decode(CTX, 9, 3, 64, 16, BF, variant="swap", num_splits=splits, block_n=32)
    check_decode(CTX, 8, 2, 64, 16, BF, kv_dtype=FP8, ks=0.5, vs=2.0, v_t=True,
                 variant="swap", num_splits=splits)


@cpu
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_swap8_cpu(poison, splits):
    """The engine's fp8 layout; NaN past each sequence's end in its last block."""
    check_decode(CTX, 8, 2, 64, 16, BF, kv_dtype=FP8, ks=0.5, vs=2.0, v_t=True,
                 variant="swap8", num_splits=splits)
    # swap8's q and p carry about 8 significant bits (two e4m3 terms): bf16's precision,
    # whatever q's dtype (fp16's bound failed about once in 40 draws: relerr 1.7-3.0e-3)
    check_decode(CTX, 16, 2, 32, 8, HF, kv_dtype=FP8, v_t=True, variant="swap8",
                 num_splits=splits, block_n=32, tol=TOL[BF])


@cpu
def test_variants_order_cpu(poison):
    check_decode_order([40, 1, 100, 17, 16, 15], 4, 2, 32, 16, F32, variant="swap")
    check_decode_order([9, 30, 1, 47], 8, 2, 64, 16, BF, kv_dtype=FP8, v_t=True,
                       variant="swap8")


@cpu
@pytest.mark.parametrize("q_mul,ks", [(1e-3, 1e3), (2e3, 5e-4)])
def test_swap8_scales_q_rows(poison, q_mul, ks):
    """q far below e4m3's normal range or above its 448, with k_scale making up for it (the
    scores stay O(1)): each q row is scaled before its split, so neither underflows nor
    saturates."""
    check_decode(CTX, 8, 2, 64, 16, BF, kv_dtype=FP8, ks=ks, vs=2.0, v_t=True, variant="swap8",
                 q_mul=q_mul)


def test_parse_variant_and_defaults(monkeypatch):
    assert dict(dec.parse_variant("swap8:w=4,bn=128,st=3,sm=8,splits=2")) == dict(
        variant="swap8", num_warps=4, block_n=128, num_stages=3, per_sm=8, num_splits=2)
    assert dict(dec.parse_variant("tile")) == {"variant": "tile"}
    for bad in ("nope", "swap:w=0", "swap:warps=4", "swap:w", "swap:w=x", "tile:bn=-1"):
        with pytest.raises(ValueError, match="decode variant"):
            dec.parse_variant(bad)
    with pytest.raises(ValueError, match="cache kind"):
        dec.use_variant("int4", "swap")
    monkeypatch.setitem(dec.DEFAULTS, "fp8", "tile")
    dec.use_variant("fp8", "swap8:bn=32")
    assert dec.DEFAULTS["fp8"] == "swap8:bn=32"


@cpu
def test_paged_decode_attention_runs_the_default_variant(monkeypatch):
    q, kc, vc, bt, lens, _ = make_batch([9, 30, 47], [1, 1, 1], 8, 2, 32, 16, BF,
                                        kv_dtype=FP8, v_t=True)
    s = 32 ** -0.5
    monkeypatch.setitem(dec.DEFAULTS, "fp8", "swap8:bn=32,splits=2")
    got = dec.paged_decode_attention(q, kc, vc, bt, lens, s)
    assert torch.equal(got, dec.decode_launch(q, kc, vc, bt, lens, s, variant="swap8",
                                              block_n=32, num_splits=2))
    assert not torch.equal(got, dec.decode_launch(q, kc, vc, bt, lens, s, block_n=32,
                                                  num_splits=2))


def test_variant_errors():
    q, kc, vc, bt, lens, _ = make_batch([5, 9], [1, 1], 4, 2, 32, 16, BF, "cpu")
    s = 32 ** -0.5
    if torch.cuda.is_available():  # the GPU's fp16 form of swap on an fp8 cache is refused
        q8, k8, v8, bt8, lens8, _ = make_batch([5, 9], [1, 1], 4, 2, 32, 16, BF,
                                               kv_dtype=FP8, v_t=True)
        with pytest.raises(ValueError, match="use swap8 or tile"):
            dec.decode_launch(q8, k8, v8, bt8, lens8, s, variant="swap")
    for caches, kw in (((kc, vc), dict(variant="mma9")),
                       ((kc, vc), dict(variant="swap8")),  # a bf16 cache
                       ((kc.to(FP8), vc.to(FP8)), dict(variant="swap8", block_n=16))):
        with pytest.raises(ValueError, match="paged_decode_attention: variant"):
            dec.decode_launch(q, *caches, bt, lens, s, **kw)


# ---------------------------------------------------------------- GPU grid
@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("hq,hkv,d", HEADS)
def test_variants_gpu(poison, hq, hkv, d):
    """Every GQA shape, split and single, through each variant's default knobs."""
    for splits in (None, 1):
        check_decode(GPU_CTX, hq, hkv, d, 16, BF, variant="swap", num_splits=splits)
        check_decode(GPU_CTX, hq, hkv, d, 16, HF, kv_dtype=FP8, ks=0.5, vs=2.0, v_t=True,
                     variant="swap8", num_splits=splits, tol=TOL[BF])  # (test_swap8_cpu)


@pytest.mark.gpu
@needs_cuda
def test_variants_gpu_batch(poison):
    ctx = torch.randint(1, 4097, (64,)).tolist()
    for knobs in (dict(), dict(block_n=128), dict(num_stages=4), dict(num_warps=8)):
        check_decode(ctx, 16, 8, 128, 16, BF, kv_dtype=FP8, v_t=True, variant="swap8",
                     **knobs)
        check_decode(ctx, 16, 8, 128, 16, BF, variant="swap", **knobs)
    check_decode_order(ctx, 16, 8, 128, 16, BF, kv_dtype=FP8, v_t=True, splits=(1, None),
                       variant="swap8")
    check_decode_order(ctx, 16, 8, 128, 16, BF, splits=(1, None), variant="swap")
    assert DEV == "cuda"
