"""One BLOCK_N-token tile of the paged decode kernel's online softmax (kernels/decode_attention.py),
in two forms and three kinds of dot.

Forms (constexpr SWAP):
  rows (SWAP=False): the G query heads of a KV head are the M rows of the dots:
    s [G_PAD, BLOCK_N] = q [G_PAD, D] @ K^T, acc [G_PAD, D] += p @ V. The MMA's M is 16, so
    with G = 2 (Qwen3-0.6B) 14 of its 16 rows are padding, and so is the softmax on them.
  swap (SWAP=True): the tokens are the M rows: s^T [BLOCK_N, G_PAD] = K @ q^T,
    acc^T [D, G_PAD] += V^T @ p^T, in a warpgroup: from an M of 64 tokens and an N (G_PAD)
    of 16, Triton 3.6 emits wgmmas on sm_90 (operands in shared memory, no register copies
    of the tiles); the rows form's M of 16 only ever gets mma.sync (and e4m3 dots there
    are converted to fp16 anyway). K is the first operand with D contiguous and V^T with
    the tokens contiguous (the transposed V layout): both K-major, as e4m3 operands need.

Dots (constexpr F32_DOT, MMA8):
  fp32 (F32_DOT): operands upcast to fp32, exact IEEE dots (fp32 inputs; the CPU interpreter,
    whose bf16 dot is wrong). With MMA8 it runs MMA8's arithmetic on the same e4m3 terms.
  16-bit (neither): operands in q's dtype (an 8-bit cache's tile converted in registers; for
    an fp8 cache q is then fp16, whose conversion from e4m3 or e5m2 is one instruction; an
    int8 cache keeps q's dtype, which holds every code exactly).
  MMA8: e4m3 x e4m3 tensor-core dots on the cache's own bytes: no conversion of K or V at all.
    q and p, which must become e4m3 too, are each split into two e4m3 terms hi + lo (hi =
    e4m3(x), lo = e4m3(x - hi)), about 8 significant bits, bf16's precision; the tile runs
    one dot per term. q's rows are scaled to a max |x| of Q8_MAX first (their factor folded
    into the score scale), p (<= 1) by P8_SCALE (undone at the end, with v_scale).

Caches are read through their strides (kernels/layout.py): K token-major, V token-major or
transposed ([D, BLOCK_N] per tile with each block's tokens contiguous). With a transposed V
a MASKED tile reads whole blocks and zeroes the slots past `hi` (they may hold any bits, NaN
included); a token-major V is read per token under the mask.
An int8 cache (TOKEN_SCALE, kernels/kv_quant.py): the tile's K scales multiply the scores'
columns (tokens) and its V scales the softmax weights p before P.V; l sums the unscaled p.
"""
from __future__ import annotations

import triton
import triton.language as tl

NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": a fully masked row never makes inf - inf
Q8_MAX = tl.constexpr(224.0)  # q's row max after scaling: hi's rounding stays below e4m3's 448
P8_SCALE = tl.constexpr(256.0)  # p <= 1 scaled to <= 256: small p stay above e4m3's subnormals


@triton.jit
def split_e4m3(x):
    """fp32 x -> (hi, lo) e4m3 with hi + lo ~= x to about 2**-8 relative."""
    hi = x.to(tl.float8e4nv)
    lo = (x - hi.to(tl.float32)).to(tl.float8e4nv)
    return hi, lo


@triton.jit
def prepare_q(q, qk_scale, SWAP: tl.constexpr, MMA8: tl.constexpr, FP16: tl.constexpr):
    """q [G_PAD, D] as the tile's operands (qa, qb) and the per-head score factors [G_PAD]
    (scale * log2(e) / q's MMA8 row factor). SWAP: the operands are q^T [D, G_PAD]; qb is
    MMA8's lo term (else qa again, unused)."""
    if MMA8:
        qf = q.to(tl.float32)
        amax = tl.max(tl.abs(qf), 1)
        c = tl.where(amax > 0, Q8_MAX / tl.where(amax > 0, amax, 1.0), 1.0)
        qa, qb = split_e4m3(qf * c[:, None])
        rscale = qk_scale / c
    else:
        qa = q
        if FP16:  # an fp8 cache's tiles convert to fp16 (module doc)
            qa = q.to(tl.float16)
        qb = qa
        rscale = tl.full([q.shape[0]], qk_scale, tl.float32)
    if SWAP:
        qa = tl.trans(qa)
        qb = tl.trans(qb)
    return qa, qb, rscale


# (one return per function: Triton compiles the code after a constexpr-if's return too)
@triton.jit
def _dot(a, b, acc, F32_DOT: tl.constexpr):
    if F32_DOT:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc)
    return out


@triton.jit
def _dot_cache(x, kv, acc, SWAP: tl.constexpr, F32_DOT: tl.constexpr, MMA8: tl.constexpr):
    """A dot of an operand x (q or p, prepared) with a tile kv of the cache, added to acc.
    SWAP: kv @ x, else x @ kv. 16-bit dots take kv in x's dtype."""
    if not (MMA8 or F32_DOT):
        kv = kv.to(x.dtype)
    if SWAP:
        out = _dot(kv, x, acc, F32_DOT)
    else:
        out = _dot(x, kv, acc, F32_DOT)
    return out


@triton.jit
def _token_scales(base, soff, tmask, MASKED: tl.constexpr):
    """[BLOCK_N] float32 scales of the tile's tokens (0 past hi when MASKED)."""
    if MASKED:
        out = tl.load(base + soff, mask=tmask, other=0.0)
    else:
        out = tl.load(base + soff)
    return out


@triton.jit
def tile(qa, qb, rscale, m_i, l_i, acc, start, hi, bt_row, k_base, v_base,
         s_kb, s_kt, s_kd, s_vb, s_vt, s_vd, offs_n, offs_d, ksc_base, vsc_base, s_scb, s_sct,
         BS: tl.constexpr, F32_DOT: tl.constexpr, V_T: tl.constexpr, MASKED: tl.constexpr,
         SWAP: tl.constexpr, MMA8: tl.constexpr, TOKEN_SCALE: tl.constexpr):
    """Online softmax over tokens [start, start + BLOCK_N) of one KV head; returns
    (m, l, acc) (acc transposed under SWAP). MASKED: the tile may hold tokens >= hi (only
    blocks holding a token < hi are read). TOKEN_SCALE: an int8 cache, its scale caches at
    ksc_base / vsc_base (this head's), block and slot strides s_scb, s_sct."""
    tok = start + offs_n
    slot = tok % BS
    tmask = tok < hi
    if MASKED:
        blk = tl.load(bt_row + tok // BS, mask=tmask, other=0).to(tl.int64)
        k = tl.load(k_base + blk[:, None] * s_kb + slot[:, None] * s_kt + offs_d[None, :] * s_kd,
                    mask=tmask[:, None], other=0.0)
    else:
        blk = tl.load(bt_row + tok // BS).to(tl.int64)
        k = tl.load(k_base + blk[:, None] * s_kb + slot[:, None] * s_kt + offs_d[None, :] * s_kd)
    if TOKEN_SCALE:
        soff = blk * s_scb + slot * s_sct
        ksc = _token_scales(ksc_base, soff, tmask, MASKED)
        vsc = _token_scales(vsc_base, soff, tmask, MASKED)
    if SWAP:
        zeros = tl.zeros([offs_n.shape[0], rscale.shape[0]], tl.float32)
    else:
        zeros = tl.zeros([rscale.shape[0], offs_n.shape[0]], tl.float32)
    if not SWAP:
        k = tl.trans(k)  # K^T [D, BLOCK_N]
    s = _dot_cache(qa, k, zeros, SWAP, F32_DOT, MMA8)
    if MMA8:  # one dot per term of q
        s = _dot_cache(qb, k, s, SWAP, F32_DOT, MMA8)
    if SWAP:  # s [BLOCK_N, G_PAD]: the heads are columns
        if TOKEN_SCALE:
            s = s * ksc[:, None]
        s = s * rscale[None, :]
        if MASKED:
            s = tl.where(tmask[:, None], s, NEG)
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha[None, :]
    else:
        if TOKEN_SCALE:
            s = s * ksc[None, :]
        s = s * rscale[:, None]
        if MASKED:
            s = tl.where(tmask[None, :], s, NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
    # V as vt [D, BLOCK_N] (transposed layout) or v [BLOCK_N, D] (token-major)
    if V_T:
        voff = blk[None, :] * s_vb + slot[None, :] * s_vt + offs_d[:, None] * s_vd
        voff = tl.max_contiguous(tl.multiple_of(voff, [1, BS]), [1, BS])
        if MASKED:
            bmask = tl.max_constancy((tok // BS) * BS < hi, [BS])
            vt = tl.load(v_base + voff, mask=bmask[None, :], other=0.0)
            vt = tl.where(tmask[None, :], vt, 0.0)
        else:
            vt = tl.load(v_base + voff)
        v = tl.trans(vt)
    else:
        voff = blk[:, None] * s_vb + slot[:, None] * s_vt + offs_d[None, :] * s_vd
        if MASKED:
            v = tl.load(v_base + voff, mask=tmask[:, None], other=0.0)
        else:
            v = tl.load(v_base + voff)
        vt = tl.trans(v)
    if SWAP:
        v = vt
    if TOKEN_SCALE:  # l above summed the unscaled p
        if SWAP:
            p = p * vsc[:, None]
        else:
            p = p * vsc[None, :]
    if MMA8:  # one dot per term of p, summed from zero: e4m3 tensor-core sums are not fp32's
        pa, pb = split_e4m3(p * P8_SCALE)
        acc += _dot_cache(pb, v, _dot_cache(pa, v, tl.zeros_like(acc), SWAP, F32_DOT, MMA8),
                          SWAP, F32_DOT, MMA8)
    elif F32_DOT:
        acc = _dot_cache(p, v, acc, SWAP, F32_DOT, MMA8)
    else:
        acc = _dot_cache(p.to(qa.dtype), v, acc, SWAP, F32_DOT, MMA8)
    return m_new, l_i, acc
