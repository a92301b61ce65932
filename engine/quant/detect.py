"""Which quantization a checkpoint holds, from its files alone (no torch, nothing loaded):
the ``quantization`` setting checked against it, a QuantSpec, or one clear ValueError.

  HF folder: config.json's ``quantization_config``, else quantize_config.json (AutoGPTQ,
             GPTQModel), else quant_config.json (AutoAWQ); the quantized weights are those
             with a ``.qweight`` in the safetensors headers
  .gguf file: the tensor types in its index (engine/quant/gguf_file.py)

Served: AWQ GEMM 4-bit (zero point), GPTQ 4- and 8-bit (sym or not, act-order or not,
checkpoint formats gptq and gptq_v2), GGUF Q4_0 / Q4_1 / Q8_0 (F32 / F16 / BF16 tensors
as they are; the token embedding and output of other types dequantized at load).
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from pagedq.engine.quant.spec import CHOICES, METHODS, QuantFormat, QuantSpec

SERVED = "awq (GEMM, 4-bit), gptq (4- or 8-bit) and gguf (Q4_0, Q4_1, Q8_0)"
GGUF_ARCHS = ("llama", "qwen2", "qwen3")
GGUF_FORMATS = {  # GGUF type -> its layout: 32 weights per block along K, fp16 scales
    "Q4_0": QuantFormat(4, 32, 8, None, "float16", label="Q4_0"),  # (q - 8) * d
    "Q4_1": QuantFormat(4, 32, 0, "float16", "float16", label="Q4_1"),  # q * d + m
    "Q8_0": QuantFormat(8, 32, 128, None, "float16", label="Q8_0"),  # int8 q * d
}
GGUF_DENSE = ("F32", "F16", "BF16")
# types gguf's Python package dequantizes: allowed for the token embedding and the output
# (llama.cpp's Q4_0 files keep the output at Q6_K), dequantized at load
GGUF_DEQUANTIZED = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                    "Q6_K")
_ST_DTYPES = {"F16": "float16", "BF16": "bfloat16", "F32": "float32"}


def detect(source, requested: str = "auto", dummy: bool = False) -> QuantSpec | None:
    """The QuantSpec of ``source`` (a loader.ModelSource) under ``requested`` (one of
    spec.CHOICES), or None for weights to load as they are (or, GGUF with ``none``,
    dequantized by transformers). ``dummy``: load_format "dummy" (random weights: the
    formats of the config, no weight files read)."""
    if requested not in CHOICES:
        raise ValueError(f"quantization must be one of {', '.join(CHOICES)} (got {requested!r})")
    if source.kind == "gguf":
        return _detect_gguf(source, requested)
    found = quant_config(Path(source.path))
    if found is None:
        if requested in ("awq", "gptq"):
            raise ValueError(f"model {source.name} has no quantization config (config.json "
                             f"quantization_config, quantize_config.json or quant_config.json), "
                             f"so it is no {requested} checkpoint")
        if requested == "gguf":
            raise ValueError(f"model {source.name} is a folder, not a .gguf file")
        return None
    where, qc = found
    method = _method(where, qc)
    if kv_cache_only(qc):  # plain weights; the runner reads the KV scales (engine/kv_scales.py)
        if requested not in ("auto", "none"):
            raise ValueError(f"model {source.name} quantizes only its KV cache ({where}: "
                             f"{method}), its weights are plain; give --quantization auto")
        return None
    if method not in METHODS:
        raise ValueError(f"model {source.name} is quantized with {method} ({where}), which "
                         f"pagedq does not serve; it serves {SERVED} checkpoints")
    if requested == "none":
        raise ValueError(f"model {source.name} is a {method} checkpoint ({where}): its "
                         f"weights cannot load unquantized; give --quantization auto or {method}")
    if requested != "auto" and requested != method:
        raise ValueError(f"model {source.name} is a {method} checkpoint ({where}), not "
                         f"{requested}; give --quantization auto or {method}")
    fmt, detail = (_awq_format if method == "awq" else _gptq_format)(source.name, where, qc)
    if dummy:
        return QuantSpec(method, default=fmt, detail=detail)
    formats = {}
    headers = safetensors_headers(Path(source.path))
    for name in headers:
        if name.endswith(".qweight"):
            stem = name.removesuffix(".qweight")
            scales = _ST_DTYPES.get(headers.get(stem + ".scales", ("F16",))[0], "float16")
            formats[stem + ".weight"] = QuantFormat(fmt.bits, fmt.group_size, fmt.zero_point,
                                                    fmt.offsets, scales, fmt.act_order,
                                                    fmt.label)
    if not formats:
        raise ValueError(f"model {source.name} says it is a {method} checkpoint ({where}) but "
                         f"its safetensors hold no .qweight tensor")
    return QuantSpec(method, formats, detail=detail)


def quant_config(folder: Path) -> tuple[str, dict[str, Any]] | None:
    """(where it was found, the quantization config) of an HF folder, or None."""
    cfg = _json(folder / "config.json")
    if isinstance(cfg.get("quantization_config"), dict):
        return "config.json quantization_config", cfg["quantization_config"]
    for name, method in (("quantize_config.json", "gptq"), ("quant_config.json", "awq")):
        if (folder / name).is_file():
            qc = _json(folder / name)
            return name, {"quant_method": method, **qc}
    return None


def kv_cache_only(qc: dict[str, Any]) -> bool:
    """A quantization config that quantizes the KV cache and no weight: compressed-tensors
    with a kv_cache_scheme and no config_groups; ModelOpt with a kv_cache_quant_algo and no
    quant_algo."""
    m = str(qc.get("quant_method") or "").lower()
    if m == "compressed-tensors":
        return bool(qc.get("kv_cache_scheme")) and not qc.get("config_groups")
    if m == "modelopt":
        inner = qc.get("quantization") if isinstance(qc.get("quantization"), dict) else qc
        return bool(inner.get("kv_cache_quant_algo")) and \
            str(inner.get("quant_algo") or "none").lower() == "none"
    return False


def _json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        raise ValueError(f"{path} cannot be read as JSON: {e}") from None
    return data if isinstance(data, dict) else {}


def _method(where: str, qc: dict[str, Any]) -> str:
    m = str(qc.get("quant_method") or qc.get("quantization_method") or "unknown").lower()
    return m


def _awq_format(name: str, where: str, qc: dict[str, Any]) -> tuple[QuantFormat, str]:
    bits = int(qc.get("bits", qc.get("w_bit", 4)))
    group = int(qc.get("group_size", qc.get("q_group_size", 128)))
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"model {name} is an AWQ checkpoint of version {version!r} ({where}); "
                         f"pagedq reads the GEMM layout (version 'gemm') only")
    if bits != 4 or not qc.get("zero_point", True):
        raise ValueError(f"model {name}: AWQ with bits {bits}, zero_point "
                         f"{qc.get('zero_point', True)} ({where}); pagedq reads 4-bit AWQ "
                         f"with zero points")
    return QuantFormat(4, group, 0, "float32", label=f"int4 g{group}"), "gemm"


def _gptq_format(name: str, where: str, qc: dict[str, Any]) -> tuple[QuantFormat, str]:
    bits = int(qc.get("bits", 4))
    group = int(qc.get("group_size", 128))
    fmt = str(qc.get("checkpoint_format") or qc.get("format") or "gptq").lower()
    if bits not in (4, 8):
        raise ValueError(f"model {name}: GPTQ with bits {bits} ({where}); pagedq reads 4- and "
                         f"8-bit GPTQ")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"model {name}: GPTQ checkpoint format {fmt!r} ({where}); pagedq "
                         f"reads the formats 'gptq' and 'gptq_v2'")
    if qc.get("dynamic"):
        raise ValueError(f"model {name}: GPTQ 'dynamic' per-module settings ({where}) are "
                         f"not supported")
    if group == 0 or group < -1:
        raise ValueError(f"model {name}: GPTQ group_size {group} ({where})")
    sym, act = bool(qc.get("sym", True)), bool(qc.get("desc_act", False))
    # v1 ("gptq") stores every zero minus one; sym zeros are then all 2**(bits-1)
    fmt_ = QuantFormat(bits, group, 1 << (bits - 1) if sym else 0, None if sym else "float32",
                       act_order=act, label=f"int{bits} g{group}" if group > 0 else
                       f"int{bits} per-channel")
    detail = ", ".join(x for x in ("sym" if sym else "asym", "act-order" if act else "",
                                   "v2" if fmt == "gptq_v2" else "") if x)
    return fmt_, detail


def safetensors_headers(folder: Path) -> dict[str, tuple[str, list[int]]]:
    """name -> (dtype, shape) of every tensor of every *.safetensors file (headers only)."""
    out: dict[str, tuple[str, list[int]]] = {}
    for f in sorted(Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        for k, v in header.items():
            if k != "__metadata__":
                out[k] = (v["dtype"], list(v["shape"]))
    return out


def _detect_gguf(source, requested: str) -> QuantSpec | None:
    if requested == "none":
        return None
    if requested in ("awq", "gptq"):
        raise ValueError(f"model {source.name} is a GGUF file, not a {requested} checkpoint; "
                         f"give --quantization auto or gguf (or none: dequantized to float at "
                         f"load)")
    from pagedq.engine.quant.gguf_file import hf_name, read_index
    index = read_index(source.path)
    if index.architecture not in GGUF_ARCHS:
        raise ValueError(f"model {source.name}: GGUF architecture {index.architecture!r}; "
                         f"pagedq keeps {', '.join(GGUF_ARCHS)} GGUF files quantized (give "
                         f"--quantization none to dequantize it at load)")
    formats: dict[str, QuantFormat] = {}
    bad: dict[str, int] = {}
    for t in index.tensors:
        name = hf_name(t.name)
        if name is None:
            continue
        kind = t.type_name
        outer = name in ("model.embed_tokens.weight", "lm_head.weight")
        if kind in GGUF_FORMATS and len(t.shape) == 2:
            formats[name] = GGUF_FORMATS[kind]
        elif kind not in GGUF_DENSE and not (outer and kind in GGUF_DEQUANTIZED):
            bad[kind] = bad.get(kind, 0) + 1
    if bad:
        kinds = ", ".join(f"{k} ({n} tensors)" for k, n in sorted(bad.items()))
        raise ValueError(f"model {source.name}: GGUF tensors of type {kinds} cannot be kept "
                         f"quantized (pagedq serves F32, F16, BF16, Q4_0, Q4_1 and Q8_0; the "
                         f"token embedding and output may be of any K-quant type); give "
                         f"--quantization none to dequantize the whole file to float at load")
    return QuantSpec("gguf", formats)
