"""The tensor index of a GGUF file, read straight from its header (no torch).

gguf.GGUFReader parses every metadata value into numpy views (the bundled SmolLM2's
49,152-token vocabulary: ~4 s); loading needs only the tensor index and a few scalars,
so this reader skips arrays by their sizes. The layout (GGUF v2 and v3, little-endian):

  "GGUF", u32 version, u64 tensor_count, u64 kv_count
  kv_count x (string key, u32 type, value)       string = u64 length + UTF-8 bytes
  tensor_count x (string name, u32 n_dims, u64 ne[n_dims], u32 ggml type, u64 offset)
  padding to general.alignment (default 32), then the tensors at their offsets

ne[0] is the fastest dimension: a weight [rows, cols] has ne = (cols, rows), each row
stored as cols / block_size blocks of the type's bytes (gguf.GGML_QUANT_SIZES).
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path

_SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?",
           10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]  # numpy order: (rows, cols) for a weight
    ggml_type: int
    offset: int  # absolute byte offset in the file
    nbytes: int

    @property
    def type_name(self) -> str:
        return type_name(self.ggml_type)


def type_name(ggml_type: int) -> str:
    from gguf import GGMLQuantizationType
    try:
        return GGMLQuantizationType(ggml_type).name
    except ValueError:
        return f"type {ggml_type}"


class _Cursor:
    def __init__(self, data: bytes) -> None:
        self.data, self.pos = data, 0

    def take(self, fmt: str):
        v = struct.unpack_from(fmt, self.data, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return v

    def string(self) -> str:
        n = self.take("<Q")
        s = self.data[self.pos:self.pos + n].decode("utf-8", errors="replace")
        self.pos += n
        return s

    def value(self, vtype: int, keep: bool):
        if vtype in _SCALAR:
            return self.take(_SCALAR[vtype])
        if vtype == _STRING:
            if keep:
                return self.string()
            n = self.take("<Q")
            self.pos += n
            return None
        if vtype != _ARRAY:
            raise ValueError(f"unknown GGUF value type {vtype}")
        etype, count = self.take("<I"), self.take("<Q")
        if etype in _SCALAR and not keep:  # skipped by size (scores, token types)
            self.pos += count * struct.calcsize(_SCALAR[etype])
            return None
        items = [self.value(etype, keep) for _ in range(count)]  # vocabularies, merges
        return items if keep else None


@dataclass(frozen=True, slots=True)
class GGUFIndex:
    path: Path
    metadata: dict[str, object]  # scalars and strings (arrays: None)
    tensors: list[TensorInfo]

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", ""))


def read_index(path: str | Path) -> GGUFIndex:
    """The metadata scalars and the tensor index of a GGUF file; ValueError if it is not one."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    path = Path(path)
    with open(path, "rb") as f:
        head = f.read(24)
        if len(head) < 24 or head[:4] != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file (no GGUF magic)")
        version, n_tensors, n_kv = struct.unpack_from("<IQQ", head, 4)
        if version not in (2, 3):
            raise ValueError(f"{path}: GGUF version {version} is not supported (2 or 3; a "
                             f"big-endian file reads as a huge version)")
        size = path.stat().st_size
        data = head + f.read(min(size, 64 << 20))  # headers are a few MB at most
    cur = _Cursor(data)
    cur.pos = 24
    meta: dict[str, object] = {}
    try:
        for _ in range(n_kv):
            key = cur.string()
            vtype = cur.take("<I")
            meta[key] = cur.value(vtype, keep=vtype != _ARRAY)
        raw = []
        for _ in range(n_tensors):
            name = cur.string()
            ne = [cur.take("<Q") for _ in range(cur.take("<I"))]
            raw.append((name, ne, cur.take("<I"), cur.take("<Q")))
    except struct.error:
        raise ValueError(f"{path}: GGUF header is truncated or larger than 64 MiB") from None
    align = int(meta.get("general.alignment") or 32)
    start = -(-cur.pos // align) * align
    tensors = []
    for name, ne, ggml_type, off in raw:
        try:
            block, type_size = GGML_QUANT_SIZES[GGMLQuantizationType(ggml_type)]
        except (ValueError, KeyError):
            raise ValueError(f"{path}: tensor {name} has unknown GGML type {ggml_type}") from None
        count = 1
        for d in ne:
            count *= d
        if ne and ne[0] % block:
            raise ValueError(f"{path}: tensor {name}'s rows ({ne[0]}) are not whole blocks")
        nbytes = count // block * type_size
        if start + off + nbytes > size:
            raise ValueError(f"{path}: tensor {name} lies past the end of the file")
        tensors.append(TensorInfo(name, tuple(reversed(ne)), ggml_type, start + off, nbytes))
    return GGUFIndex(path, meta, tensors)


def read_raw(index: GGUFIndex, info: TensorInfo):
    """The tensor's bytes as a read-only numpy uint8 memmap [rows, row bytes] (1-D
    tensors: [1, bytes])."""
    import numpy as np
    rows = 1
    for d in info.shape[:-1]:
        rows *= d
    mm = np.memmap(index.path, dtype=np.uint8, mode="r", offset=info.offset,
                   shape=(info.nbytes,))
    return mm.reshape(rows, info.nbytes // rows)


# GGUF tensor names of the llama family -> HF names (blk.N.<part> -> model.layers.N.<hf>)
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
          "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj",
          "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
SKIPPED = ("rope_freqs.weight",)  # llama3 rope factors: the config's rope_scaling has them


def hf_name(name: str) -> str | None:
    """The HF name of a GGUF tensor (None: not a model weight); unknown names come back
    as they are, so that loading them fails with their own name."""
    if name in SKIPPED:
        return None
    stem, _, leaf = name.rpartition(".")
    if stem in _TOP:
        return f"{_TOP[stem]}.{leaf}"
    parts = stem.split(".")
    if len(parts) == 3 and parts[0] == "blk" and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{leaf}"
    return name
