"""Paged decode attention (one query token per sequence), GQA-aware, split-K.

Grid (Hkv, B, S): program (h, i, s) holds the G = Hq // Hkv query heads of KV head h of
sequence b = order[i] (b = i without an order) against its tiles of BLOCK_N tokens (one
online-softmax step each: kernels/decode_tile.py, in the form and dots of the variant), so each
KV block is read from memory once per group. Programs start in grid order, so an order
with the longest contexts first (``longest_first``) leaves only short programs for the
last wave (H200, workload-1 contexts in random order: B 180 x 400-1,900 tokens 215.6
against 231.9 us, fp8 156.0 against 194.5; B 128 x 600-2,000 165.6 against 193.9 us).
Split s covers tokens [s*chunk, (s+1)*chunk) of sequence b, chunk = ceil(L_b / S) rounded
up to BLOCK_N (per sequence, from its own length, so splits are balanced on device with no
host sync). With S == 1 the program normalises and writes `out` directly; otherwise it
writes a normalised partial [B, Hq, S, D] fp32 plus its log2-sum-exp [B, Hq, S], and
`_reduce_kernel` (grid (B, Hq)) merges the splits.
Scores live in the log2 domain: q.k is multiplied by scale * log2(e).

Caches are read through their strides (kernels/layout.py); the engine's fp8 V is
transposed, so that 8-bit P.V operands need no byte-wise transpose (kernels/decode_tile.py).
With a transposed V the loop runs over whole tiles without masks and the last, partial tile
reads whole blocks; with a token-major V every tile is masked per token.

Variants (VARIANTS; DEFAULTS picks what paged_decode_attention runs per cache kind):
  tile: the heads as the dots' rows, fp8 tiles converted to fp16 in registers.
  swap: the tokens as the dots' rows, in a warpgroup (4 warps), so that Triton emits wgmmas
    (it does from a 64-token M and a 16-column N); fp8 tiles converted as in tile.
  swap8: swap with e4m3 wgmmas on the cache's own bytes (no conversion of K or V).
Speed (H200, docs/benchmarks.md "Decode attention"): tile is latency-bound per tile once the
cache is fp8: it reads bf16 at ~4.1 TB/s but fp8 at ~2.5 TB/s with the bf16 knobs, with or
without e4m3 conversions. More programs per SM paid: fp8 tile runs one warp per program (3.0
TB/s of fp8 bytes, 0.70x the bf16 kernel's time); bf16 keeps 4. Compiled for sm_90 by Triton
3.6 (ptxas), that one-warp program takes 255 registers and spills; swap8's takes ~100 with
no conversions: bench/round3.py times them all.
"""
from __future__ import annotations

import functools
from collections.abc import Mapping
from types import MappingProxyType

import torch
import triton
import triton.language as tl

from pagedq.kernels import decode_tile as tile
from pagedq.kernels import kv_quant, layout
from pagedq.kernels.layout import check_paged_qkv, is_transposed

_LOG2E = 1.4426950408889634


# Step-varying arguments are not specialised (see prefill_attention._prefill_kernel), nor
# the alignment of a layer's scales (views of every layer's: one variant for all layers).
@triton.jit(do_not_specialize=["s_btb", "splits"],
            do_not_specialize_on_alignment=["bt_ptr", "lens_ptr", "order_ptr", "ks_ptr",
                                            "vs_ptr"])
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, lens_ptr, order_ptr, out_ptr, part_ptr, lse_ptr,
                   qk_scale, v_scale, ks_ptr, vs_ptr, ksc_ptr, vsc_ptr,
                   s_qb, s_qh, s_kb, s_kt, s_kh, s_kd, s_vb, s_vt, s_vh, s_vd, s_btb,
                   s_ob, s_oh, s_scb, s_sct, splits,
                   HQ: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr,
                   D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr,
                   SINGLE: tl.constexpr, F32_DOT: tl.constexpr, FP8_KV: tl.constexpr,
                   V_T: tl.constexpr, ORDERED: tl.constexpr, SWAP: tl.constexpr,
                   MMA8: tl.constexpr, HEAD_SCALE: tl.constexpr, TOKEN_SCALE: tl.constexpr):
    kvh = tl.program_id(0)  # fastest: the Hkv programs of a sequence read each block together
    b = tl.program_id(1)
    if ORDERED:
        b = tl.load(order_ptr + b)
    split = tl.program_id(2)
    seq_len = tl.load(lens_ptr + b)
    chunk = tl.cdiv(tl.cdiv(seq_len, splits), BLOCK_N) * BLOCK_N
    lo = split * chunk
    hi = tl.minimum(lo + chunk, seq_len)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * G + offs_g
    gmask = offs_g < G
    q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + offs_d[None, :],
                mask=gmask[:, None], other=0.0)
    if HEAD_SCALE:  # an fp8 cache's scales of this KV head (kernels/kv_quant.py)
        qk_scale = qk_scale * tl.load(ks_ptr + kvh)
        v_scale = v_scale * tl.load(vs_ptr + kvh)
    qa, qb, rscale = tile.prepare_q(q, qk_scale, SWAP, MMA8, FP8_KV)

    m_i = tl.full([G_PAD], tile.NEG, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    if SWAP:
        acc = tl.zeros([D, G_PAD], tl.float32)  # transposed: the heads are columns
    else:
        acc = tl.zeros([G_PAD, D], tl.float32)
    bt_row = bt_ptr + b.to(tl.int64) * s_btb
    k_base = k_ptr + kvh * s_kh
    v_base = v_ptr + kvh * s_vh
    ksc_base = ksc_ptr + kvh  # an int8 cache's scale caches: [blocks, BS, Hkv] contiguous
    vsc_base = vsc_ptr + kvh
    if V_T:  # unmasked whole tiles, then one masked tile (V's partial block: any bits)
        full = lo + (hi - lo) // BLOCK_N * BLOCK_N
        for start in tl.range(lo, full, BLOCK_N):
            m_i, l_i, acc = tile.tile(qa, qb, rscale, m_i, l_i, acc, start, hi, bt_row, k_base,
                                      v_base, s_kb, s_kt, s_kd, s_vb, s_vt, s_vd, offs_n, offs_d,
                                      ksc_base, vsc_base, s_scb, s_sct,
                                      BS, F32_DOT, V_T, False, SWAP, MMA8, TOKEN_SCALE)
        if full < hi:
            m_i, l_i, acc = tile.tile(qa, qb, rscale, m_i, l_i, acc, full, hi, bt_row, k_base,
                                      v_base, s_kb, s_kt, s_kd, s_vb, s_vt, s_vd, offs_n, offs_d,
                                      ksc_base, vsc_base, s_scb, s_sct,
                                      BS, F32_DOT, V_T, True, SWAP, MMA8, TOKEN_SCALE)
    else:  # token-major V: every tile masked (the split loop made bf16 slower at B = 256)
        for start in tl.range(lo, hi, BLOCK_N):
            m_i, l_i, acc = tile.tile(qa, qb, rscale, m_i, l_i, acc, start, hi, bt_row, k_base,
                                      v_base, s_kb, s_kt, s_kd, s_vb, s_vt, s_vd, offs_n, offs_d,
                                      ksc_base, vsc_base, s_scb, s_sct,
                                      BS, F32_DOT, V_T, True, SWAP, MMA8, TOKEN_SCALE)

    # empty range (L_b == 0 or an idle split): 0; v_scale (and MMA8's p scale) folded in
    # here, k_scale in qk_scale
    if MMA8:
        v_scale = v_scale / tile.P8_SCALE
    inv = v_scale / tl.where(l_i > 0, l_i, 1.0)
    row = (b * HQ + heads) * splits + split
    if SWAP:
        o = acc * inv[None, :]
        o_off = heads[None, :] * s_oh + offs_d[:, None]
        p_off = row[None, :] * D + offs_d[:, None]
        omask = gmask[None, :]
    else:
        o = acc * inv[:, None]
        o_off = heads[:, None] * s_oh + offs_d[None, :]
        p_off = row[:, None] * D + offs_d[None, :]
        omask = gmask[:, None]
    if SINGLE:
        tl.store(out_ptr + b * s_ob + o_off, o.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        tl.store(part_ptr + p_off, o, mask=omask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(lse_ptr + row, lse, mask=gmask)


@triton.jit(do_not_specialize=["splits"])
def _reduce_kernel(part_ptr, lse_ptr, out_ptr, s_ob, s_oh, splits,
                   HQ: tl.constexpr, D: tl.constexpr, S_PAD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D)
    row = (b * HQ + h) * splits
    smask = offs_s < splits
    lse = tl.load(lse_ptr + row + offs_s, mask=smask, other=float("-inf"))
    m = tl.max(lse, 0)
    m = tl.where(m == float("-inf"), 0.0, m)
    w = tl.exp2(lse - m)
    part = tl.load(part_ptr + (row + offs_s)[:, None] * D + offs_d[None, :],
                   mask=smask[:, None], other=0.0)
    den = tl.sum(w, 0)
    o = tl.sum(part * w[:, None], 0) / tl.where(den > 0, den, 1.0)
    tl.store(out_ptr + b * s_ob + h * s_oh + offs_d, o.to(out_ptr.dtype.element_ty))




def _num_sms(device: torch.device) -> int:
    return layout.num_sms(device, interpreter=16)  # small: tests reach the split path


def choose_num_splits(batch: int, kv_heads: int, max_ctx: int, num_sms: int,
                      block_n: int, per_sm: int = 4) -> int:
    """Splits per sequence so that all B * Hkv * S programs are resident in ONE wave.

    The default tiles (D 128, BLOCK_N 64, 4 warps) take 127 registers (ptxas, sm_90): 4
    programs fit an SM, and bf16 assumes 4 (per_sm; 3 left B = 32 x 1,200-2,000 uneven
    tokens at one program per SM: 75 us against 59.5 with 2 splits, H200).
    One wave of >= 100 programs keeps far more than the ~4 MB needed in flight (each has a
    32 KiB K+V tile outstanding), so extra splits would only add the reduction's cost. No
    split is shorter than max(4 tiles, 256 tokens). An fp8 cache passes per_sm=8: its
    one-warp programs are latency-bound, not bound by bytes, so more of them pay (the H200
    sweep: 8 a little ahead of 16 at 64 x 4096 and 16 x 16384).
    """
    programs = batch * kv_heads
    fill = (per_sm * num_sms) // programs
    min_chunk = max(4 * block_n, 256) if num_sms > 16 else block_n
    by_len = max(1, triton.cdiv(max_ctx, min_chunk))
    return max(1, min(fill, by_len, 64))


def longest_first(seq_lens: torch.Tensor) -> torch.Tensor:
    """A decode batch's rows, longest context first: the ``order`` that launches the
    longest programs first (module doc). On the device, no host sync (CUDA-graph safe)."""
    return torch.argsort(seq_lens, descending=True).to(torch.int32)


def _check(q, k_cache, v_cache, block_tables, seq_lens, order, kq) -> None:
    def bad(msg: str):
        raise ValueError(f"paged_decode_attention: {msg}")

    if q.dim() != 3:
        bad(f"q must be [B, Hq, D], got shape {tuple(q.shape)}")
    B = q.shape[0]
    hq, d, bs, hkv = check_paged_qkv(bad, q, k_cache, v_cache)
    kv_quant.check(bad, k_cache, **kq)
    if block_tables.dtype != torch.int32 or block_tables.dim() != 2 \
            or block_tables.shape[0] != B or block_tables.stride(1) != 1:
        bad(f"block_tables must be int32 [B={B}, max_blocks] with contiguous rows, got "
            f"{block_tables.dtype} {tuple(block_tables.shape)}")
    if seq_lens.dtype != torch.int32 or seq_lens.shape != (B,) or not seq_lens.is_contiguous():
        bad(f"seq_lens must be contiguous int32 [B={B}], got {seq_lens.dtype} "
            f"{tuple(seq_lens.shape)}")
    if order is not None and (order.dtype != torch.int32 or order.shape != (B,)
                              or not order.is_contiguous()):
        bad(f"order must be contiguous int32 [B={B}] (a permutation of the rows), got "
            f"{order.dtype} {tuple(order.shape)}")
    devs = {t.device for t in (q, k_cache, v_cache, block_tables, seq_lens, order)
            if t is not None}
    if len(devs) != 1:
        bad(f"all tensors must be on one device, got {devs}")


# The kernel's variants (kernels/decode_tile.py): its form (rows or swap) and its dots.
VARIANTS = {
    "tile": dict(swap=False, mma8=False),  # q heads as the dots' rows; fp8 tiles -> fp16
    "swap": dict(swap=True, mma8=False),  # tokens as the dots' rows; fp8 tiles -> fp16
    "swap8": dict(swap=True, mma8=True),  # tokens as rows; e4m3 dots on the cache's bytes
}
_KNOBS = {"bn": "block_n", "w": "num_warps", "st": "num_stages", "sm": "per_sm",
          "splits": "num_splits"}
# What paged_decode_attention runs, per cache kind (kv_quant.kind: "fp8" float8_e4m3fn,
# "fp8_e5m2", "int8", "16bit" the others): a variant spec, "name" or
# "name:knob=value,...", knobs as in parse_variant.
DEFAULTS = {"fp8": "tile", "fp8_e5m2": "tile", "int8": "tile", "16bit": "tile"}


@functools.cache
def parse_variant(spec: str) -> Mapping[str, object]:
    """"swap8:w=1,bn=64,st=2,sm=8" -> decode_launch keywords (variant, block_n, num_warps,
    num_stages, per_sm, num_splits), read-only. ValueError (one line) on a bad spec."""
    name, _, knobs = spec.partition(":")
    if name not in VARIANTS:
        raise ValueError(f"decode variant {name!r}: not one of {', '.join(VARIANTS)}")
    out: dict = {"variant": name}
    for item in filter(None, knobs.split(",")):
        key, eq, value = item.partition("=")
        if key not in _KNOBS or not eq or not value.isdigit() or int(value) < 1:
            raise ValueError(f"decode variant {spec!r}: bad knob {item!r} (knobs: "
                             f"{', '.join(f'{k}=N' for k in _KNOBS)})")
        out[_KNOBS[key]] = int(value)
    return MappingProxyType(out)


def use_variant(cache: str, spec: str) -> None:
    """Make ``spec`` what paged_decode_attention runs for caches of kind ``cache`` (a key of
    DEFAULTS), in this process (bench/offline.py --decode-variant: before the engine starts,
    since CUDA graphs capture the kernel they see)."""
    if cache not in DEFAULTS:
        raise ValueError(f"decode variant cache kind {cache!r}: not one of {', '.join(DEFAULTS)}")
    parse_variant(spec)
    DEFAULTS[cache] = spec


def decode_launch(q, k_cache, v_cache, block_tables, seq_lens, scale, *,
                  k_scale=1.0, v_scale=1.0, k_scale_cache=None, v_scale_cache=None,
                  order=None, variant: str = "tile", num_splits: int | None = None,
                  block_n: int | None = None, num_warps: int | None = None,
                  num_stages: int | None = None, per_sm: int | None = None):
    """paged_decode_attention with its variant (VARIANTS) and tuning knobs exposed (bench
    sweeps; tests). Knobs left None take the variant's defaults; per_sm: the programs per SM
    assumed when choosing splits (choose_num_splits)."""
    kq = dict(k_scale=k_scale, v_scale=v_scale, k_scale_cache=k_scale_cache,
              v_scale_cache=v_scale_cache)
    _check(q, k_cache, v_cache, block_tables, seq_lens, order, kq)
    if variant not in VARIANTS:
        raise ValueError(f"paged_decode_attention: variant {variant!r} not one of "
                         f"{', '.join(VARIANTS)}")
    swap, mma8 = VARIANTS[variant]["swap"], VARIANTS[variant]["mma8"]
    B, hq, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    g = hq // hkv
    if B > 65535:
        raise ValueError(f"paged_decode_attention: batch {B} > 65535 (grid axis limit)")
    out = torch.empty_like(q)
    if B == 0:
        return out
    # fp32 inputs get exact fp32 dots; so does the CPU interpreter, whose bf16 dot is wrong
    # (triton 3.9 reads bf16 operands as integers).
    f32_dot = q.dtype == torch.float32 or q.device.type == "cpu"
    e4m3 = k_cache.dtype == torch.float8_e4m3fn
    eight = k_cache.element_size() == 1 and not f32_dot  # 8-bit tiles converted in registers
    fp8 = eight and k_cache.dtype in kv_quant.FP8  # ... to fp16 (int8: to q's dtype)
    v_t = is_transposed(v_cache)
    if mma8 and not (e4m3 and (v_t or f32_dot)):  # (e4m3 operands must be K-major)
        raise ValueError(f"paged_decode_attention: variant {variant!r} needs a float8_e4m3fn "
                         "cache with V in the transposed layout (kernels/layout.py)")
    if swap and eight and not mma8:
        # on an H200 (Triton 3.6) this form read out of bounds: non-finite outputs, then an
        # illegal address (docs/benchmarks.md, "Round three": decode variants that failed on the GPU); its interpreter runs pass
        raise ValueError(f"paged_decode_attention: variant {variant!r} converts an 8-bit "
                         "cache's tiles, which failed on the GPU: use swap8 (e4m3) or tile")
    if block_n is None:
        block_n = 64 if d <= 128 else 32
    if mma8 and (block_n < 32 or d < 32):
        raise ValueError(f"paged_decode_attention: variant {variant!r} needs block_n and "
                         f"head_dim >= 32 (e4m3 dots), got {block_n} and {d}")
    max_ctx = block_tables.shape[1] * bs  # upper bound on any seq_len, known without a sync
    sms = _num_sms(q.device)
    # bench/attention.py --fp8-sweep picked one-warp programs for fp8 tiles (module doc), and
    # every 8-bit cache takes them until it is timed on its own; fp8 with a token-major V
    # keeps the defaults of the kernel before the transposed layout.
    # swap runs a warpgroup (4 warps), which its dots need to be wgmmas.
    small = eight and v_t and d <= 128 and not swap
    if num_splits is None:
        num_splits = choose_num_splits(B, hkv, max_ctx, sms, block_n,
                                       per_sm=per_sm or (8 if eight and not swap else 4))
    if num_splits < 1:
        raise ValueError(f"paged_decode_attention: num_splits must be >= 1, got {num_splits}")
    if num_warps is None:
        num_warps = 1 if small else 4
    if num_stages is None:
        # bf16: a deeper pipeline pays once programs queue for SMs (workload-1 contexts, H200:
        # B 180 x 400-1,400 tokens 162.0 us at 5 stages against 166.3 at 3; B 64 x
        # 1,000-2,000, 2.2 programs per SM: 3 stages ahead)
        deep = B * hkv * num_splits >= 8 * sms
        num_stages = 2 if small or d > 128 else 3 if swap else 5 if eight or deep else 3
    # the heads are the dots' M (rows) or N (swap), 16 at least (Triton 3.6 runs a wgmma
    # only from N = 16: swap's tiles of 64 tokens are its M)
    g_pad = max(16, triton.next_power_of_2(g))
    if num_splits > 1:
        part = torch.empty(B, hq, num_splits, d, dtype=torch.float32, device=q.device)
        lse = torch.empty(B, hq, num_splits, dtype=torch.float32, device=q.device)
    else:
        part = lse = out  # unused
    ks, vs, head, _, (ksc, vsc), s_sc = kv_quant.kernel_args(k_cache, k_scale, v_scale,
                                                             k_scale_cache, v_scale_cache)
    _decode_kernel[(hkv, B, num_splits)](
        q, k_cache, v_cache, block_tables, seq_lens,
        seq_lens if order is None else order,  # (unread without an order: ORDERED=False)
        out, part, lse, scale * _LOG2E, 1.0, ks, vs, ksc, vsc,
        q.stride(0), q.stride(1), *k_cache.stride(), *v_cache.stride(), block_tables.stride(0),
        out.stride(0), out.stride(1), *s_sc, num_splits,
        HQ=hq, G=g, G_PAD=g_pad, D=d, BS=bs, BLOCK_N=block_n, SINGLE=num_splits == 1,
        F32_DOT=f32_dot, FP8_KV=fp8, V_T=v_t, ORDERED=order is not None, SWAP=swap,
        MMA8=mma8, HEAD_SCALE=head, TOKEN_SCALE=k_scale_cache is not None,
        num_warps=num_warps, num_stages=num_stages)
    if num_splits > 1:
        _reduce_kernel[(B, hq)](part, lse, out, out.stride(0), out.stride(1), num_splits,
                                HQ=hq, D=d, S_PAD=max(2, triton.next_power_of_2(num_splits)),
                                num_warps=4)
    return out


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor,
                           scale: float, order: torch.Tensor | None = None,
                           **kq) -> torch.Tensor:
    """Decode: q [B, Hq, D], one query per sequence at its last position (seq_lens[b]-1).
    order: the rows in launch order (``longest_first``), or None (row order); it changes
    only the speed, never a result. ``kq``: an 8-bit cache's scales (k_scale, v_scale,
    k_scale_cache, v_scale_cache: kernels/kv_quant.py). Runs the variant DEFAULTS names
    for the cache's kind."""
    knobs = parse_variant(DEFAULTS[kv_quant.kind(k_cache.dtype)])
    return decode_launch(q, k_cache, v_cache, block_tables, seq_lens, scale, order=order,
                         **kq, **knobs)
