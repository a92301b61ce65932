"""What a checkpoint's quantization is, before anything loads (no torch here).

A QuantSpec names the method and, for each checkpoint weight that is quantized, its
QuantFormat in the terms of kernels/quant_layout.py (bits, group size, zero point,
offsets): what a layer needs to allocate its buffers on the meta device before the
checkpoint is read. ``formats`` maps HF weight names ("model.layers.0.self_attn.q_proj
.weight"); ``default`` stands for every linear projection (q, k, v, o, gate, up, down) of
a model with random weights (load_format "dummy": the formats of its config).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

METHODS = ("awq", "gptq", "gguf")
CHOICES = ("auto", *METHODS, "none")  # the ``quantization`` setting
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True, slots=True)
class QuantFormat:
    bits: int  # 4 or 8
    group_size: int  # rows of W [K, N] per scale row; -1: all K rows (per channel)
    zero_point: int  # subtracted from every code (0 where offsets hold the zero)
    offsets: str | None = None  # dtype of the offsets ("float16", "float32"), or none
    scales: str = "float16"  # dtype of the scales
    act_order: bool = False  # GPTQ desc_act: rows reordered, x gathered (perm)
    label: str = ""  # the checkpoint's name for it: "Q4_1", "int4 g128", ...

    def groups(self, in_features: int) -> int:
        return 1 if self.group_size == -1 else -(-in_features // self.group_size)

    def group_rows(self, in_features: int) -> int:
        return in_features if self.group_size == -1 else self.group_size


@dataclass(frozen=True, slots=True)
class QuantSpec:
    method: str  # one of METHODS
    formats: dict[str, QuantFormat] = field(default_factory=dict)
    default: QuantFormat | None = None  # load_format dummy: every linear projection
    detail: str = ""  # e.g. "sym, act-order", "version gemm"

    def format_of(self, weight_name: str) -> QuantFormat | None:
        if weight_name in self.formats:
            return self.formats[weight_name]
        if self.default is not None and weight_name.endswith(".weight") and \
                weight_name.rsplit(".", 2)[-2] in PROJECTIONS:
            return self.default
        return None

    def summary(self) -> str:
        """e.g. "gguf Q4_1 x210, Q8_0 x1" or "gptq int4 g128 (sym, act-order)"."""
        counts = Counter(f.label for f in self.formats.values())
        if self.default is not None:
            counts[self.default.label] += 0
        labels = ", ".join(f"{k} x{v}" if len(counts) > 1 and v else k
                           for k, v in sorted(counts.items()))
        return f"{self.method} {labels}" + (f" ({self.detail})" if self.detail else "")
