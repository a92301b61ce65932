"""AutoAWQ's GEMM layout (version "gemm") -> kernels/quant_layout.py.

A layer of K inputs, N outputs, groups of G input rows:
  qweight int32 [K, N / 8]: packed along N; nibble i (bits 4i..4i+3) of word j holds
          output column 8j + AWQ_ORDER[i] (the order AutoAWQ's CUDA GEMM unpacks fastest)
  qzeros  int32 [K / G, N / 8]: the zero points, packed the same way
  scales  fp16  [K / G, N]
  W[k, n] = (q[k, n] - z[k // G, n]) * s[k // G, n]
Here the codes are repacked along K and the zero folded into a float32 offset -z * s
(exact: 4-bit times fp16 fits float32's mantissa).
"""
from __future__ import annotations

import torch

from pagedq.engine.quant.tensor import QuantTensor
from pagedq.kernels.quant_layout import pack_codes

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i -> column offset within its word


def unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, N / 8] in AWQ's column order -> int32 codes [R, N]."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(-1) >> shifts) & 0xF  # [R, N / 8, 8], nibble i at [..., i]
    codes = torch.empty_like(nibbles)
    codes[..., list(AWQ_ORDER)] = nibbles
    return codes.reshape(packed.shape[0], -1)


def convert(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
            group_size: int, name: str) -> QuantTensor:
    k, n = qweight.shape[0], qweight.shape[1] * 8
    group = k if group_size == -1 else group_size
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or k % group or \
            tuple(qzeros.shape) != (k // group, n // 8) or tuple(scales.shape) != (k // group, n):
        raise ValueError(f"AWQ weight {name}: qweight {tuple(qweight.shape)}, qzeros "
                         f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)} do not form "
                         f"the GEMM layout of group size {group}")
    zeros = unpack_columns(qzeros).to(torch.float32)
    offsets = -(zeros * scales.to(torch.float32))
    return QuantTensor(pack_codes(unpack_columns(qweight), 4), scales.contiguous(),
                       offsets.contiguous(), 4, group, 0, label=f"int4 g{group_size}")
