"""A model's layers swapped for quantized ones.

``quantize(model, spec)`` runs on the meta device, after the model's cast to its dtype and
before its memory is allocated: each linear layer whose checkpoint tensors (every shard of
a merged projection: ``model.stacked`` maps HF projection names onto them) are all
quantized in one format becomes a QuantLinear; the embedding and LM head become a
QuantEmbedding likewise. A layer whose shards differ (a GGUF file may mix types) stays
dense and gets its weight dequantized at load (engine/quant/weights.py ``feed``).
"""
from __future__ import annotations

from torch import nn

from pagedq.engine.layers.linear import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
)
from pagedq.engine.layers.quant_linear import QuantEmbedding, QuantLinear, quantized_layers
from pagedq.engine.quant.spec import QuantSpec


def shard_names(module_name: str, module: nn.Module, stacked: dict) -> list[str]:
    """The HF weight names of a layer's checkpoint tensors, in shard order."""
    parent, _, leaf = module_name.rpartition(".")
    hf = sorted((k for k, (target, _) in stacked.items() if target == leaf),
                key=lambda k: stacked[k][1])
    prefix = f"{parent}." if parent else ""
    return [f"{prefix}{h}.weight" for h in hf] if hf else [f"{module_name}.weight"]


def quantize(model: nn.Module, spec: QuantSpec) -> set[str]:
    """Swap the layers (see the module doc); returns the HF weight names kept quantized."""
    stacked = getattr(model, "stacked", {})
    kept: set[str] = set()
    for name, module in list(model.named_modules()):
        if isinstance(module, ColumnParallelLinear | RowParallelLinear):
            cls = QuantLinear
        elif isinstance(module, VocabParallelEmbedding):
            cls = QuantEmbedding
        else:
            continue
        names = shard_names(name, module, stacked)
        formats = {spec.format_of(n) for n in names}
        if len(formats) != 1 or None in formats:
            continue
        _replace(model, name, cls(module, formats.pop()))
        kept.update(names)
    return kept


def _replace(model: nn.Module, name: str, new: nn.Module) -> None:
    parent, _, leaf = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, leaf, new)


def finish_load(model: nn.Module) -> None:
    for m in quantized_layers(model).values():
        m.finish_load()


def init_dummy(model: nn.Module, gen) -> None:
    for m in quantized_layers(model).values():
        m.init_dummy(gen)


def weight_bytes(model: nn.Module) -> int:
    """Bytes of the model's parameters and buffers (quantized codes, scales, ...)."""
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if t.data_ptr() not in seen:
            seen.add(t.data_ptr())
            total += t.numel() * t.element_size()
    return total
