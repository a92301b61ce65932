"""AutoGPTQ / GPTQModel checkpoints -> kernels/quant_layout.py.

A layer of K inputs, N outputs, b bits (P = 32 / b codes per word):
  qweight int32 [K / P, N]: packed along K, code i of word j = row P*j + i (our layout)
  qzeros  int32 [G, N / P]: zero points packed along N in the same order
  scales  fp16  [G, N]
  g_idx   int32 [K]: the group (scale row) of each input row; without act-order k // group,
          with it (desc_act) the order the rows were quantized in: g_idx[perm[i]] = i // group
  W[k, n] = (q[k, n] - z[g_idx[k], n]) * s[g_idx[k], n]
Checkpoint format "gptq" (v1, AutoGPTQ's) stores z - 1 (a zero of 0 reads 15, and
becomes 16); "gptq_v2" stores z. Act-order rows are sorted by group here (perm = that
order; the kernel gathers x's columns by it), so every G rows share a scale row.
Symmetric checkpoints have every zero at 2**(b-1): kept as the layout's zero_point;
others get a float32 offset -z * s (exact).
"""
from __future__ import annotations

import torch

from pagedq.engine.quant.tensor import QuantTensor
from pagedq.kernels.quant_layout import pack_codes, unpack_codes


def unpack_columns(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [R, N / P] packed along N -> int32 [R, N]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=packed.device)
    return ((packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(packed.shape[0], -1)


def convert(qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
            g_idx: torch.Tensor | None, bits: int, group_size: int, sym: bool, v2: bool,
            name: str) -> QuantTensor:
    p = 32 // bits
    k, n = qweight.shape[0] * p, qweight.shape[1]
    group = k if group_size == -1 else group_size
    groups = -(-k // group)
    if qweight.dtype != torch.int32 or qzeros.dtype != torch.int32 or \
            tuple(qzeros.shape) != (groups, -(-n // p)) or tuple(scales.shape) != (groups, n):
        raise ValueError(f"GPTQ weight {name}: qweight {tuple(qweight.shape)}, qzeros "
                         f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)} do not form the "
                         f"{bits}-bit layout of group size {group}")
    zeros = unpack_columns(qzeros, bits)[:, :n] + (0 if v2 else 1)
    perm = None
    trivial = torch.arange(k, dtype=torch.int64) // group
    if g_idx is not None:
        g = g_idx.to(torch.int64)
        if g.shape != (k,):
            raise ValueError(f"GPTQ weight {name}: g_idx {tuple(g.shape)}, expected ({k},)")
        if not torch.equal(g, trivial):
            order = torch.argsort(g, stable=True)
            if not torch.equal(g[order], trivial):
                raise ValueError(f"GPTQ weight {name}: g_idx does not give each group "
                                 f"{group} rows; only act-order g_idx are supported")
            perm = order.to(torch.int32)
            qweight = pack_codes(unpack_codes(qweight, bits)[order], bits)
    label = f"int{bits} g{group_size}" if group_size > 0 else f"int{bits} per-channel"
    if sym:
        mid = 1 << (bits - 1)
        if not bool((zeros == mid).all()):
            raise ValueError(f"GPTQ weight {name}: the checkpoint says sym but its zero points "
                             f"are not all {mid}")
        return QuantTensor(qweight.contiguous(), scales.contiguous(), None, bits, group, mid,
                           perm, label)
    offsets = -(zeros.to(torch.float32) * scales.to(torch.float32))
    return QuantTensor(qweight.contiguous(), scales.contiguous(), offsets.contiguous(), bits,
                       group, 0, perm, label)
