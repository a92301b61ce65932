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

A program owns an output tile [BLOCK_M, BLOCK_N] and a run of K tiles of one word row
(KP = 1) each: each thread holds its columns' accumulators for every row of x, and each
weight row it dequantizes is a rank-1 update of them (one FMA a row); x's P columns of the
word row come in one load a row (act-order: one by one). K is split as in
quant_decode (``finish``: the last program of a column tile sums the partials in split
order; the same counters and invariant).
"""
from __future__ import annotations

import triton
import triton.language as tl

from pagedq.kernels.quant_parts import code_as_float, finish, k_tile, unit

MAX_ROWS = 8


@triton.jit
def _columns(xt, BLOCK_M: tl.constexpr, P: tl.constexpr):
    """x's tile [BLOCK_M, P] (P = 8 or 4) as its P columns [BLOCK_M], in order (P = 4: the
    last four are the first four again, unused)."""
    ev, od = tl.split(tl.reshape(xt, (BLOCK_M, P // 2, 2)))  # columns 0, 2, .. / 1, 3, ..
    if P == 8:
        e0, e1 = tl.split(tl.reshape(ev, (BLOCK_M, 2, 2)))  # 0, 4 / 2, 6
        o0, o1 = tl.split(tl.reshape(od, (BLOCK_M, 2, 2)))  # 1, 5 / 3, 7
        c0, c4 = tl.split(e0)
        c2, c6 = tl.split(e1)
        c1, c5 = tl.split(o0)
        c3, c7 = tl.split(o1)
    else:
        c0, c2 = tl.split(ev)
        c1, c3 = tl.split(od)
        c4, c5, c6, c7 = c0, c1, c2, c3
    return c0, c1, c2, c3, c4, c5, c6, c7


@triton.jit
def _pick(xs, J: tl.constexpr):
    c0, c1, c2, c3, c4, c5, c6, c7 = xs
    if J == 0:
        return c0
    elif J == 1:
        return c1
    elif J == 2:
        return c2
    elif J == 3:
        return c3
    elif J == 4:
        return c4
    elif J == 5:
        return c5
    elif J == 6:
        return c6
    else:
        return c7


@triton.jit(do_not_specialize=["M", "tiles_per_split", "splits", "m16", "m256"])
def _rows_kernel(x_ptr, q_ptr, s_ptr, o_ptr, perm_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
                 M, N, K, s_xm, s_ym, tiles_per_split, splits, m16, m256,
                 BITS: tl.constexpr, GROUP: tl.constexpr, ZP: tl.constexpr,
                 HAS_OFFSET: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
                 PREFETCH: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                 KP: tl.constexpr):
    tl.static_assert(KP == 1)
    P: tl.constexpr = 32 // BITS
    ONE_GROUP: tl.constexpr = GROUP % P == 0  # (always: quant_decode.serves)
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    NP = K // P
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_p = tl.arange(0, KP)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    t0 = pid_k * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, NP)
    p_end = t1
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    words, s, o, _ = k_tile(q_ptr, s_ptr, o_ptr, x_ptr, t0, offs_p, offs_n, n_ok, N, NP,
                            p_end, BITS, GROUP, HAS_OFFSET, ONE_GROUP, False, KP)
    for t in range(t0, t1):
        if PREFETCH:  # the next tile's loads in flight while this one computes
            nwords, ns, no, _ = k_tile(q_ptr, s_ptr, o_ptr, x_ptr, t + 1, offs_p, offs_n, n_ok,
                                       N, NP, p_end, BITS, GROUP, HAS_OFFSET, ONE_GROUP,
                                       False, KP)
        p = t + offs_p  # [1]: one word row a tile
        if not HAS_PERM:  # x's P columns of the row, one load a row of x, split in registers
            xt = tl.load(x_ptr + offs_m[:, None] * s_xm + t * P + tl.arange(0, P)[None, :],
                         mask=m_ok[:, None] & (p < p_end)[None, :], other=0.0).to(tl.float32)
            xs = _columns(xt, BLOCK_M, P)
        for j in tl.static_range(P):
            # W's row t * P + j [1, BLOCK_N], dequantized once for every row of x
            w = code_as_float(words, m16, m256, j, BITS) * s - s * (unit(j, BITS) + ZP)
            if HAS_OFFSET:
                w += o
            if HAS_PERM:  # act-order: x's columns perm[k], one by one
                ok = m_ok & (p < p_end)
                k = tl.load(perm_ptr + p * P + j + offs_m * 0, mask=ok, other=0)
                xj = tl.load(x_ptr + offs_m * s_xm + k, mask=ok, other=0.0).to(tl.float32)
            else:
                xj = _pick(xs, j)
            acc += xj[:, None] * w
        if PREFETCH:
            words, s, o = nwords, ns, no
        else:
            words, s, o, _ = k_tile(q_ptr, s_ptr, o_ptr, x_ptr, t + 1, offs_p, offs_n, n_ok, N,
                                    NP, p_end, BITS, GROUP, HAS_OFFSET, ONE_GROUP, False, KP)
    finish(acc, offs_m, m_ok, offs_n, n_ok, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, s_ym,
            splits, pid_n, pid_k, HAS_BIAS, 8 // BLOCK_M if BLOCK_M < 8 else 1)
