"""The few-rows GEMV of the W4A16 / W8A16 GEMM: y [M, N] = x [M, K] @ W [K, N] (+ bias) for
2..MAX_ROWS rows on the CUDA cores, W in kernels/quant_layout.py's layout (a word row of
qweight is N contiguous int32: 4 columns are one 16-byte load).

Why not tensor cores at these rows: a decode step reads every weight once and the rows
only multiply the work per weight. Here each code is dequantized once, into a float32
weight (one shift per two codes, one and-or and one FMA: kernels/quant_decode.py's
``code_as_float`` and w = f * s - s * (UNIT + ZP) (+ o)), then used by every row (one FMA
a row); the tensor-core tiles (quant_decode's DOT plans) instead pass each dequantized
tile through shared memory. Per code that is about 2.5 + M instructions: below the
bandwidth's cost up to a few rows, and measured against the tiles per shape
(bench/quant.py; ``quant_decode.TUNED``).

A program owns an output tile [BLOCK_M, BLOCK_N] and a run of K tiles of KP (1 or 2) word
rows; each thread holds its columns' accumulators for every row, and each weight row it
dequantizes is a rank-1 update of them (one FMA a row); K is split as in
quant_decode (``finish``: the last program of a column tile sums the partials in split
order; the same counters and invariant).
"""
from __future__ import annotations

import triton
import triton.language as tl

from pagedq.kernels.quant_parts import code_as_float, finish, k_tile, unit

MAX_ROWS = 8


@triton.jit
def _rank1(acc, w, x_ptr, perm_ptr, offs_m, m_ok, s_xm, p, p_end, P: tl.constexpr,
           J: tl.constexpr, HAS_PERM: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] += x[:, p * P + J] (x) w [1, BLOCK_N]: one FMA a row."""
    ok = m_ok & (p < p_end)  # [BLOCK_M]
    k = p * P + J + offs_m * 0  # (p: [1], one word row)
    if HAS_PERM:  # act-order: x's columns perm[k]
        k = tl.load(perm_ptr + k, mask=ok, other=0)
    xj = tl.load(x_ptr + offs_m * s_xm + k, mask=ok, other=0.0)
    return acc + xj.to(tl.float32)[:, None] * w


@triton.jit(do_not_specialize=["M", "tiles_per_split", "splits", "m16", "m256"])
def _rows_kernel(x_ptr, q_ptr, s_ptr, o_ptr, perm_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
                 M, N, K, s_xm, s_ym, tiles_per_split, splits, m16, m256,
                 BITS: tl.constexpr, GROUP: tl.constexpr, ZP: tl.constexpr,
                 HAS_OFFSET: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
                 PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 KP: tl.constexpr):
    P: tl.constexpr = 32 // BITS
    ONE_GROUP: tl.constexpr = GROUP % (KP * P) == 0  # every K tile inside one group
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    NP = K // P
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_p = tl.arange(0, KP)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    t0 = pid_k * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, tl.cdiv(NP, KP))
    p_end = tl.minimum(NP, t1 * KP)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    words, s, o, _ = k_tile(q_ptr, s_ptr, o_ptr, x_ptr, t0, offs_p, offs_n, n_ok, N, NP,
                            p_end, BITS, GROUP, HAS_OFFSET, ONE_GROUP, False, KP)
    for t in range(t0, t1):
        if PREFETCH:  # the next tile's loads in flight while this one computes
            nwords, ns, no, _ = k_tile(q_ptr, s_ptr, o_ptr, x_ptr, t + 1, offs_p, offs_n, n_ok,
                                       N, NP, p_end, BITS, GROUP, HAS_OFFSET, ONE_GROUP,
                                       False, KP)
        p = t * KP + offs_p
        for j in tl.static_range(P):
            # W's rows p * P + j [KP, BLOCK_N], dequantized once for every row of x
            w = code_as_float(words, m16, m256, j, BITS) * s - s * (unit(j, BITS) + ZP)
            if HAS_OFFSET:
                w += o
            if KP == 1:
                acc = _rank1(acc, w, x_ptr, perm_ptr, offs_m, m_ok, s_xm, p, p_end, P, j,
                             HAS_PERM)
            else:  # KP == 2: the two word rows one by one (a thread holds both)
                w0, w1 = tl.split(tl.permute(w, (1, 0)))
                p0, p1 = tl.split(tl.reshape(p, (1, 2)))
                acc = _rank1(acc, w0[None, :], x_ptr, perm_ptr, offs_m, m_ok, s_xm, p0, p_end,
                             P, j, HAS_PERM)
                acc = _rank1(acc, w1[None, :], x_ptr, perm_ptr, offs_m, m_ok, s_xm, p1, p_end,
                             P, j, HAS_PERM)
        if PREFETCH:
            words, s, o = nwords, ns, no
        else:
            words, s, o, _ = k_tile(q_ptr, s_ptr, o_ptr, x_ptr, t + 1, offs_p, offs_n, n_ok, N,
                                    NP, p_end, BITS, GROUP, HAS_OFFSET, ONE_GROUP, False, KP)
    finish(acc, offs_m, m_ok, offs_n, n_ok, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, s_ym,
            splits, pid_n, pid_k, HAS_BIAS, 8 // BLOCK_M if BLOCK_M < 8 else 1)
