"""The few-rows quantized GEMM (kernels/quant_decode.py, kernels/quant_rows.py) against its twin
(kernels/reference.py). Without CUDA the kernels run under TRITON_INTERPRET=1 on small
shapes (set before the kernel modules are imported, as in tests/test_quant_kernels.py);
with CUDA the same cases run on the GPU, CUDA graphs included."""
from __future__ import annotations

import pytest
import torch

from tests.interpreted import CUDA, DEV, interpreted  # first: sets the interpreter up

# isort: split
import pagedq.kernels.quant_decode as qd
import pagedq.kernels.quant_matmul as qm
import pagedq.kernels.quant_rows as qr
from pagedq.kernels import reference
from tests.test_quant_kernels import TOL, make_weight, relerr

interpreted((qd, "_decode_kernel"), (qr, "_rows_kernel"), (qm, "_qmm_kernel"))

FORMATS = [  # (bits, group, zero_point, offsets dtype, act-order, bias)
    (4, 32, 8, None, False, False),  # GGUF Q4_0 / GPTQ sym g32
    (4, 32, 0, torch.float16, False, True),  # GGUF Q4_1
    (4, 128, 0, torch.float32, False, False),  # AWQ / GPTQ asym g128
    (4, 64, 8, None, True, True),  # GPTQ act-order g64
    (4, 128, 8, None, False, False),  # GPTQ sym g128 (a K tile in one group)
    (8, 32, 128, None, False, False),  # GGUF Q8_0
    (8, 128, 0, torch.float32, True, False),  # GPTQ 8-bit asym, act-order
]


def check(m, k, n, bits, group, zp, odt, perm, bias, dtype, plan=None, seed=0):
    q, s, o, p = make_weight(k, n, bits, group, zp, odt, perm, seed=seed)
    x = torch.randn(m, k, device=DEV).to(dtype)
    b = torch.randn(n, device=DEV).to(dtype) if bias else None
    ref = reference.quant_matmul(x, q, s, o, bits, group, zp, b, p)
    got = qd.decode_matmul(x, q, s, o, bits, group, zp, b, p, plan)
    assert got.dtype == dtype and got.shape == (m, n)
    assert relerr(got, ref) < TOL[dtype], (plan, dtype, relerr(got, ref))
    return got


@pytest.mark.parametrize("bits,group,zp,odt,perm,bias", FORMATS)
@pytest.mark.parametrize("m", [1, 3, 16])
def test_every_format_matches_the_twin(bits, group, zp, odt, perm, bias, m):
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        check(m, 384, 200, bits, group, zp, odt, perm, bias, dtype, seed=m)


@pytest.mark.parametrize("bits,group,zp,odt,perm,bias", FORMATS)
def test_the_rows_gemv_matches_the_twin(bits, group, zp, odt, perm, bias):
    """The GEMV plans at 2..8 rows (kernels/quant_rows.py): every format, split or not."""
    for m, plan, dtype in ((2, qd.Plan(False, 128, 1, 3), torch.bfloat16),
                           (5, qd.Plan(False, 256, 1, 0, warps=2), torch.float16),
                           (8, qd.Plan(False, 64, 1, 2, prefetch=False), torch.bfloat16)):
        check(m, 384, 200, bits, group, zp, odt, perm, bias, dtype, plan, seed=m)


PLANS = [qd.Plan(False, 128, 4, 3), qd.Plan(False, 256, 8, 0, warps=2),
         qd.Plan(False, 512, 16, 1, prefetch=False), qd.Plan(True, 32, 16, 2),
         qd.Plan(True, 64, 32, 0, prefetch=False), qd.Plan(True, 128, 16, 5, warps=8)]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: p.name)
@pytest.mark.parametrize("group", [32, 64, 128])
def test_ragged_shapes_and_splits(plan, group):
    """K not a multiple of the tile (a short last tile and group), N of one to three column
    tiles with a ragged last one, splits that leave the last short or that exceed the K
    tiles: every plan equals the twin."""
    m = 1 if not plan.dot else 7
    for k, n in ((72, 5), (328, plan.block_n * 2 + 17), (520, plan.block_n * 3)):
        for bits, zp in ((4, 8), (8, 128)):
            if group % (32 // bits) or k % (32 // bits):
                continue
            check(m, k, n, bits, group, zp, None, group == 64, False, torch.bfloat16, plan)


@pytest.mark.parametrize("plan", [qd.Plan(False, 64, 1, 0, prefetch=False),
                                  qd.Plan(False, 128, 1, 3)], ids=lambda p: p.name)
def test_the_rows_gemv_on_ragged_shapes(plan):
    """The rows GEMV where K ends inside a tile and a group, N is 1-3 column tiles with a
    ragged last one, and the splits leave the last short (group 64, act-order or not)."""
    for k, n in ((72, 5), (328, plan.block_n * 2 + 17)):
        for bits, zp in ((4, 8), (8, 128)):
            for perm in (True, False):
                check(3, k, n, bits, 64, zp, None, perm, False, torch.bfloat16, plan)


def test_split_counters_return_to_zero_and_results_repeat():
    """The last program of each column tile resets its counter: the counters are 0 after
    every launch, and the same call gives bit-identical results (the partials are summed in
    split order whichever program arrives last)."""
    plan = qd.Plan(False, 128, 4, 6)
    q, s, o, p = make_weight(768, 300, 4, 32, 8, None, False)
    x = torch.randn(1, 768, device=DEV).half()
    first = qd.decode_matmul(x, q, s, o, 4, 32, 8, p=plan)
    for _ in range(3):
        assert torch.equal(qd.decode_matmul(x, q, s, o, 4, 32, 8, p=plan), first)
    assert int(qd._COUNTERS[x.device].count_nonzero()) == 0


def test_quant_matmul_sends_few_rows_here_and_plans_fill_the_gpu():
    sms = 132  # an H200
    assert not qd.plan(1, 28672, 4096, 4, sms).dot and qd.plan(8, 4096, 4096, 4, sms).dot
    one = qd.plan(1, 4096, 4096, 4, sms)
    tiles = -(-4096 // one.block_n)
    assert one.splits > 1 and tiles * one.splits >= sms
    k_tiles = 4096 // 8 // one.kp
    assert k_tiles // one.splits >= qd.MIN_TILES_PER_SPLIT
    assert qd.serves(1, 4, 32) and qd.serves(qd.MAX_ROWS, 8, 4)
    assert not qd.serves(qd.MAX_ROWS + 1, 4, 32)
    assert not qd.serves(1, 4, 36)  # a word's 8 codes would straddle two groups
    q, s, o, _ = make_weight(64, 16, 4, 32, 8, None, False)
    x = torch.randn(1, 64, device=DEV)
    ref = reference.quant_matmul(x, q, s, o, 4, 32, 8)
    assert relerr(qm.quant_matmul(x, q, s, o, 4, 32, 8), ref) < TOL[torch.float32]
    with pytest.raises(ValueError, match="kp >= 16"):
        qd.decode_matmul(x.expand(2, 64), q, s, o, 4, 32, 8, p=qd.Plan(True, 32, 8, 1))
    with pytest.raises(ValueError, match="kp 1"):
        qd.decode_matmul(x.expand(3, 64), q, s, o, 4, 32, 8, p=qd.Plan(False, 32, 4, 1))
    with pytest.raises(ValueError, match="1 to 8 rows"):
        qd.decode_matmul(x.expand(9, 64), q, s, o, 4, 32, 8, p=qd.Plan(False, 32, 8, 1))


def test_unaligned_x_takes_the_one_by_one_loads():
    """A 16-bit x that starts 2 bytes off a 4-byte boundary cannot be read in pairs."""
    q, s, o, _ = make_weight(256, 40, 4, 32, 8, None, False)
    base = torch.randn(257, device=DEV).to(torch.bfloat16)
    x = base[1:].view(1, 256)
    assert x.data_ptr() % 4 == 2
    ref = reference.quant_matmul(x, q, s, o, 4, 32, 8)
    assert relerr(qd.decode_matmul(x, q, s, o, 4, 32, 8), ref) < TOL[torch.bfloat16]


@pytest.mark.skipif(not CUDA, reason="CUDA graphs need a GPU")
@pytest.mark.gpu
def test_in_a_cuda_graph_across_replays():
    """Captured once, replayed with new x: the counters keep their address and reset."""
    q, s, o, _ = make_weight(4096, 1024, 4, 128, 8, None, False)
    x = torch.randn(1, 4096, device="cuda").bfloat16()
    qd.decode_matmul(x, q, s, o, 4, 128, 8)  # compile outside the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = qd.decode_matmul(x, q, s, o, 4, 128, 8)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        g.replay()
        torch.cuda.synchronize()
        ref = reference.quant_matmul(x, q, s, o, 4, 128, 8)
        assert relerr(y, ref) < TOL[torch.bfloat16]
