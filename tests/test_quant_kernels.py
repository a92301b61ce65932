"""The quantized GEMM (kernels/quant_matmul.py) against its twin (kernels/reference.py), and
the layout helpers (kernels/quant_layout.py). Without CUDA the kernels run under
TRITON_INTERPRET=1 on small shapes (set before the kernel module is imported, as in
tests/test_kernels.py); with CUDA the same cases run on the GPU."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.interpreted import DEV, interpreted  # first: sets the interpreter up

# isort: split
import pagedq.kernels.quant_matmul as qm
from pagedq.kernels import cpu, quant_layout, reference

interpreted((qm, "_qmm_kernel"))
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}


def make_weight(k, n, bits=4, group=32, zero_point=8, offsets=None, perm=False, seed=0,
                device=DEV):
    """Random codes, scales (and offsets) in the layout: (qweight, scales, offsets, perm)."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 1 << bits, (k, n), generator=g)
    groups = -(-k // group)
    scales = (torch.rand(groups, n, generator=g) * 0.02 + 0.001).half()
    offs = None
    if offsets is not None:
        offs = (torch.randn(groups, n, generator=g) * 0.05).to(offsets)
    p = torch.randperm(k, generator=g).to(torch.int32) if perm else None
    put = (lambda t: None if t is None else t.to(device))
    return put(quant_layout.pack_codes(codes, bits)), put(scales), put(offs), put(p)


def relerr(out, ref):
    out, ref = out.double(), ref.double()
    assert torch.isfinite(out).all(), "non-finite output"
    return ((out - ref).norm() / ref.norm()).item()


def test_pack_unpack_round_trip_and_bit_order():
    codes = torch.randint(0, 16, (64, 5))
    q = quant_layout.pack_codes(codes, 4)
    assert q.dtype == torch.int32 and q.shape == (8, 5)
    assert torch.equal(quant_layout.unpack_codes(q, 4), codes)
    # code k of a word sits at bits 4k..4k+3, the top nibble in the sign bit
    one = torch.tensor([[1], [2], [3], [4], [5], [6], [7], [15]])
    assert quant_layout.pack_codes(one, 4).item() == (0xF7654321 - (1 << 32))
    c8 = torch.randint(0, 256, (8, 3))
    assert torch.equal(quant_layout.unpack_codes(quant_layout.pack_codes(c8, 8), 8), c8)


def test_dequantize_is_the_formula():
    codes = torch.tensor([[0, 15], [7, 8], [1, 2], [3, 4], [5, 6], [9, 10], [11, 12], [13, 14]])
    s = torch.tensor([[0.5, 2.0]], dtype=torch.float16)
    o = torch.tensor([[1.0, -1.0]], dtype=torch.float32)
    w = quant_layout.dequantize(quant_layout.pack_codes(codes, 4), s, o, 4, 8, 0)
    assert torch.equal(w, codes.float() * s.float() + o)
    w = quant_layout.dequantize(quant_layout.pack_codes(codes, 4), s, None, 4, 8, 8)
    assert torch.equal(w, (codes - 8).float() * s.float())


CASES = [  # (bits, group, zero_point, offsets dtype, perm, bias)
    (4, 32, 8, None, False, False),  # GGUF Q4_0 / GPTQ sym
    (4, 32, 0, torch.float16, False, True),  # GGUF Q4_1
    (4, 128, 0, torch.float32, False, False),  # AWQ / GPTQ asym
    (4, 64, 8, None, True, True),  # GPTQ act-order
    (8, 32, 128, None, False, False),  # GGUF Q8_0
    (8, 64, 0, torch.float32, True, False),  # GPTQ 8-bit asym, act-order
]


@pytest.mark.parametrize("bits,group,zp,odt,perm,bias", CASES)
@pytest.mark.parametrize("m", [1, 5, 40])
def test_quant_matmul_matches_twin(bits, group, zp, odt, perm, bias, m):
    k, n = 256, 96
    q, s, o, p = make_weight(k, n, bits, group, zp, odt, perm, seed=m)
    for dtype in (torch.float32, torch.bfloat16) if m == 5 else (torch.float16,):
        x = torch.randn(m, k, device=DEV).to(dtype)
        b = torch.randn(n, device=DEV).to(dtype) if bias else None
        ref = reference.quant_matmul(x, q, s, o, bits, group, zp, b, p)
        got = qm.quant_matmul(x, q, s, o, bits, group, zp, b, p)
        assert got.dtype == dtype and got.shape == (m, n)
        assert relerr(got, ref) < TOL[dtype], (dtype, relerr(got, ref))


VARIANTS = [qm.Config(16, 32, 64, unpack=u, magic=g) for u in (0, 1) for g in (0, 1)] + [
    qm.Config(16, 64, 128, split=4), qm.Config(32, 32, 32, split=3, unpack=1),
    qm.Config(64, 32, 64, split=1), qm.Config(16, 32, 256, split=2),
    qm.Config(16, 32, 256, split=2, unpack=1), qm.Config(16, 32, 128, unpack=2),
    qm.Config(16, 64, 256, split=2, unpack=2, magic=0), qm.Config(32, 32, 128, split=1, unpack=2),
    qm.Config(16, 32, 64, unpack=2)]  # the last: BLOCK_K too small for 4-bit, runs unpack 0


@pytest.mark.parametrize("cfg", VARIANTS, ids=lambda c: c.name)
@pytest.mark.parametrize("group", [32, 128, 160])
def test_every_variant_and_ragged_shapes(cfg, group):
    """Uneven K (a partial last K tile and group), N not a multiple of the tile, splits
    that leave the last one short: every variant of the kernel matches the twin."""
    k, n, m = 320, 72, 7
    if not qm.fit_block_k(cfg.block_k, group):
        pytest.skip("no tile fits")
    q, s, o, p = make_weight(k, n, 4, group, 0, torch.float32, perm=group == 128)
    x = torch.randn(m, k, device=DEV).half()
    cfg = qm.fitted(cfg, m, n, k, group, 8)
    ref = reference.quant_matmul(x, q, s, o, 4, group, 0, None, p)
    got = qm.quant_matmul(x, q, s, o, 4, group, 0, None, p, config=cfg)
    assert relerr(got, ref) < TOL[torch.float16], cfg


def test_decode_rows_split_k_and_prefill_rows_do_not():
    sms = 132  # an H200
    dec = qm.choose(1, 4096, 4096, 128, sms)
    assert dec.block_m == 16 and dec.split > 1 and 4096 % (dec.block_k * dec.split) == 0
    pre = qm.choose(512, 4096, 4096, 128, sms)
    assert pre.block_m == 128 and pre.split == 1
    assert qm.choose(1, 4096, 576, 32, sms).block_k in (32, 64, 128, 256)
    with pytest.raises(ValueError, match="group_size 24"):
        qm.choose(1, 64, 96, 24, sms)
    # a measured table (bench/quant.py) wins for its rows' bucket, its split refitted
    tuned = qm.Config(16, 128, 128, warps=8)
    qm.TUNED[(8, 4096, 4096)] = tuned
    try:
        got = qm.choose(5, 4096, 4096, 128, sms)
        assert (got.block_n, got.warps, got.split) == (128, 8, 8)  # 4 K tiles per split
        assert qm.choose(9, 4096, 4096, 128, sms).block_n == 64  # bucket 32: not tuned
    finally:
        qm.TUNED.clear()


def test_dequantize_kernel_and_dense_path():
    k, n = 192, 80
    q, s, o, p = make_weight(k, n, 4, 64, 0, torch.float16, perm=True)
    w = qm.dequantize(q, s, o, 4, 64, 0, torch.float32)
    assert torch.equal(w, quant_layout.dequantize(q, s, o, 4, 64, 0))
    x = torch.randn(9, k, device=DEV).half()
    b = torch.randn(n, device=DEV).half()
    ref = reference.quant_matmul(x, q, s, o, 4, 64, 0, b, p)
    assert relerr(qm.dense_matmul(x, q, s, o, 4, 64, 0, b, p), ref) < TOL[torch.float16]


def test_bad_arguments_are_clear_errors():
    q, s, o, _ = make_weight(64, 16)
    x = torch.randn(2, 64, device=DEV)
    with pytest.raises(ValueError, match="scales must be"):
        qm.quant_matmul(x, q, s[:1], None, 4, 32, 8)
    with pytest.raises(ValueError, match=r"x must be .*\[M, 64\]"):
        qm.quant_matmul(x[:, :32], q, s, None, 4, 32, 8)
    with pytest.raises(ValueError, match="bits must be 4 or 8"):
        qm.quant_matmul(x, q, s, None, 3, 32, 8)
    assert qm.quant_matmul(x[:0], q, s, None, 4, 32, 8).shape == (0, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_path_computes_what_the_dequantized_layer_does(dtype):
    """kernels/cpu.py: bit for bit F.linear over W rounded to the model's dtype (what a
    model holding the dequantized weights computes), act-order included."""
    k, n = 128, 48
    q, s, o, p = make_weight(k, n, 4, 32, 0, torch.float32, perm=True, device="cpu")
    x = torch.randn(3, k).to(dtype)
    b = torch.randn(n).to(dtype)
    w = quant_layout.dequantize(q, s, o, 4, 32, 0)  # rows in W's (permuted) order
    dense = torch.empty_like(w)
    dense[p.long()] = w  # the checkpoint's row order
    want = F.linear(x, dense.t().to(dtype).contiguous(), b)
    assert torch.equal(cpu.quant_matmul(x, q, s, o, 4, 32, 0, b, p), want)
    ref = reference.quant_matmul(x, q, s, o, 4, 32, 0, b, p)
    assert relerr(want, ref) < TOL[dtype]


@pytest.mark.parametrize("bits,group,zp", [(8, 32, 128), (4, 64, 8), (8, 128, 0)])
def test_interleaved_tiles_for_both_widths(bits, group, zp):
    """UNPACK 2 (P dots over a tile's interleaved codes) for 8-bit and 4-bit codes, with and
    without offsets and act-order, equals the twin."""
    k, n, m = 256, 48, 5
    offs = torch.float16 if zp == 0 else None
    q, s, o, p = make_weight(k, n, bits, group, zp, offs, perm=bits == 8, seed=3)
    x = torch.randn(m, k, device=DEV).half()
    ref = reference.quant_matmul(x, q, s, o, bits, group, zp, None, p)
    cfg = qm.fitted(qm.Config(16, 32, 16 * 32 // bits, unpack=2), m, n, k, group, 8)
    assert qm.interleaves(cfg.block_k, bits, group)
    got = qm.quant_matmul(x, q, s, o, bits, group, zp, None, p, config=cfg)
    assert relerr(got, ref) < TOL[torch.float16], cfg
