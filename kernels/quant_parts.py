"""The pieces the few-rows W4A16 / W8A16 kernels share (kernels/quant_decode.py's GEMV and
DOT tiles, kernels/quant_rows.py's rows GEMV): a K tile's loads, a code as a float, and
the split-K finish. What they compute and the invariants they keep: quant_decode's doc."""
from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def k_tile(q_ptr, s_ptr, o_ptr, x_ptr, t, offs_p, offs_n, n_ok, N, NP, p_end,
           BITS: tl.constexpr, GROUP: tl.constexpr, HAS_OFFSET: tl.constexpr,
           ONE_GROUP: tl.constexpr, X_WORDS: tl.constexpr, KP: tl.constexpr):
    """K tile t: its words [KP, BLOCK_N] and its scales (and offsets) as float32: one row
    [BLOCK_N] when the tile lies in one group (ONE_GROUP), else each word row's
    [KP, BLOCK_N]; X_WORDS: the one row of x's values for the tile's word rows, [KP, P / 2]
    int32 pairs of 16-bit values (the GEMV's PAIRS == 2). Word rows from p_end on load as 0
    (x's) or as anything finite (the words': they meet x = 0 only)."""
    P: tl.constexpr = 32 // BITS
    p = t * KP + offs_p
    ok = (p < p_end)[:, None] & n_ok[None, :]
    # no fill value: a masked word's garbage makes finite floats that meet x = 0 only
    words = tl.load(q_ptr + p[:, None] * N + offs_n[None, :], mask=ok)
    if ONE_GROUP:  # [1, BLOCK_N]: the words' layout, no conversion
        # (a prefetch past the last tile reads the last group's row, used by nothing)
        g = tl.minimum((t * KP * P) // GROUP, tl.cdiv(NP * P, GROUP) - 1)
        ptrs = g * N + offs_n[None, :]
        s = tl.load(s_ptr + ptrs, mask=n_ok[None, :], other=0.0).to(tl.float32)
        o = s
        if HAS_OFFSET:
            o = tl.load(o_ptr + ptrs, mask=n_ok[None, :], other=0.0).to(tl.float32)
    else:
        g = (p * P) // GROUP
        s = tl.load(s_ptr + g[:, None] * N + offs_n[None, :], mask=ok, other=0.0)
        s = s.to(tl.float32)
        o = s
        if HAS_OFFSET:
            o = tl.load(o_ptr + g[:, None] * N + offs_n[None, :], mask=ok, other=0.0)
            o = o.to(tl.float32)
    xw = words
    if X_WORDS:
        xw = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + (p * (P // 2))[:, None]
                     + tl.arange(0, P // 2)[None, :], mask=(p < p_end)[:, None], other=0)
    return words, s, o, xw


@triton.jit
def code_as_float(words, m16, m256, J: tl.constexpr, BITS: tl.constexpr):
    """Code J of each word as the float UNIT + code (exact; UNIT = ``unit(J, BITS)``): the
    code moved into the top mantissa bits of UNIT's float, m16 = 16.0's bits (0x41800000)
    or m256 = 256.0's (0x43800000), by one shift and one and-or. 4-bit codes come in pairs
    from one shift: code J + 1 (J even) in the top 4 mantissa bits (UNIT 16), code J four
    bits below (UNIT 256). The magics come at run time so that the and-or stays one LOP3
    with the mask as its immediate."""
    FOUR: tl.constexpr = 4 // BITS  # 1 for 4-bit codes, 0 for 8-bit
    SH: tl.constexpr = FOUR * (19 - 4 * (J + 1 - J % 2)) + (1 - FOUR) * (15 - 8 * J)
    MASK: tl.constexpr = FOUR * (0x780000 >> (4 * (1 - J % 2))) + (1 - FOUR) * 0x7F8000
    if SH >= 0:
        moved = words << SH
    else:
        moved = words >> (-SH)
    if FOUR * (J % 2) == 1:
        f = (moved & MASK) | m16
    else:
        f = (moved & MASK) | m256
    return f.to(tl.float32, bitcast=True)


@triton.jit
def unit(J: tl.constexpr, BITS: tl.constexpr):
    """UNIT of code J (``code_as_float``): 16 for the odd codes of 4-bit words, else 256."""
    return 256 - 240 * (4 // BITS) * (J % 2)


@triton.jit
def finish(acc, offs_m, m_ok, offs_n, n_ok, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, s_ym,
           splits, pid_n, pid_k, HAS_BIAS: tl.constexpr, CHUNK: tl.constexpr):
    """acc [BLOCK_M, BLOCK_N] is this program's share of y's tile: write y, or the partial
    and, for the last program of the column tile, y from all partials (module doc)."""
    mask = m_ok[:, None] & n_ok[None, :]
    y_ptrs = y_ptr + offs_m[:, None].to(tl.int64) * s_ym + offs_n[None, :]
    if splits == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        ws_rows = ws_ptr + offs_m[:, None].to(tl.int64) * N + offs_n[None, :]
        tl.store(ws_rows + pid_k.to(tl.int64) * M * N, acc, mask=mask)
        tl.debug_barrier()  # every thread's partial is written before the release
        arrived = tl.atomic_add(cnt_ptr + pid_n, 1, sem="acq_rel", scope="gpu")
        if arrived == splits - 1:  # CHUNK partials' loads in flight at a time, summed in a
            # fixed order
            total = tl.zeros(acc.shape, dtype=tl.float32)
            offs_c = tl.arange(0, CHUNK)
            for c0 in range(0, splits, CHUNK):
                c = c0 + offs_c
                ptrs = ws_rows[None, :, :] + (c.to(tl.int64) * M * N)[:, None, None]
                total += tl.sum(tl.load(ptrs, mask=(c < splits)[:, None, None] & mask[None],
                                        other=0.0, cache_modifier=".cg"), axis=0)
            if HAS_BIAS:
                total += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)
            tl.atomic_xchg(cnt_ptr + pid_n, 0, sem="relaxed", scope="gpu")
