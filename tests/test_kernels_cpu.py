"""kernels/cpu.py (what the engine runs on CPU tensors) against the twins of
kernels/reference.py on the same inputs. Caches are scrambled and every slot no sequence
owns is NaN, so a read of a key past a sequence's length, or through a block-table entry
it does not use, shows up as a non-finite output."""
from __future__ import annotations

import itertools

import pytest
import torch

from pagedq.engine.layers import ops
from pagedq.kernels import cpu as C
from pagedq.kernels import kv_quant
from pagedq.kernels import reference as R
from pagedq.kernels.layout import transposed_view

F32, BF, FP8 = torch.float32, torch.bfloat16, torch.float8_e4m3fn
E5M2, I8 = torch.float8_e5m2, torch.int8


def paged_batch(ctx, qlens, hq, hkv, d, bs, dtype=F32, kv_dtype=None, seed=0):
    """(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q): blocks in a random
    order, tables padded with -1 and two spare columns, unowned slots NaN (fp8: 0x7F)."""
    g = torch.Generator().manual_seed(seed)
    kv_dtype = kv_dtype or dtype
    nblk = [-(-n // bs) for n in ctx]
    nb = sum(nblk) + 3
    kc, vc = (torch.randn(nb, bs, hkv, d, generator=g).to(kv_dtype) for _ in range(2))
    perm = torch.randperm(nb, generator=g)
    bt = torch.full((len(ctx), max(nblk) + 2), -1, dtype=torch.int32)
    owned = torch.zeros(nb * bs, dtype=torch.bool)
    i = 0
    for b, (n, k) in enumerate(zip(ctx, nblk, strict=True)):
        bt[b, :k] = perm[i:i + k].int()
        i += k
        tok = torch.arange(n)
        owned[bt[b, tok // bs].long() * bs + tok % bs] = True
    for c in (kc, vc):
        if kv_dtype == FP8:
            c.view(torch.uint8).view(nb * bs, hkv, d)[~owned] = 0x7F  # e4m3fn NaN
        else:
            c.view(nb * bs, hkv, d)[~owned] = float("nan")
    cu = torch.tensor([0] + list(itertools.accumulate(qlens)), dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=g).to(dtype)
    return q, kc, vc, bt, torch.tensor(ctx, dtype=torch.int32), cu


def assert_matches(out, ref, dtype):
    assert out.dtype == ref.dtype and out.shape == ref.shape
    assert torch.isfinite(out.float()).all(), "read a key it must not"
    tol = 1e-5 if dtype == F32 else 1e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


# (context lengths, query lengths): decode only, mixed, uneven prefills (one group each),
# chunked prefill over a cached prefix, one sequence
CASES = [
    ([1, 17, 33, 5, 64, 16], [1] * 6),
    ([40, 20, 50, 7], [40, 1, 3, 1]),
    ([300, 9, 12], [300, 2, 1]),
    ([70, 45], [6, 45]),
    ([23], [23]),
]


@pytest.mark.parametrize("ctx,qlens", CASES)
@pytest.mark.parametrize("hq,hkv,bs", [(9, 3, 16), (4, 4, 8), (8, 2, 32)])
def test_paged_attention_matches_twin(ctx, qlens, hq, hkv, bs):
    q, kc, vc, bt, lens, cu = paged_batch(ctx, qlens, hq, hkv, 64, bs)
    ref = R.paged_attention(q, kc, vc, bt, lens, cu, 0.125)
    assert_matches(C.paged_attention(q, kc, vc, bt, lens, cu, 0.125), ref, F32)
    if all(n == 1 for n in qlens):
        assert_matches(C.paged_decode_attention(q, kc, vc, bt, lens, 0.125), ref, F32)


@pytest.mark.parametrize("dtype,kv_dtype", [(BF, BF), (F32, FP8), (BF, FP8)])
@pytest.mark.parametrize("ctx,qlens", [CASES[0], CASES[1]])
def test_paged_attention_low_precision_and_transposed_v(dtype, kv_dtype, ctx, qlens):
    """The engine's fp8 V cache is a transposed_view (kernels/layout.py)."""
    q, kc, vc, bt, lens, cu = paged_batch(ctx, qlens, 8, 2, 32, 16, dtype, kv_dtype)
    if kv_dtype == FP8:
        vt = transposed_view(torch.empty(vc.shape, dtype=FP8))
        vt.view(torch.uint8).copy_(vc.view(torch.uint8))
        vc = vt
    ref = R.paged_attention(q, kc, vc, bt, lens, cu, 32 ** -0.5)
    assert_matches(C.paged_attention(q, kc, vc, bt, lens, cu, 32 ** -0.5), ref, dtype)


def as_transposed(cache):
    t = transposed_view(torch.empty(cache.shape, dtype=cache.dtype))
    t.view(torch.uint8 if cache.element_size() == 1 else cache.dtype).copy_(
        cache.view(torch.uint8) if cache.element_size() == 1 else cache)
    return t


@pytest.mark.parametrize("kv_dtype,head", [(E5M2, False), (I8, False), (FP8, True)],
                         ids=["e5m2", "int8", "e4m3-head-scales"])
@pytest.mark.parametrize("ctx,qlens", [CASES[0], CASES[1], CASES[3]])
@pytest.mark.parametrize("v_t", [False, True])
def test_paged_attention_8bit_caches(kv_dtype, head, ctx, qlens, v_t):
    """kernels/kv_quant.py's caches, quantized from float caches with NaN in unowned slots
    (an int8 row of NaN gets a NaN scale): decode and prefill groups against the twin."""
    q, kc, vc, bt, lens, cu = paged_batch(ctx, qlens, 9, 3, 32, 16, BF)
    kq = dict(k_scale=torch.tensor([0.5, 1.0, 3.0]), v_scale=torch.tensor([2.0, 0.25, 1.0])) \
        if head else {}
    kc, ksc = kv_quant.quantized_cache(kc.float() * 3, kv_dtype, kq.get("k_scale", 1.0))
    vc, vsc = kv_quant.quantized_cache(vc.float(), kv_dtype, kq.get("v_scale", 1.0))
    if ksc is not None:
        kq = dict(k_scale_cache=ksc, v_scale_cache=vsc)
    if v_t:
        vc = as_transposed(vc)
    ref = R.paged_attention(q, kc, vc, bt, lens, cu, 32 ** -0.5, **kq)
    assert_matches(C.paged_attention(q, kc, vc, bt, lens, cu, 32 ** -0.5, **kq), ref, BF)
    if all(n == 1 for n in qlens):
        assert_matches(C.paged_decode_attention(q, kc, vc, bt, lens, 32 ** -0.5, **kq), ref,
                       BF)


def test_step_metadata_is_reused_only_for_the_same_tensors():
    """The plan derived from one step's metadata is not applied to another step's, nor to
    a (non-inference) tensor changed in place."""
    q, kc, vc, bt, lens, cu = paged_batch([30, 5, 17], [1, 1, 1], 4, 2, 32, 8)
    C.paged_decode_attention(q, kc, vc, bt, lens, 1.0)
    shorter = torch.tensor([29, 4, 16], dtype=torch.int32)  # a new tensor: a new plan
    assert_matches(C.paged_decode_attention(q, kc, vc, bt, shorter, 1.0),
                   R.paged_decode_attention(q, kc, vc, bt, shorter, 1.0), F32)
    shorter[0] = 10  # the same tensor, changed in place
    assert_matches(C.paged_decode_attention(q, kc, vc, bt, shorter, 1.0),
                   R.paged_decode_attention(q, kc, vc, bt, shorter, 1.0), F32)


@pytest.mark.parametrize("kv_dtype", [F32, BF, FP8, E5M2, I8, "e4m3-head-scales"])
@pytest.mark.parametrize("transposed", [False, True])
def test_store_kvcache_matches_twin(kv_dtype, transposed):
    nb, bs, h, d = 6, 8, 2, 32
    key, value = 30 * torch.randn(7, h, d), torch.randn(7, h, d)  # (some keys past 448)
    slots = torch.tensor([3, -1, 40, 17, 47, -1, 0])
    kq = {}
    if kv_dtype == "e4m3-head-scales":
        kv_dtype, kq = FP8, dict(k_scale=torch.tensor([0.3, 2.0]), v_scale=0.5)
    caches = []
    for _ in range(2):
        k, v = torch.zeros(nb, bs, h, d, dtype=kv_dtype), torch.zeros(nb, bs, h, d, dtype=kv_dtype)
        if kv_dtype == I8:
            kq = dict(k_scale_cache=torch.zeros(nb, bs, h), v_scale_cache=torch.zeros(nb, bs, h))
        caches.append((k, transposed_view(v) if transposed else v, v, kq))
    C.store_kvcache(key, value, caches[0][0], caches[0][1], slots, **caches[0][3])
    R.store_kvcache(key, value, caches[1][0], caches[1][1], slots, **caches[1][3])
    for a, b in zip(caches[0][::2], caches[1][::2], strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    for name, t in caches[0][3].items():
        if isinstance(t, torch.Tensor) and t.dim() == 3:  # int8's scale caches
            assert torch.equal(t, caches[1][3][name]) and t.view(-1, h)[3].all()
    assert torch.isfinite(caches[0][0].float()).all()  # saturated, never NaN or inf


@pytest.mark.parametrize("dtype", [F32, BF])
def test_pointwise_ops_match_twins(dtype):
    g = torch.Generator().manual_seed(1)
    x, res = (torch.randn(5, 96, generator=g).to(dtype) for _ in range(2))
    w = torch.randn(96, generator=g).to(dtype)
    assert_matches(C.rms_norm(x, w, 1e-6), R.rms_norm(x, w, 1e-6), dtype)
    for a, b in zip(C.fused_add_rms_norm(x, res, w, 1e-6),
                    R.fused_add_rms_norm(x, res, w, 1e-6), strict=True):
        assert_matches(a, b, dtype)
    assert_matches(C.silu_and_mul(x), R.silu_and_mul(x), dtype)


@pytest.mark.parametrize("dtype", [F32, BF])
@pytest.mark.parametrize("side_by_side", [True, False])
def test_rotary_equals_twin_bit_for_bit(dtype, side_by_side):
    """q and k as views of one qkv projection (rotated in one pass), or apart."""
    g = torch.Generator().manual_seed(2)
    cache = R.rotary_cos_sin(32, 64, 10000.0)
    qkv = torch.randn(5, 8 * 32, generator=g).to(dtype)  # [q: 4 heads | k: 2 | v: 2]
    q, k = qkv[:, :128].view(5, 4, 32), qkv[:, 128:192].view(5, 2, 32)
    if not side_by_side:
        k = k.clone()
    assert (C._heads_side_by_side(q, k) is not None) == side_by_side
    pos = torch.tensor([0, 7, 3, 63, 20])
    before = qkv.clone()
    for a, b in zip(C.apply_rotary(q, k, pos, cache), R.apply_rotary(q, k, pos, cache),
                    strict=True):
        assert torch.equal(a, b)
    assert torch.equal(qkv, before)  # inputs untouched


@pytest.mark.parametrize("dtype,kv_dtype", [(F32, F32), (BF, BF), (F32, FP8), (BF, FP8),
                                            (BF, E5M2), (F32, I8), (BF, I8)])
@pytest.mark.parametrize("qk_norm", [True, False])
@pytest.mark.parametrize("disabled", [False, True])
def test_qk_norm_rope_store_equals_twin_bit_for_bit(monkeypatch, dtype, kv_dtype, qk_norm,
                                                    disabled):
    """Views of one qkv projection, GQA 4/2, a slot -1 row, 8-bit caches with V transposed
    (fp8: scales, per head for K; int8: scale caches); through ops (the CPU module, or the
    unfused ops when the fused one is disabled for an ablation) against the twin."""
    if disabled:
        monkeypatch.setattr(ops, "_disabled", {"qk_norm_rope_store"})
    g = torch.Generator().manual_seed(3)
    nb, bs, d = 4, 8, 32
    cache = R.rotary_cos_sin(d, 64, 10000.0)
    qkv = torch.randn(6, 8 * d, generator=g).to(dtype)  # [q: 4 heads | k: 2 | v: 2]
    w = [torch.randn(d, generator=g).to(dtype) for _ in range(2)] if qk_norm else [None] * 2
    pos = torch.tensor([0, 7, 3, 63, 20, 5])
    slots = torch.tensor([3, -1, 30, 17, 31, 0])
    scales = dict(k_scale=torch.tensor([0.5, 3.0]), v_scale=2.0) if kv_dtype == FP8 else {}
    out, caches = [], []
    for fn in (ops.qk_norm_rope_store, R.qk_norm_rope_store):
        buf = qkv.clone()
        kc, vs = (torch.zeros(nb, bs, 2, d, dtype=kv_dtype) for _ in range(2))
        vc = transposed_view(vs) if kv_dtype.itemsize == 1 else vs
        if kv_dtype == I8:
            scales = dict(k_scale_cache=torch.zeros(nb, bs, 2), v_scale_cache=torch.zeros(nb, bs, 2))
        q, k, v = buf[:, :128].view(6, 4, d), buf[:, 128:192].view(6, 2, d), \
            buf[:, 192:].view(6, 2, d)
        out.append(fn(q, k, v, pos, cache, kc, vc, slots, *w, 1e-6, **scales))
        caches.append((kc, vs) + tuple(t for t in scales.values()
                                       if isinstance(t, torch.Tensor) and t.dim() == 3))
    for a, b in zip(out[0] + caches[0], out[1] + caches[1], strict=True):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert caches[0][0].view(torch.uint8)[0, 3].any()  # slot 3 written (k)


def test_empty_batch():
    q, kc = torch.empty(0, 4, 32), torch.zeros(4, 8, 2, 32)
    bt, lens = torch.zeros(0, 1, dtype=torch.int32), torch.zeros(0, dtype=torch.int32)
    cu = torch.zeros(1, dtype=torch.int32)
    assert C.paged_attention(q, kc, kc, bt, lens, cu, 1.0).shape == q.shape
    assert C.paged_decode_attention(q, kc, kc, bt, lens, 1.0).shape == q.shape


def test_cpu_tensors_dispatch_to_the_cpu_module():
    x = torch.zeros(2, 4)
    for name in ops.TRITON_MODULES:
        assert ops._op(name, x) is getattr(C, name)


def test_decode_order_only_where_the_triton_kernel_runs(monkeypatch):
    """No launch order on the CPU (the twins ignore it) or under its ablation; ablation names
    are checked (bench/offline.py refuses a typo that would switch nothing off)."""
    lens = torch.tensor([3, 9, 1], dtype=torch.int32)
    assert ops.decode_order(lens) is None
    monkeypatch.setattr(ops, "_disabled", {"decode_order"})
    assert ops.decode_order(lens) is None
    assert ops.unknown_ablations("rms_norm, decode_order,,") == []
    assert ops.unknown_ablations("rms_norm,rotary,foo") == ["foo", "rotary"]


@pytest.mark.parametrize("rows,vocab,pad,picked", [
    (4, 100, 0, [2, 0]), (3, 4099, 7, [0, 1, 2]), (1, 32, 3, [0])])
def test_apply_token_bitmask_is_the_twin_and_the_bit_layout(rows, vocab, pad, picked):
    """The CPU mask equals the twin's; both equal a loop over the bits as the grammar
    library writes them (bit t: word t // 32, bit t % 32), and padding columns stay."""
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(rows, vocab + pad, generator=g)
    words = -(-vocab // 32)
    mask = torch.randint(-2**31, 2**31, (len(picked), words), generator=g,
                         dtype=torch.int64).to(torch.int32)
    idx = torch.tensor(picked)
    loop = x.clone()
    for gi, r in enumerate(picked):
        for tok in range(vocab):
            if not (int(mask[gi, tok // 32]) >> (tok % 32)) & 1:
                loop[r, tok] = float("-inf")
    ref, got = x.clone(), x.clone()
    R.apply_token_bitmask(ref, mask, idx, vocab)
    C.apply_token_bitmask(got, mask, idx, vocab)
    assert torch.equal(ref, loop) and torch.equal(got, loop)


def gumbel_case(rows, vocab, pad, dtype, seed, greedy_every=3):
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(rows, vocab + pad, generator=g) * 4).to(dtype)
    t = torch.rand(rows, generator=g) * 1.5 + 0.01
    if greedy_every:
        t[::greedy_every] = 0.0
    return x, t, torch.randint(-2**62, 2**62, (rows,), generator=g)


@pytest.mark.parametrize("rows,vocab,pad,dtype,greedy_every", [
    (1, 1000, 0, F32, 0), (5, 3001, 7, F32, 3), (37, 10007, 1, BF, 4),  # 37 rows: 3 tiles
    (300, 2053, 0, F32, 0), (8, 700, 3, F32, 1)])  # 300 rows: 6 tiles; all greedy
def test_gumbel_argmax_picks_the_twins_token(rows, vocab, pad, dtype, greedy_every):
    """Greedy rows take their logits' argmax; a sampled row's token has the twin's maximal
    noisy score (scores equal to the twin's up to the rounding of log: one ulp here and
    there, from vectorised and scalar loops); never a padding column."""
    x, t, keys = gumbel_case(rows, vocab, pad, dtype, seed=rows)
    got = C.gumbel_argmax(x, t, keys, vocab)
    score = R.gumbel_scores(x, t, keys, vocab)
    best = score.max(dim=1).values
    picked = score.gather(1, got.clamp(0, vocab - 1).unsqueeze(1)).squeeze(1)
    assert got.dtype == torch.int64 and ((got >= 0) & (got < vocab)).all()
    assert (picked >= best - 1e-6 * (1 + best.abs())).all()
    assert torch.equal(got[t == 0], x[t == 0, :vocab].float().argmax(dim=1))
    assert (got == R.gumbel_argmax(x, t, keys, vocab)).float().mean() >= 0.99


def test_gumbel_argmax_scores_a_tile_as_the_twin_bit_for_bit():
    """One tile, one thread's loops: every op is the twin's, in its order and precision."""
    from pagedq.kernels import cpu_sampling as S
    x, t, keys = gumbel_case(6, 4096, 0, BF, seed=3, greedy_every=0)
    z, u = (torch.empty(6, 4096, dtype=torch.int64) for _ in range(2))
    e, s = (torch.empty(6, 4096) for _ in range(2))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        S._tile_scores(x, t.unsqueeze(1), keys.unsqueeze(1), S._counter_steps(4096, x.device),
                       z, u, e, s)
        assert torch.equal(s, R.gumbel_scores(x, t, keys, 4096))
    finally:
        torch.set_num_threads(threads)


def test_gumbel_argmax_across_tiles_first_maximum_and_masks():
    """The first of equal maxima wins across tiles (as argmax); a row masked to one token
    (top-k / top-p leave -inf) picks it wherever it lies."""
    rows, vocab = 40, 9000  # 40 rows: tiles of 3,264 columns
    x = torch.full((rows, vocab), float("-inf"))
    t = torch.full((rows,), 0.8)
    keys = torch.arange(rows, dtype=torch.int64) * 7919
    for r in range(rows):
        x[r, (r * 997) % vocab] = 0.0
    x[0, 100] = x[0, 8000] = float("inf")  # equal maxima in the first and last tiles
    x[1, 8999] = float("inf")
    got = C.gumbel_argmax(x, t, keys, vocab)
    assert got[0] == 100 and got[1] == 8999
    assert got[2:].tolist() == [(r * 997) % vocab for r in range(2, rows)]
    assert torch.equal(got, R.gumbel_argmax(x, t, keys, vocab))
