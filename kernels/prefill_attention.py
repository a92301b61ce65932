"""Varlen causal attention over the paged KV cache: prefill, chunked prefill with a cached
prefix, and decode rows (qlen 1) mixed in, all sequences in one launch.

Grid (num_q_tiles, Hkv). A tile is BLOCK_Q query tokens of one sequence times the
G = Hq // Hkv heads of one KV head, packed as BLOCK_M = BLOCK_Q * G rows (row r: token
r // G, head kvh*G + r % G), so each KV tile is read once per group, and a decode row costs
one tile, not one per query head. Tiles are numbered without a host sync: sequence b owns
tile ids [cu[b] // BLOCK_Q + b, cu[b+1] // BLOCK_Q + b + 1), which holds at least
cdiv(qlen_b, BLOCK_Q) ids; the grid is T // BLOCK_Q + B and a program finds its sequence by
binary search over cu_seqlens_q (ids past a sequence's last tile exit at once).
Query j of sequence b sits at position L_b - qlen_b + j and sees keys 0..that position.
8-bit caches (kernels/kv_quant.py): an fp8 head's scales fold into the score scale and the
output; an int8 cache's per-token scales multiply the scores' columns and p before P.V.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagedq.kernels import kv_quant
from pagedq.kernels.layout import check_paged_qkv

_LOG2E = 1.4426950408889634
_NEG = tl.constexpr(-1.0e30)  # finite "minus infinity": padded rows never make inf - inf


@triton.jit
def _find_seq(cu_ptr, pid, num_seqs, BLOCK_Q: tl.constexpr):
    lo = pid * 0  # int32 tensors from the start: loop-carried types must not change
    hi = lo + num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        if tl.load(cu_ptr + mid) // BLOCK_Q + mid <= pid:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


# Arguments that change from step to step are not specialised: Triton would otherwise
# compile a new variant (seconds) whenever one of them first turns 1, or a multiple of 16,
# or a pointer's 16-byte alignment changes (cu_seqlens_q is a slice of a packed buffer).
@triton.jit(do_not_specialize=["num_seqs", "s_btb"],
            do_not_specialize_on_alignment=["bt_ptr", "lens_ptr", "cu_ptr", "ks_ptr", "vs_ptr"])
def _prefill_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, cu_ptr, out_ptr, qk_scale,
                    v_scale, ks_ptr, vs_ptr, ksc_ptr, vsc_ptr, num_seqs, s_qt, s_qh, s_kb, s_kt,
                    s_kh, s_kd, s_vb, s_vt, s_vh, s_vd, s_btb, s_ot, s_oh, s_scb, s_sct,
                    G: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
                    F32_DOT: tl.constexpr, V_T: tl.constexpr, HEAD_SCALE: tl.constexpr,
                    TOKEN_SCALE: tl.constexpr):
    pid = tl.program_id(0)
    kvh = tl.program_id(1)
    b = _find_seq(cu_ptr, pid, num_seqs, BLOCK_Q)
    q_start = tl.load(cu_ptr + b)
    q_len = tl.load(cu_ptr + b + 1) - q_start
    tile = pid - (q_start // BLOCK_Q + b)
    if tile * BLOCK_Q >= q_len:
        return
    seq_len = tl.load(lens_ptr + b)
    ctx0 = seq_len - q_len  # position of the sequence's first query token

    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    tok = tile * BLOCK_Q + offs_m // G  # query index within the sequence
    head = kvh * G + offs_m % G
    rmask = (offs_m < BLOCK_Q * G) & (tok < q_len)
    qpos = ctx0 + tok
    q_off = (q_start + tok).to(tl.int64) * s_qt + head * s_qh
    q = tl.load(q_ptr + q_off[:, None] + offs_d[None, :], mask=rmask[:, None], other=0.0)

    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # keys past the tile's last query position are masked for every row: stop there
    kv_end = tl.minimum(seq_len, ctx0 + tl.minimum((tile + 1) * BLOCK_Q, q_len))
    bt_row = bt_ptr + b.to(tl.int64) * s_btb
    k_base = k_ptr + kvh * s_kh
    v_base = v_ptr + kvh * s_vh
    if HEAD_SCALE:
        qk_scale = qk_scale * tl.load(ks_ptr + kvh)
        v_scale = v_scale * tl.load(vs_ptr + kvh)
    for start in tl.range(0, kv_end, BLOCK_N):
        kt = start + offs_n
        kmask = kt < kv_end
        blk = tl.load(bt_row + kt // BS, mask=kmask, other=0).to(tl.int64)
        slot = kt % BS
        k = tl.load(k_base + blk[:, None] * s_kb + slot[:, None] * s_kt + offs_d[None, :] * s_kd,
                    mask=kmask[:, None], other=0.0)
        if F32_DOT:
            s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k.to(q.dtype)))
        if TOKEN_SCALE:  # (0 past kv_end; those columns are masked below)
            soff = blk * s_scb + slot * s_sct + kvh
            s = s * tl.load(ksc_ptr + soff, mask=kmask, other=0.0)[None, :]
            vsc = tl.load(vsc_ptr + soff, mask=kmask, other=0.0)
        visible = kmask[None, :] & (kt[None, :] <= qpos[:, None])
        s = tl.where(visible, s * qk_scale, _NEG)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.where(visible, tl.exp2(s - m_new[:, None]), 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        if TOKEN_SCALE:  # l summed the unscaled p
            p = p * vsc[None, :]
        if V_T:  # transposed V cache: [D, BLOCK_N] tiles, BS tokens contiguous per block
            voff = blk[None, :] * s_vb + slot[None, :] * s_vt + offs_d[:, None] * s_vd
            voff = tl.max_contiguous(tl.multiple_of(voff, [1, BS]), [1, BS])
            # whole blocks holding a key < kv_end; the slots past it may hold any bits
            bmask = tl.max_constancy((kt // BS) * BS < kv_end, [BS])
            vt = tl.load(v_base + voff, mask=bmask[None, :], other=0.0)
            v = tl.trans(tl.where(kmask[None, :], vt, 0.0))
        else:
            v = tl.load(v_base + blk[:, None] * s_vb + slot[:, None] * s_vt
                        + offs_d[None, :] * s_vd, mask=kmask[:, None], other=0.0)
        if F32_DOT:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
        acc = acc * alpha[:, None] + pv
        m_i = m_new

    o = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]  # k_scale is in qk_scale
    o_off = (q_start + tok).to(tl.int64) * s_ot + head * s_oh
    tl.store(out_ptr + o_off[:, None] + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
             mask=rmask[:, None])




def _check_failed(msg: str):
    raise ValueError(f"paged_attention: {msg}")


def _check(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q) -> None:
    bad = _check_failed

    if q.dim() != 3:
        bad(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    hq, d, bs, hkv = check_paged_qkv(bad, q, k_cache, v_cache)
    B = seq_lens.shape[0] if seq_lens.dim() == 1 else -1
    if seq_lens.dtype != torch.int32 or B < 0 or not seq_lens.is_contiguous():
        bad(f"seq_lens must be contiguous int32 [B], got {seq_lens.dtype} "
            f"{tuple(seq_lens.shape)}")
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 \
            or block_tables.shape[0] != B or block_tables.stride(1) != 1:
        bad(f"block_tables must be int32 [B={B}, max_blocks] with contiguous rows, got "
            f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.shape != (B + 1,) \
            or not cu_seqlens_q.is_contiguous():
        bad(f"cu_seqlens_q must be contiguous int32 [B+1={B + 1}], got "
            f"{cu_seqlens_q.dtype} {tuple(cu_seqlens_q.shape)}")
    devs = {t.device for t in (q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)}
    if len(devs) != 1:
        bad(f"all tensors must be on one device, got {devs}")


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, seq_lens: torch.Tensor,
                    cu_seqlens_q: torch.Tensor, scale: float, *, k_scale=1.0, v_scale=1.0,
                    k_scale_cache: torch.Tensor | None = None,
                    v_scale_cache: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of q [T, Hq, D] over each sequence's paged context (see module doc).
    k_scale ... v_scale_cache: an 8-bit cache's scales (kernels/kv_quant.py).
    Requires cu_seqlens_q[-1] == T and qlen_b <= seq_lens[b] (not checked: no host sync)."""
    _check(q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q)
    kv_quant.check(_check_failed, k_cache, k_scale, v_scale, k_scale_cache,
                   v_scale_cache)
    T, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    B = seq_lens.shape[0]
    g = hq // hkv
    out = torch.empty_like(q)
    if T == 0 or B == 0:
        return out
    block_m = 64 if g <= 64 else triton.next_power_of_2(g)
    block_q = block_m // g
    block_n = 64 if d <= 128 else 32
    f32_dot = q.dtype == torch.float32 or q.device.type == "cpu"  # see decode_attention
    grid = (T // block_q + B, hkv)
    ks, vs, head, _, (ksc, vsc), s_sc = kv_quant.kernel_args(k_cache, k_scale, v_scale,
                                                             k_scale_cache, v_scale_cache)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, seq_lens, cu_seqlens_q, out,
        scale * _LOG2E, 1.0, ks, vs, ksc, vsc, B,
        q.stride(0), q.stride(1), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0),
        out.stride(0), out.stride(1), *s_sc,
        G=g, D=d, BS=bs, BLOCK_M=block_m, BLOCK_Q=block_q, BLOCK_N=block_n,
        F32_DOT=f32_dot, V_T=v_cache.stride(1) == 1, HEAD_SCALE=head,
        TOKEN_SCALE=k_scale_cache is not None, num_warps=4,
        num_stages=2 if d > 128 else 3)
    return out
