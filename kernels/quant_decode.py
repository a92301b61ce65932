"""The few-rows (decode) paths of the W4A16 / W8A16 GEMM: y [M, N] = x [M, K] @ W [K, N]
(+ bias), M <= MAX_ROWS, W in the layout of kernels/quant_layout.py (no repacking: a word
row of qweight is N contiguous int32, so 4 columns are one 16-byte load).

Decode reads every weight once per step and does next to no arithmetic on it, so the only
goal is bytes: issue as few instructions per weight as possible, keep loads in flight.

Dequantization: a code c of b bits becomes the float 1 + c / 2**b by moving it into the top
mantissa bits of 1.0 (one shift and one and-or per code; no conversion instruction), and
sum_k x_k (c_k - zp) s = s * (2**b * sum x_k f_k - (2**b + zp) * sum x_k) per word row, so
the per-code work is that and one multiply-add. Every f is exact and the products keep
about 2**-17 of relative precision (the magnitudes never exceed 2 * |x|).

Two programs, one output tile [rows, BLOCK_N] and a run of K tiles of KP word rows each:
  GEMV (one row, the single-sequence step): float32 FMAs on the CUDA cores; a thread owns
    some word rows x 4 columns and accumulates a [KP, BLOCK_N] partial in registers, summed
    over rows once at the end;
  GEMV of 2..8 rows: kernels/quant_rows.py (each code dequantized once, one FMA a row);
  DOT (2..MAX_ROWS rows): each of the P codes of a word row is a [KP, BLOCK_N] slice of W
    (rows p * P + j), dequantized to x's dtype and fed to tl.dot with x's matching columns.
A word's P codes must share a scale group (GROUP % P == 0); each word row loads its group's
scale row, so any such group size works (tiles need not align with groups).

Split K: decode has too few output tiles to keep every SM streaming, so K is split over
``splits`` programs per column tile. Each writes its fp32 partial [M, BLOCK_N] to a
workspace, and the last of them to arrive (a per-column-tile counter, taken with acq_rel)
sums the partials in split order, adds the bias and writes y: one launch, deterministic.
Invariant: the counters are 0 between launches (the last program resets its own); launches
on a device are ordered (one stream), so no two launches share them at once.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from pagedq.kernels import layout, quant_rows
from pagedq.kernels.quant_parts import code_as_float, finish, k_tile, unit

MAX_ROWS = 16  # rows served here; more go to kernels/quant_matmul.py's tiles
_COUNTERS: dict[torch.device, torch.Tensor] = {}  # device -> int32 counters, all 0
_MAX_COLUMN_TILES = 1 << 16


@dataclass(frozen=True, slots=True)
class Plan:
    dot: bool  # False: GEMV (M == 1)
    block_n: int
    kp: int  # word rows per K tile
    splits: int
    warps: int = 4
    stages: int = 1
    prefetch: bool = True

    @property
    def name(self) -> str:
        return (f"{'dot' if self.dot else 'gemv'}-n{self.block_n}kp{self.kp}s{self.splits}"
                f"w{self.warps}st{self.stages}{'p' if self.prefetch else ''}")


@triton.jit
def _x_pair(x_ptr, perm_ptr, p, p_ok, J: tl.constexpr, P: tl.constexpr,
            HAS_PERM: tl.constexpr, PAIRS: tl.constexpr):
    """x[0, k] for k = p * P + J and k + 1 (J even) as float32. PAIRS: x is 16-bit and
    4-byte aligned, so both come from one 32-bit load and a shift or mask each (act-order
    gathers them one by one)."""
    if PAIRS:
        v = tl.load(x_ptr.to(tl.pointer_type(tl.int32)) + p * (P // 2) + J // 2, mask=p_ok,
                    other=0)
        if x_ptr.dtype.element_ty == tl.bfloat16:
            lo = (v << 16).to(tl.float32, bitcast=True)
            hi = (v & -65536).to(tl.float32, bitcast=True)
        else:
            lo = v.to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
            hi = (v >> 16).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    else:
        lo = _x_row(x_ptr, perm_ptr, p * P + J, p_ok, HAS_PERM)
        hi = _x_row(x_ptr, perm_ptr, p * P + J + 1, p_ok, HAS_PERM)
    return lo, hi


@triton.jit
def _x_cols(x_ptr, perm_ptr, offs_m, m_ok, s_xm, k, k_ok, HAS_PERM: tl.constexpr):
    """x [rows, k] (act-order: x's columns perm[k])."""
    if HAS_PERM:
        k = tl.load(perm_ptr + k, mask=k_ok, other=0)
    return tl.load(x_ptr + offs_m[:, None] * s_xm + k[None, :],
                   mask=m_ok[:, None] & k_ok[None, :], other=0.0)


@triton.jit
def _x_row(x_ptr, perm_ptr, k, k_ok, HAS_PERM: tl.constexpr):
    """x[0, k] as float32 (act-order: x's columns perm[k])."""
    if HAS_PERM:
        k = tl.load(perm_ptr + k, mask=k_ok, other=0)
    return tl.load(x_ptr + k, mask=k_ok, other=0.0).to(tl.float32)


@triton.jit(do_not_specialize=["M", "tiles_per_split", "splits", "m16", "m256"])
def _decode_kernel(x_ptr, q_ptr, s_ptr, o_ptr, perm_ptr, b_ptr, y_ptr, ws_ptr, cnt_ptr,
                   M, N, K, s_xm, s_ym, tiles_per_split, splits, m16, m256,
                   BITS: tl.constexpr, GROUP: tl.constexpr, ZP: tl.constexpr,
                   HAS_OFFSET: tl.constexpr, HAS_PERM: tl.constexpr, HAS_BIAS: tl.constexpr,
                   DOT: tl.constexpr, F32_DOT: tl.constexpr, PREFETCH: tl.constexpr,
                   PAIRS: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, KP: tl.constexpr):
    P: tl.constexpr = 32 // BITS
    ONE_GROUP: tl.constexpr = GROUP % (KP * P) == 0  # every K tile inside one group
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    NP = K // P  # word rows (K is a multiple of P: quant_layout.check)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < N
    offs_p = tl.arange(0, KP)
    offs_m = tl.arange(0, BLOCK_M)
    m_ok = offs_m < M
    t0 = pid_k * tiles_per_split
    t1 = tl.minimum(t0 + tiles_per_split, tl.cdiv(NP, KP))
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # DOT; GEMV in one group a tile
    part = tl.zeros((KP, BLOCK_N), dtype=tl.float32)  # GEMV, else: rows summed at the end
    p_end = tl.minimum(NP, t1 * KP)  # this program's word rows end there
    X_WORDS: tl.constexpr = not DOT and PAIRS == 2
    words, s, o, xw = k_tile(q_ptr, s_ptr, o_ptr, x_ptr, t0, offs_p, offs_n, n_ok, N, NP, p_end,
                            BITS, GROUP, HAS_OFFSET, ONE_GROUP, X_WORDS, KP)
    for t in range(t0, t1):
        if PREFETCH:  # the next tile's loads in flight while this one computes
            nwords, ns, no, nxw = k_tile(q_ptr, s_ptr, o_ptr, x_ptr, t + 1, offs_p, offs_n, n_ok,
                                        N, NP, p_end, BITS, GROUP, HAS_OFFSET, ONE_GROUP,
                                        X_WORDS, KP)
        p = t * KP + offs_p
        p_ok = p < NP
        if DOT:  # W's row p * P + j = ((f - 1) * UNIT - ZP) * s (+ o)
            for j in tl.static_range(P):
                w = code_as_float(words, m16, m256, j, BITS) * s - s * (unit(j, BITS) + ZP)
                if HAS_OFFSET:
                    w += o
                xj = _x_cols(x_ptr, perm_ptr, offs_m, m_ok, s_xm, p * P + j, p_ok, HAS_PERM)
                if F32_DOT:
                    acc += tl.dot(xj.to(tl.float32), w, input_precision="ieee")
                else:
                    acc += tl.dot(xj, w.to(xj.dtype))
        else:  # one row: a = sum_j x_j f_j and xc = sum_j (UNIT + ZP) x_j per word row,
            # so sum_j x_j (c_j - ZP) = a - xc (module doc)
            a = tl.zeros((KP, BLOCK_N), dtype=tl.float32)
            xc = tl.zeros((KP,), dtype=tl.float32)
            xs = tl.zeros((KP,), dtype=tl.float32)
            if X_WORDS:  # each row's P 16-bit x values came in one load: split them
                if P == 8:
                    xw01, xw23 = tl.split(tl.reshape(xw, (KP, 2, 2)))
                else:
                    xw01 = xw
                    xw23 = xw
                xw0, xw1 = tl.split(xw01)
                xw2, xw3 = tl.split(xw23)
                for h in tl.static_range(P // 2):
                    if h == 0:
                        v = xw0
                    elif h == 1:
                        v = xw1
                    elif h == 2:
                        v = xw2
                    else:
                        v = xw3
                    x0 = (v << 16).to(tl.float32, bitcast=True)
                    x1 = (v & -65536).to(tl.float32, bitcast=True)
                    a += x0[:, None] * code_as_float(words, m16, m256, 2 * h, BITS)
                    a += x1[:, None] * code_as_float(words, m16, m256, 2 * h + 1, BITS)
                    xc += x0 * (unit(2 * h, BITS) + ZP) + x1 * (unit(2 * h + 1, BITS) + ZP)
                    if HAS_OFFSET:
                        xs += x0 + x1
            else:
                for h in tl.static_range(P // 2):
                    x0, x1 = _x_pair(x_ptr, perm_ptr, p, p_ok, 2 * h, P, HAS_PERM, PAIRS)
                    a += x0[:, None] * code_as_float(words, m16, m256, 2 * h, BITS)
                    a += x1[:, None] * code_as_float(words, m16, m256, 2 * h + 1, BITS)
                    xc += x0 * (unit(2 * h, BITS) + ZP) + x1 * (unit(2 * h + 1, BITS) + ZP)
                    if HAS_OFFSET:
                        xs += x0 + x1
            if ONE_GROUP:  # rows summed per tile (in-thread: the warps lie along N)
                acc += s * (tl.sum(a, axis=0)[None, :] - tl.sum(xc, axis=0))
                if HAS_OFFSET:
                    acc += o * tl.sum(xs, axis=0)
            else:
                part += s * (a - xc[:, None])
                if HAS_OFFSET:
                    part += o * xs[:, None]
        if PREFETCH:
            words, s, o, xw = nwords, ns, no, nxw
        else:
            words, s, o, xw = k_tile(q_ptr, s_ptr, o_ptr, x_ptr, t + 1, offs_p, offs_n, n_ok, N,
                                    NP, p_end, BITS, GROUP, HAS_OFFSET, ONE_GROUP, X_WORDS, KP)
    if not DOT and not ONE_GROUP:
        acc = tl.sum(part, axis=0)[None, :]
    finish(acc, offs_m, m_ok, offs_n, n_ok, b_ptr, y_ptr, ws_ptr, cnt_ptr, M, N, s_ym,
            splits, pid_n, pid_k, HAS_BIAS, 8 // BLOCK_M if BLOCK_M < 8 else 1)


def serves(m: int, bits: int, group_size: int) -> bool:
    """These kernels apply: few rows, and a word's codes share a scale group."""
    return 1 <= m <= MAX_ROWS and group_size % (32 // bits) == 0


def num_sms(device: torch.device) -> int:
    return layout.num_sms(device, interpreter=8)


def plan(m: int, n: int, k: int, bits: int, sms: int) -> Plan:
    """The tiles for one call (no sweep at run time): TUNED's for the shape if measured,
    else the GEMV for one row and DOT tiles for more, with K split until there are about
    PROGRAMS_PER_SM programs per SM, each split at least MIN_TILES_PER_SPLIT K tiles."""
    tuned = TUNED.get((row_bucket(m), n, k, bits))
    if tuned is not None:
        return fit_splits(tuned, n, k, bits, sms)
    if m == 1:  # 4 warps side by side along N: 512 columns (the scale row's layout is
        # then the words', module doc), 8 word rows each thread
        return fit_splits(Plan(False, 512, 8, 0), n, k, bits, sms)
    return fit_splits(Plan(True, 128, 16, 0, warps=8), n, k, bits, sms)


PROGRAMS_PER_SM = 4
MIN_TILES_PER_SPLIT = 2
ROW_BUCKETS = (1, 8, 16)
# (row bucket, N, K, bits) -> Plan measured best on an H200 (bench/quant.py)
TUNED: dict[tuple[int, int, int, int], Plan] = {}


def row_bucket(m: int) -> int:
    return next(b for b in ROW_BUCKETS if m <= b)


def fit_splits(p: Plan, n: int, k: int, bits: int, sms: int) -> Plan:
    """``p`` with splits set (when 0) from the grid it would have."""
    if p.splits:
        return p
    tiles = triton.cdiv(n, p.block_n)
    k_tiles = triton.cdiv(k // (32 // bits), p.kp)
    splits = 1
    while (tiles * splits * 2 <= PROGRAMS_PER_SM * sms
           and k_tiles // (splits * 2) >= MIN_TILES_PER_SPLIT):
        splits *= 2
    return replace(p, splits=splits)


def _counters(device: torch.device, tiles: int) -> torch.Tensor:
    if tiles > _MAX_COLUMN_TILES:
        raise ValueError(f"quant_decode: {tiles} column tiles, at most {_MAX_COLUMN_TILES}")
    cnt = _COUNTERS.get(device)
    if cnt is None:  # never freed: captured CUDA graphs keep its address
        cnt = _COUNTERS[device] = torch.zeros(_MAX_COLUMN_TILES, dtype=torch.int32,
                                              device=device)
    return cnt


def decode_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor,
                  offsets: torch.Tensor | None, bits: int, group_size: int, zero_point: int,
                  bias: torch.Tensor | None = None, perm: torch.Tensor | None = None,
                  p: Plan | None = None) -> torch.Tensor:
    """y [M, N] in x's dtype; the caller (kernels/quant_matmul.py) has checked the
    arguments and that ``serves(M, bits, group_size)``. ``p``: tiles to use (benchmarks)."""
    m, k = x.shape
    n = qweight.shape[1]
    sms = num_sms(x.device)
    p = fit_splits(p, n, k, bits, sms) if p is not None else plan(m, n, k, bits, sms)
    if not p.dot and m > quant_rows.MAX_ROWS:
        raise ValueError(f"quant_decode: a GEMV plan takes 1 to {quant_rows.MAX_ROWS} rows, "
                         f"got {m}")
    if p.dot and p.kp < 16:
        raise ValueError(f"quant_decode: a DOT plan needs kp >= 16 (tl.dot's K), got {p.kp}")
    k_tiles = triton.cdiv(k // (32 // bits), p.kp)
    per = triton.cdiv(k_tiles, p.splits)
    splits = triton.cdiv(k_tiles, per)  # no split without a K tile
    tiles = triton.cdiv(n, p.block_n)
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    ws = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else y
    cnt = _counters(x.device, tiles)  # (compiled in even when splits == 1)
    # fp32 x: exact fp32 dots; so does the CPU interpreter, whose bf16 dot is wrong
    f32_dot = x.dtype == torch.float32 or x.device.type == "cpu"
    if not p.dot and m > 1:  # the rows GEMV (kernels/quant_rows.py)
        if p.kp != 1:
            raise ValueError(f"quant_decode: a GEMV plan of several rows takes kp 1, got "
                             f"{p.kp}")
        quant_rows._rows_kernel[(tiles, splits)](
            x, qweight, scales, offsets if offsets is not None else scales,
            perm if perm is not None else qweight, bias if bias is not None else scales, y, ws,
            cnt, m, n, k, x.stride(0), y.stride(0), per, splits, 0x41800000, 0x43800000,
            BITS=bits, GROUP=group_size, ZP=zero_point, HAS_OFFSET=offsets is not None,
            HAS_PERM=perm is not None, HAS_BIAS=bias is not None, PREFETCH=p.prefetch,
            BLOCK_M=triton.next_power_of_2(m), BLOCK_N=p.block_n, KP=p.kp, num_warps=p.warps,
            num_stages=p.stages)
        return y
    block_m = 1 if not p.dot else max(16, triton.next_power_of_2(m))
    _decode_kernel[(tiles, splits)](
        x, qweight, scales, offsets if offsets is not None else scales,
        perm if perm is not None else qweight, bias if bias is not None else scales, y, ws,
        cnt, m, n, k, x.stride(0), y.stride(0), per, splits, 0x41800000, 0x43800000,
        BITS=bits, GROUP=group_size, ZP=zero_point, HAS_OFFSET=offsets is not None,
        HAS_PERM=perm is not None, HAS_BIAS=bias is not None, DOT=p.dot, F32_DOT=f32_dot, PREFETCH=p.prefetch,
        PAIRS=x.element_size() == 2 and x.data_ptr() % 4 == 0 and perm is None,
        BLOCK_M=block_m, BLOCK_N=p.block_n, KP=p.kp, num_warps=p.warps, num_stages=p.stages)
    return y
