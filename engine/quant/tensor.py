"""QuantTensor: one checkpoint weight, converted to kernels/quant_layout.py's layout.

The checkpoint's weight is the nn.Linear one, [N, K] (out, in); the layout holds W = its
transpose [K, N]. ``shape`` is the checkpoint's [N, K], so loaders compare it with what
the model expects as they do for a plain tensor.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedq.engine.quant.spec import QuantFormat
from pagedq.kernels import quant_layout


@dataclass(slots=True)
class QuantTensor:
    qweight: torch.Tensor  # int32 [K / P, N]
    scales: torch.Tensor  # [ceil(K / G), N]
    offsets: torch.Tensor | None  # [ceil(K / G), N] or None
    bits: int
    group_size: int  # resolved: never -1
    zero_point: int
    perm: torch.Tensor | None = None  # act-order: int32 [K]
    label: str = ""

    def __post_init__(self) -> None:
        quant_layout.check(f"quantized weight ({self.label or 'unlabelled'})", self.qweight,
                           self.scales, self.offsets, self.bits, self.group_size,
                           self.zero_point, self.perm)

    @property
    def in_features(self) -> int:
        return self.qweight.shape[0] * quant_layout.pack_factor(self.bits)

    @property
    def out_features(self) -> int:
        return self.qweight.shape[1]

    @property
    def shape(self) -> tuple[int, int]:
        return self.out_features, self.in_features

    def matches(self, fmt: QuantFormat) -> bool:
        """Whether this tensor fills a layer allocated for ``fmt``."""
        return (self.bits == fmt.bits and self.group_size == fmt.group_rows(self.in_features)
                and self.zero_point == fmt.zero_point
                and (self.offsets is None) == (fmt.offsets is None))

    def quantized(self) -> QuantTensor:
        return self

    def dense(self) -> torch.Tensor:
        """The checkpoint's weight [N, K], float32, rows in the checkpoint's order."""
        w = quant_layout.dequantize(self.qweight, self.scales, self.offsets, self.bits,
                                    self.group_size, self.zero_point)
        if self.perm is not None:
            w = w.index_select(0, torch.argsort(self.perm.long()))
        return w.t().contiguous()
