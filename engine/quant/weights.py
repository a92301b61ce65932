"""The checkpoint tensors of a quantized model as (HF name, tensor or QuantTensor).

AWQ / GPTQ: a projection's qweight, qzeros, scales (and GPTQ's g_idx) may lie in any order
and in any shard; they are gathered per projection and handed on as one QuantTensor named
"<projection>.weight" once all have been read (g_idx may be absent: no act-order).
Everything else (norms, embeddings, biases, an unquantized lm_head) passes as it is.
GGUF: engine/quant/gguf.py. ``feed`` then turns each quantized weight whose layer stays
dense into its float32 weight.
"""
from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

from pagedq.engine.quant import awq, gptq
from pagedq.engine.quant.detect import safetensors_headers
from pagedq.engine.quant.spec import QuantSpec
from pagedq.engine.quant.tensor import QuantTensor

_PARTS = ("qweight", "qzeros", "scales", "g_idx")  # g_idx: GPTQ's, and optional there


def iter_weights(source_path: Path, spec: QuantSpec, qc: dict,
                 tensors: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
    """``tensors``: the folder's (name, tensor) pairs (loader.iter_safetensors); ``qc``:
    its quantization config (detect.quant_config)."""
    if spec.method == "gguf":
        raise ValueError("iter_weights: GGUF files are read by engine/quant/gguf.py")
    names = set(safetensors_headers(Path(source_path)))
    pending: dict[str, dict[str, object]] = {}
    for name, t in tensors:
        stem, _, leaf = name.rpartition(".")
        if stem + ".weight" not in spec.formats or leaf not in _PARTS:
            yield name, t
            continue
        got = pending.setdefault(stem, {})
        got[leaf] = t
        if all(p in got for p in _PARTS if p != "g_idx" or f"{stem}.g_idx" in names):
            yield stem + ".weight", _convert(spec, qc, stem, pending.pop(stem))
    for stem, got in pending.items():
        missing = [p for p in _PARTS[:3] if p not in got]
        raise ValueError(f"quantized weight {stem} lacks {', '.join(missing)} in the checkpoint")


def _convert(spec: QuantSpec, qc: dict, stem: str, got: dict) -> QuantTensor:
    fmt = spec.formats[stem + ".weight"]
    if spec.method == "awq":
        return awq.convert(got["qweight"], got["qzeros"], got["scales"], fmt.group_size, stem)
    fmt_name = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    return gptq.convert(got["qweight"], got["qzeros"], got["scales"], got.get("g_idx"),
                        fmt.bits, fmt.group_size, fmt.offsets is None, fmt_name == "gptq_v2",
                        stem)


def feed(weights: Iterable[tuple[str, object]], quantized: set[str]):
    """The weights with every quantized one (a QuantTensor, or a GGUFWeight not converted
    yet) made what its layer holds: quantized if ``quantized`` names it, else dense."""
    for name, w in weights:
        if hasattr(w, "quantized"):
            w = w.quantized() if name in quantized else w.dense()
        yield name, w
