"""GGUF tensors (llama.cpp's blocks, read raw: engine/quant/gguf_file.py) -> torch.

A weight [N, K] is N rows of K / 32 blocks; a block of 32 weights along K is
  Q4_0: fp16 d, 16 bytes          w = (q - 8) * d
  Q4_1: fp16 d, fp16 m, 16 bytes  w = q * d + m
        (4-bit: byte j holds weight j in its low nibble, weight j + 16 in its high one)
  Q8_0: fp16 d, 32 int8 q         w = q * d
which is kernels/quant_layout.py's layout with group 32: Q4_0 zero point 8, Q4_1 the min
m as an fp16 offset, Q8_0 the codes q + 128 with zero point 128 (every value exact).
llama.cpp permutes the rows of a llama checkpoint's q and k projections (its rotary
pairs dimensions i and i + D/2 as neighbours); ``unpermute`` restores the HF order, on the
raw rows (a row's blocks stay whole). Other types of the token embedding and output are
dequantized by the gguf package (float32).
"""
from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch

from pagedq.engine.quant import gguf_file
from pagedq.engine.quant.detect import GGUF_FORMATS
from pagedq.engine.quant.tensor import QuantTensor
from pagedq.kernels.quant_layout import pack_codes

_BLOCK = {"Q4_0": 18, "Q4_1": 20, "Q8_0": 34}  # bytes per 32 weights


def unpermute(raw: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's q/k row order -> HF's, for rows = heads * head_dim (any trailing dims)."""
    rows = raw.shape[0]
    half = rows // heads // 2
    return raw.reshape(heads, half, 2, *raw.shape[1:]).swapaxes(1, 2).reshape(raw.shape)


def _blocks(raw: np.ndarray, kind: str):
    """(d [N, K/32] fp16, m [N, K/32] fp16 or None, codes [N, K] uint8) of raw blocks."""
    n = raw.shape[0]
    blocks = torch.from_numpy(np.array(raw)).view(n, -1, _BLOCK[kind])  # (a copy)
    nb = blocks.shape[1]
    d = blocks[..., 0:2].contiguous().view(torch.float16).view(n, nb)
    m = None
    if kind == "Q8_0":
        codes = (blocks[..., 2:] ^ 0x80).reshape(n, nb * 32)  # int8 + 128, as uint8
    else:
        if kind == "Q4_1":
            m = blocks[..., 2:4].contiguous().view(torch.float16).view(n, nb)
        qs = blocks[..., 2 if kind == "Q4_0" else 4:]  # [N, K / 32, 16] uint8
        codes = torch.stack([qs & 0xF, qs >> 4], dim=2).reshape(n, nb * 32)
    return d, m, codes


def convert(raw: np.ndarray, kind: str) -> QuantTensor:
    """raw uint8 [N, K / 32 * block bytes] of type ``kind`` (Q4_0, Q4_1, Q8_0)."""
    d, m, codes = _blocks(raw, kind)
    fmt = GGUF_FORMATS[kind]
    return QuantTensor(pack_codes(codes.t(), fmt.bits), d.t().contiguous(),
                       None if m is None else m.t().contiguous(), fmt.bits, 32,
                       fmt.zero_point, label=kind)


def dequantize_blocks(raw: np.ndarray, kind: str) -> torch.Tensor:
    """The weight [N, K] float32 straight from the blocks: the values of convert(raw,
    kind).dense() (the same float32 arithmetic), without the repacking."""
    d, m, codes = _blocks(raw, kind)
    n, nb = d.shape
    w = (codes.view(n, nb, 32).to(torch.float32) - GGUF_FORMATS[kind].zero_point)
    w.mul_(d.to(torch.float32).unsqueeze(-1))
    if m is not None:
        w.add_(m.to(torch.float32).unsqueeze(-1))
    return w.view(n, nb * 32)


class GGUFWeight:
    """A Q4_0 / Q4_1 / Q8_0 weight not converted yet: ``quantized()`` for a layer that keeps
    it quantized, ``dense()`` for one that does not (engine/quant/weights.py feed)."""

    __slots__ = ("raw", "kind", "shape")

    def __init__(self, raw: np.ndarray, kind: str, shape: tuple[int, ...]) -> None:
        self.raw, self.kind, self.shape = raw, kind, shape

    def quantized(self) -> QuantTensor:
        return convert(self.raw, self.kind)

    def dense(self) -> torch.Tensor:
        return dequantize_blocks(self.raw, self.kind)


def dense(raw: np.ndarray, info: gguf_file.TensorInfo) -> torch.Tensor:
    """A float tensor of the GGUF's shape: F32/F16/BF16 as stored, other types float32."""
    kind = info.type_name
    if kind == "F32":
        arr = torch.from_numpy(np.array(raw).view(np.float32))
    elif kind == "F16":
        arr = torch.from_numpy(np.array(raw).view(np.float16))
    elif kind == "BF16":
        arr = torch.from_numpy(np.array(raw).view(np.int16)).view(torch.bfloat16)
    else:
        from gguf import GGMLQuantizationType, dequantize
        arr = torch.from_numpy(dequantize(np.array(raw), GGMLQuantizationType(info.ggml_type)))
    return arr.reshape(info.shape)


def iter_weights(path, hf_config) -> Iterator[tuple[str, object]]:
    """(HF name, GGUFWeight or float tensor) for every model tensor of a GGUF file: the
    Q4_0 / Q4_1 / Q8_0 weights as GGUFWeights, everything else dense."""
    index = gguf_file.read_index(path)
    permute = index.architecture == "llama"
    heads = {"self_attn.q_proj": hf_config.num_attention_heads,
             "self_attn.k_proj": getattr(hf_config, "num_key_value_heads", None)
             or hf_config.num_attention_heads}
    for info in index.tensors:
        name = gguf_file.hf_name(info.name)
        if name is None:
            continue
        raw = gguf_file.read_raw(index, info)
        h = next((h for part, h in heads.items() if f".{part}." in name), None)
        if permute and h:  # rows: of the weight, or the bias's elements
            raw = unpermute(raw.reshape(info.shape[0], -1), h).reshape(raw.shape)
        if info.type_name in _BLOCK and len(info.shape) == 2:
            yield name, GGUFWeight(raw, info.type_name, info.shape)
        else:
            yield name, dense(raw, info)
