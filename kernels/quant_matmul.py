"""W4A16 / W8A16 GEMM: y [M, N] = x [M, K] @ W [K, N] (+ bias), W quantized in the layout of
kernels/quant_layout.py, dequantized tile by tile in registers and fed to tl.dot.

Grid (N tiles, M tiles, splits). Each program owns a [BLOCK_M, BLOCK_N] output tile and a
contiguous run of K tiles: decode (a few rows) has too few output tiles to keep every SM
busy streaming weights, so its K is split and the fp32 partials [splits, M, N] summed in
a fixed order by a second kernel (deterministic, unlike atomics). A K tile lies inside one
scale group when G >= BLOCK_K (one scale row per tile), or holds BLOCK_K / G groups.

Variants (constexpr, picked per shape by ``choose``; bench/quant.py measures them all):
  UNPACK 0: each of the tile's K rows loads its packed word (P rows share one: cached)
           and its group's scale; no reshape anywhere (the default);
         1: each word (and scale row) loaded once, split into its P codes (broadcast over
           its group's rows) by a reshape;
         2: no [BLOCK_K, BLOCK_N] weight at all: a K tile's words [BLOCK_K / P, BLOCK_N]
           hold P interleaved sub-matrices (code j of word p is row p * P + j), each
           dequantized where it lies and multiplied by x's matching columns (P dots of K
           = BLOCK_K / P >= 16); each word and scale loaded once, no reshape. Needs
           GROUP % P == 0 (a word's P rows share a group) and BLOCK_K >= 16 * P, else
           the launch runs 0.
  MAGIC  0: code -> float by conversion; 1: by OR-ing the code into the mantissa of 2**23
         (an int op and a float subtract instead of a quarter-rate conversion).
Few rows (decode, up to DECODE_MAX_ROWS): kernels/quant_decode.py's GEMV and tiles, which
beat these on the H200 (docs/benchmarks.md, "few-rows kernels"); ``config=`` still runs
these tiles. Many rows (prefill): at >= DENSE_MIN_ROWS rows the weight is dequantized to a
scratch [K, N] in x's dtype and multiplied by torch.matmul (cuBLAS). Measured on an H200
(bench/quant.py, Llama-3.1-8B's projections, two calls): at 256 rows that took 32-178 us
against the best fused tiles' 63-212 us, and at 2,048 rows half the fused time.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from pagedq.kernels import layout, quant_decode, quant_layout
from pagedq.kernels.layout import FLOAT

# rows from which the weight is dequantized once and multiplied by cuBLAS (see above);
# bench/quant.py's "dense" rows measure the crossover (it times them from 256 rows)
DENSE_MIN_ROWS = 256
# rows up to which kernels/quant_decode.py's few-rows kernels serve a call
DECODE_MAX_ROWS = quant_decode.MAX_ROWS


@dataclass(frozen=True, slots=True)
class Config:
    block_m: int
    block_n: int
    block_k: int
    split: int = 0  # K splits; 0: as many as fill the GPU (``fitted``)
    warps: int = 4
    stages: int = 3
    unpack: int = 0
    magic: int = 1

    @property
    def name(self) -> str:
        return (f"m{self.block_m}n{self.block_n}k{self.block_k}s{self.split}w{self.warps}"
                f"st{self.stages}u{self.unpack}g{self.magic}")


# (row bucket, N, K) -> tiles measured best on this GPU: empty unless filled (bench/quant.py
# fills it from its sweep before timing the engine); ``choose`` prefers it
TUNED: dict[tuple[int, int, int], Config] = {}
ROW_BUCKETS = (1, 8, 32, 256)  # the rows of a call -> the smallest bucket >= them


@triton.jit
def _dequant_tile(q_ptr, s_ptr, o_ptr, t, offs_n, n_ok, N, K, NG,
                  BITS: tl.constexpr, GROUP: tl.constexpr, ZP: tl.constexpr,
                  HAS_OFFSET: tl.constexpr, EVEN_K: tl.constexpr, UNPACK: tl.constexpr,
                  MAGIC: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """W rows [t * BLOCK_K, (t + 1) * BLOCK_K) x columns offs_n, float32 [BLOCK_K, BLOCK_N];
    rows past K come out 0 (their packed words and scales load as 0)."""
    P: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    KP: tl.constexpr = BLOCK_K // P
    if UNPACK == 0:
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        ptr = q_ptr + (offs_k // P)[:, None] * N + offs_n[None, :]
        if EVEN_K:
            words = tl.load(ptr, mask=n_ok[None, :], other=0)
        else:
            words = tl.load(ptr, mask=(offs_k < K)[:, None] & n_ok[None, :], other=0)
        codes = (words >> ((offs_k % P) * BITS)[:, None]) & MASK
    else:
        offs_p = t * KP + tl.arange(0, KP)
        ptr = q_ptr + offs_p[:, None] * N + offs_n[None, :]
        if EVEN_K:
            words = tl.load(ptr, mask=n_ok[None, :], other=0)
        else:
            words = tl.load(ptr, mask=(offs_p < K // P)[:, None] & n_ok[None, :], other=0)
        shifts = tl.arange(0, P) * BITS
        codes = tl.reshape((words[:, None, :] >> shifts[None, :, None]) & MASK,
                           (BLOCK_K, BLOCK_N))
    if MAGIC:  # 2**23 + code as a float's bits, minus 2**23 (exact)
        w = (codes | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + ZP)
    else:
        w = (codes - ZP).to(tl.float32)
    if GROUP >= BLOCK_K:  # the whole tile in one group: one scale row
        g = (t * BLOCK_K) // GROUP
        s = tl.load(s_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)
        w = w * s[None, :]
        if HAS_OFFSET:
            w += tl.load(o_ptr + g * N + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    elif UNPACK == 0:  # each row loads its group's scale (rows of a group share it)
        g = (t * BLOCK_K + tl.arange(0, BLOCK_K)) // GROUP
        gmask = (g < NG)[:, None] & n_ok[None, :]
        gptr = g[:, None] * N + offs_n[None, :]
        w = w * tl.load(s_ptr + gptr, mask=gmask, other=0.0).to(tl.float32)
        if HAS_OFFSET:
            w += tl.load(o_ptr + gptr, mask=gmask, other=0.0).to(tl.float32)
    else:  # each group's scale row loaded once, broadcast over its rows
        GPT: tl.constexpr = BLOCK_K // GROUP
        offs_g = t * GPT + tl.arange(0, GPT)
        gmask = (offs_g < NG)[:, None] & n_ok[None, :]
        gptr = offs_g[:, None] * N + offs_n[None, :]
        s = tl.load(s_ptr + gptr, mask=gmask, other=0.0).to(tl.float32)
        s = tl.reshape(tl.broadcast_to(s[:, None, :], (GPT, GROUP, BLOCK_N)), (BLOCK_K, BLOCK_N))
        w = w * s
        if HAS_OFFSET:
            o = tl.load(o_ptr + gptr, mask=gmask, other=0.0).to(tl.float32)
            w += tl.reshape(tl.broadcast_to(o[:, None, :], (GPT, GROUP, BLOCK_N)),
                            (BLOCK_K, BLOCK_N))
    return w


@triton.jit
def _interleaved_tile(acc, x_rows, q_ptr, s_ptr, o_ptr, perm_ptr, t, m_ok, offs_n, n_ok, N, K,
                      BITS: tl.constexpr, GROUP: tl.constexpr, ZP: tl.constexpr,
                      HAS_OFFSET: tl.constexpr, HAS_PERM: tl.constexpr, F32_DOT: tl.constexpr,
                      MAGIC: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + x[:, K tile t] @ W[K tile t, offs_n] by UNPACK 2 (module doc): word p's code j is
    row p * P + j, so the tile is P sub-matrices [BLOCK_K / P, BLOCK_N] of the same words,
    each with the words' one scale row per word (GROUP % P == 0). Rows past K load as 0."""
    P: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    KP: tl.constexpr = BLOCK_K // P
    offs_p = t * KP + tl.arange(0, KP)
    p_ok = offs_p < K // P  # K is a multiple of P (quant_layout.check)
    wmask = p_ok[:, None] & n_ok[None, :]
    words = tl.load(q_ptr + offs_p[:, None] * N + offs_n[None, :], mask=wmask, other=0)
    gptr = ((offs_p * P) // GROUP)[:, None] * N + offs_n[None, :]
    s = tl.load(s_ptr + gptr, mask=wmask, other=0.0).to(tl.float32)
    if HAS_OFFSET:
        o = tl.load(o_ptr + gptr, mask=wmask, other=0.0).to(tl.float32)
    for j in tl.static_range(P):
        codes = (words >> (j * BITS)) & MASK
        if MAGIC:  # 2**23 + code as a float's bits, minus 2**23 (exact)
            w = (codes | 0x4B000000).to(tl.float32, bitcast=True) - (8388608.0 + ZP)
        else:
            w = (codes - ZP).to(tl.float32)
        w = w * s
        if HAS_OFFSET:
            w += o
        rows = offs_p * P + j
        if HAS_PERM:  # act-order: x's columns in W's row order
            rows = tl.load(perm_ptr + rows, mask=p_ok, other=0)
        x = tl.load(x_rows + rows[None, :], mask=m_ok[:, None] & p_ok[None, :], other=0.0)
        if F32_DOT:
            acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
        else:
            acc += tl.dot(x, w.to(x.dtype))
    return acc


@triton.jit(do_not_specialize=["M", "tiles_per_split"])
def _qmm_kernel(x_ptr, q_ptr, s_ptr, o_ptr, perm_ptr, b_ptr, y_ptr, ws_ptr,
                M, N, K, NG, s_xm, s_ym, tiles_per_split,
                BITS: tl.constexpr, GROUP: tl.constexpr, ZP: tl.constexpr,
                HAS_OFFSET: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
                PARTIALS: tl.constexpr, EVEN_K: tl.constexpr, F32_DOT: tl.constexpr,
                UNPACK: tl.constexpr, MAGIC: tl.constexpr,
                BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    pid_k = tl.program_id(2)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < M
    n_ok = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * s_xm
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    t0 = pid_k * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, tl.cdiv(K, BLOCK_K))
    for t in range(t0, t1):
        if UNPACK == 2:
            acc = _interleaved_tile(acc, x_rows, q_ptr, s_ptr, o_ptr, perm_ptr, t, m_ok,
                                    offs_n, n_ok, N, K, BITS, GROUP, ZP, HAS_OFFSET, HAS_PERM,
                                    F32_DOT, MAGIC, BLOCK_K)
        else:
            offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
            k_ok = offs_k < K
            if HAS_PERM:  # act-order: x's columns in W's row order
                src = tl.load(perm_ptr + offs_k, mask=k_ok, other=0)
            else:
                src = offs_k
            if EVEN_K:
                x = tl.load(x_rows + src[None, :], mask=m_ok[:, None], other=0.0)
            else:
                x = tl.load(x_rows + src[None, :], mask=m_ok[:, None] & k_ok[None, :],
                            other=0.0)
            w = _dequant_tile(q_ptr, s_ptr, o_ptr, t, offs_n, n_ok, N, K, NG, BITS, GROUP, ZP,
                              HAS_OFFSET, EVEN_K, UNPACK, MAGIC, BLOCK_K, BLOCK_N)
            if F32_DOT:
                acc += tl.dot(x.to(tl.float32), w, input_precision="ieee")
            else:
                acc += tl.dot(x, w.to(x.dtype))
    out_mask = m_ok[:, None] & n_ok[None, :]
    if not PARTIALS:
        if HAS_BIAS:
            acc += tl.load(b_ptr + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(y_ptr + offs_m.to(tl.int64)[:, None] * s_ym + offs_n[None, :],
                 acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        row = (pid_k * M + offs_m).to(tl.int64)
        tl.store(ws_ptr + row[:, None] * N + offs_n[None, :], acc, mask=out_mask)


@triton.jit(do_not_specialize=["M", "splits"])
def _reduce_kernel(ws_ptr, b_ptr, y_ptr, M, N, s_ym, splits, HAS_BIAS: tl.constexpr,
                   BLOCK: tl.constexpr):
    """y[m, :] = sum over the splits, in order, of ws[s, m, :] (+ bias)."""
    m = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in range(splits):
        acc += tl.load(ws_ptr + (s * M + m).to(tl.int64) * N + offs, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + m.to(tl.int64) * s_ym + offs, acc.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _dequant_kernel(q_ptr, s_ptr, o_ptr, w_ptr, N, K, NG,
                    BITS: tl.constexpr, GROUP: tl.constexpr, ZP: tl.constexpr,
                    HAS_OFFSET: tl.constexpr, EVEN_K: tl.constexpr,
                    BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr):
    """W [K, N] in w's dtype (the many-rows path)."""
    t = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    w = _dequant_tile(q_ptr, s_ptr, o_ptr, t, offs_n, n_ok, N, K, NG, BITS, GROUP, ZP,
                      HAS_OFFSET, EVEN_K, 0, 1, BLOCK_K, BLOCK_N)
    offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
    tl.store(w_ptr + offs_k.to(tl.int64)[:, None] * N + offs_n[None, :],
             w.to(w_ptr.dtype.element_ty), mask=(offs_k < K)[:, None] & n_ok[None, :])


def num_sms(device: torch.device) -> int:
    return layout.num_sms(device, interpreter=8)  # small: tests reach the split path


def fit_block_k(block_k: int, group_size: int) -> int:
    """The largest power of two <= block_k that tiles the groups: a divisor of G, or a
    multiple of G (G a power of two). 0 when none >= 16 exists."""
    bk = block_k
    while bk >= 16:
        if group_size % bk == 0 or (bk % group_size == 0
                                    and group_size & (group_size - 1) == 0):
            return bk
        bk //= 2
    return 0


def interleaves(block_k: int, bits: int, group_size: int) -> bool:
    """UNPACK 2 applies: a word's codes share a group, and each of the tile's P dots has a
    K of at least 16."""
    p = quant_layout.pack_factor(bits)
    return group_size % p == 0 and block_k >= 16 * p


def row_bucket(m: int) -> int | None:
    return next((b for b in ROW_BUCKETS if m <= b), None)


def choose(m: int, n: int, k: int, group_size: int, sms: int) -> Config:
    """The tiles for one call: TUNED's for the rows' bucket if any, else decode tiles
    (<= 32 rows: 16- or 32-row tiles, 64 columns, K split until the grid has about 4
    programs per SM, each split >= 4 K tiles) or, for more rows, 64- or 128-row tiles
    without a split. The defaults are a guess until bench/quant.py's table on the H200."""
    tuned = TUNED.get((row_bucket(m), n, k))
    if tuned is not None:
        return fitted(tuned, m, n, k, group_size, sms)
    if m <= 32:
        cfg = Config(16 if m <= 16 else 32, 64, 128, warps=4, stages=3)
    elif m <= 128:
        cfg = Config(64, 128, 64, split=1, warps=4, stages=3)
    else:
        cfg = Config(128, 128, 64, split=1, warps=8, stages=3)
    return fitted(cfg, m, n, k, group_size, sms)


def fitted(cfg: Config, m: int, n: int, k: int, group_size: int, sms: int) -> Config:
    """``cfg`` with its BLOCK_K fitted to the groups and, if its split is 0, the split
    that fills the grid; ValueError if no BLOCK_K fits the group size."""
    bk = fit_block_k(cfg.block_k, group_size)
    if not bk:
        raise ValueError(f"quant_matmul: group_size {group_size} has no power-of-two "
                         f"divisor >= 16 (and is not a power of two)")
    split = cfg.split
    if split == 0:
        split = 1
        tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.block_n)
        k_tiles = triton.cdiv(k, bk)
        while split < 16 and tiles * split * 2 <= 4 * sms and k_tiles // (split * 2) >= 4:
            split *= 2
    return replace(cfg, block_k=bk, split=split)


def quant_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                 offsets: torch.Tensor | None, bits: int, group_size: int, zero_point: int,
                 bias: torch.Tensor | None = None, perm: torch.Tensor | None = None,
                 config: Config | None = None) -> torch.Tensor:
    """x [M, K] (fp16/bf16/fp32, last dim contiguous) -> y [M, N] in x's dtype.
    ``config``: the tiles to use (benchmarks); default ``choose``'s."""
    k, n = quant_layout.check("quant_matmul", qweight, scales, offsets, bits, group_size,
                              zero_point, perm)
    if x.dtype not in FLOAT or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"quant_matmul: x must be fp16/bf16/fp32 [M, {k}] with a contiguous "
                         f"last dim, got {x.dtype} {tuple(x.shape)}")
    if bias is not None and (bias.shape != (n,) or not bias.is_contiguous()):
        raise ValueError(f"quant_matmul: bias must be a contiguous [{n}], got {tuple(bias.shape)}")
    m = x.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y
    if config is None and m >= DENSE_MIN_ROWS:
        return dense_matmul(x, qweight, scales, offsets, bits, group_size, zero_point, bias,
                            perm)
    if config is None and m <= DECODE_MAX_ROWS and quant_decode.serves(m, bits, group_size):
        return quant_decode.decode_matmul(x, qweight, scales, offsets, bits, group_size,
                                          zero_point, bias, perm)
    cfg = config or choose(m, n, k, group_size, num_sms(x.device))
    if cfg.split == 0:
        cfg = fitted(cfg, m, n, k, group_size, num_sms(x.device))
    if cfg.unpack == 2 and not interleaves(cfg.block_k, bits, group_size):
        cfg = replace(cfg, unpack=0)
    k_tiles = triton.cdiv(k, cfg.block_k)
    per = triton.cdiv(k_tiles, cfg.split)
    split = triton.cdiv(k_tiles, per)  # no split without a K tile
    ws = torch.empty(split, m, n, dtype=torch.float32, device=x.device) if split > 1 else y
    even_k = k % cfg.block_k == 0
    # fp32 x: exact fp32 dots; so does the CPU interpreter, whose bf16 dot is wrong
    # (kernels/decode_attention.py)
    f32_dot = x.dtype == torch.float32 or x.device.type == "cpu"
    grid = (triton.cdiv(n, cfg.block_n), triton.cdiv(m, cfg.block_m), split)
    _qmm_kernel[grid](
        x, qweight, scales, offsets if offsets is not None else scales,
        perm if perm is not None else qweight, bias if bias is not None else scales, y, ws,
        m, n, k, scales.shape[0], x.stride(0), y.stride(0), per,
        BITS=bits, GROUP=group_size, ZP=zero_point, HAS_OFFSET=offsets is not None,
        HAS_PERM=perm is not None, HAS_BIAS=bias is not None, PARTIALS=split > 1, EVEN_K=even_k,
        F32_DOT=f32_dot, UNPACK=cfg.unpack, MAGIC=cfg.magic,
        BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k,
        num_warps=cfg.warps, num_stages=cfg.stages)
    if split > 1:
        block = min(1024, triton.next_power_of_2(n))
        _reduce_kernel[(m, triton.cdiv(n, block))](
            ws, bias if bias is not None else ws, y, m, n, y.stride(0), split,
            HAS_BIAS=bias is not None, BLOCK=block, num_warps=4)
    return y


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
               bits: int, group_size: int, zero_point: int, dtype: torch.dtype) -> torch.Tensor:
    """W [K, N] in ``dtype`` on the weight's device (one launch)."""
    k, n = quant_layout.check("dequantize", qweight, scales, offsets, bits, group_size,
                              zero_point)
    bk = fit_block_k(64, group_size)
    if not bk:
        raise ValueError(f"dequantize: group_size {group_size} cannot be tiled")
    w = torch.empty(k, n, dtype=dtype, device=qweight.device)
    grid = (triton.cdiv(k, bk), triton.cdiv(n, 128))
    _dequant_kernel[grid](qweight, scales, offsets if offsets is not None else scales, w,
                          n, k, scales.shape[0], BITS=bits, GROUP=group_size, ZP=zero_point,
                          HAS_OFFSET=offsets is not None, EVEN_K=k % bk == 0, BLOCK_K=bk,
                          BLOCK_N=128, num_warps=4)
    return w


def dense_matmul(x, qweight, scales, offsets, bits, group_size, zero_point, bias=None,
                 perm=None) -> torch.Tensor:
    """The many-rows path: dequantize into a scratch W, then x @ W by torch.matmul."""
    w = dequantize(qweight, scales, offsets, bits, group_size, zero_point, x.dtype)
    if perm is not None:
        x = x.index_select(1, perm)
    y = torch.matmul(x, w)
    return y.add_(bias.to(y.dtype)) if bias is not None else y
