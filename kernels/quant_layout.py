"""The one layout of quantized weights that every quantized kernel, twin and loader shares.

A linear layer's weight W is [K, N] here (K = in_features, N = out_features: y = x W), so
nn.Linear's [out, in] weight is its transpose. Every format pagedq reads (AWQ, GPTQ, GGUF
Q4_0 / Q4_1 / Q8_0) is converted to it once, at load (engine/quant/):

  qweight  int32 [K / P, N], P = 32 // bits codes per word, packed along K:
           code(k, n) = (qweight[k // P, n] >> (bits * (k % P))) & (2**bits - 1)
           (GPTQ's own qweight layout; AWQ and GGUF are repacked into it)
  scales   [ceil(K / G), N] float16 / bfloat16 / float32; G = group_size
  offsets  None, or [ceil(K / G), N] float16 / float32
  W[k, n]  = (code(k, n) - zero_point) * scales[k // G, n] + offsets[k // G, n]
           computed in float32 (no offsets: + 0). zero_point is one integer for the whole
           weight: 8 for symmetric 4-bit (GPTQ sym, GGUF Q4_0), 128 for 8-bit codes of
           signed values (GGUF Q8_0), 0 where offsets hold the zero (AWQ, GPTQ asym: offset
           = -zero * scale, float32 so that it is exact; GGUF Q4_1: offset = its min m).
  perm     None, or int [K]: GPTQ act-order. y = x[:, perm] W, where W's rows are the
           checkpoint's rows in the order perm, so that every group of G rows is contiguous.

With these choices the float32 value of every weight is exactly the quantizer's own
dequantized value (each product above has at most 19 significant bits).
"""
from __future__ import annotations

import torch

BITS = (4, 8)
SCALE_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
OFFSET_DTYPES = (torch.float16, torch.float32)


def pack_factor(bits: int) -> int:
    return 32 // bits


def pack_codes(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """codes [K, N] (integers in [0, 2**bits)) -> qweight int32 [K / P, N]."""
    p = pack_factor(bits)
    k, n = codes.shape
    if k % p:
        raise ValueError(f"pack_codes: K={k} is not a multiple of {p} ({bits}-bit codes)")
    c = codes.to(torch.uint8)
    if bits == 4:  # rows 2j, 2j + 1 -> the low, high nibble of byte j
        c = c.view(k // 2, 2, n)
        c = c[:, 0] | (c[:, 1] << 4)
    # bytes 4w..4w+3 of a column -> its word w, least significant first (little-endian)
    words = c.reshape(k // p, 4, n).permute(0, 2, 1).reshape(-1, 4).contiguous()
    if torch.tensor([1], dtype=torch.int32).view(torch.uint8)[0] != 1:
        raise RuntimeError("pack_codes: a big-endian host")
    return words.view(torch.int32).view(k // p, n)


def unpack_codes(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """qweight int32 [K / P, N] -> codes int32 [K, N]."""
    p = pack_factor(bits)
    shifts = (torch.arange(p, dtype=torch.int32, device=qweight.device) * bits).view(1, p, 1)
    codes = (qweight.unsqueeze(1) >> shifts) & ((1 << bits) - 1)
    return codes.reshape(qweight.shape[0] * p, qweight.shape[1])


def group_rows(k: int, group_size: int, device=None) -> torch.Tensor:
    """The scale row of each of the K weight rows."""
    return torch.arange(k, device=device) // group_size


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, offsets: torch.Tensor | None,
               bits: int, group_size: int, zero_point: int) -> torch.Tensor:
    """W [K, N] float32 of the layout above (the contract every kernel computes)."""
    codes = unpack_codes(qweight, bits)
    k, n = codes.shape
    w = (codes - zero_point).to(torch.float32)
    if k % group_size == 0:  # whole groups: broadcast each scale row over its rows
        w = w.view(k // group_size, group_size, n).mul_(scales.to(torch.float32).unsqueeze(1))
        if offsets is not None:
            w.add_(offsets.to(torch.float32).unsqueeze(1))
        return w.view(k, n)
    g = group_rows(k, group_size, codes.device)
    w *= scales.to(torch.float32)[g]
    if offsets is not None:
        w += offsets.to(torch.float32)[g]
    return w


def check(where: str, qweight: torch.Tensor, scales: torch.Tensor,
          offsets: torch.Tensor | None, bits: int, group_size: int, zero_point: int,
          perm: torch.Tensor | None = None) -> tuple[int, int]:
    """Validate one quantized weight; returns (K, N). ValueError naming ``where``."""
    def bad(msg: str):
        raise ValueError(f"{where}: {msg}")
    if bits not in BITS:
        bad(f"bits must be 4 or 8, got {bits}")
    if qweight.dtype != torch.int32 or qweight.dim() != 2:
        bad(f"qweight must be int32 [K / {pack_factor(bits)}, N], got {qweight.dtype} "
            f"{tuple(qweight.shape)}")
    k, n = qweight.shape[0] * pack_factor(bits), qweight.shape[1]
    if group_size < 1:
        bad(f"group_size must be >= 1, got {group_size}")
    groups = -(-k // group_size)
    if scales.dtype not in SCALE_DTYPES or tuple(scales.shape) != (groups, n):
        bad(f"scales must be fp16/bf16/fp32 [{groups}, {n}], got {scales.dtype} "
            f"{tuple(scales.shape)}")
    if offsets is not None and (offsets.dtype not in OFFSET_DTYPES
                                or tuple(offsets.shape) != (groups, n)):
        bad(f"offsets must be fp16/fp32 [{groups}, {n}], got {offsets.dtype} "
            f"{tuple(offsets.shape)}")
    if not 0 <= zero_point < (1 << bits):
        bad(f"zero_point must be in [0, {1 << bits}), got {zero_point}")
    if perm is not None and (perm.dim() != 1 or perm.shape[0] != k or perm.is_floating_point()):
        bad(f"perm must be an integer [K={k}] tensor, got {perm.dtype} {tuple(perm.shape)}")
    for name, t in (("qweight", qweight), ("scales", scales), ("offsets", offsets),
                    ("perm", perm)):
        if t is not None and not t.is_contiguous():
            bad(f"{name} must be contiguous")
        if t is not None and t.device != qweight.device:
            bad(f"{name} is on {t.device}, qweight on {qweight.device}")
    return k, n
