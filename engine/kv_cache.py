"""The paged KV cache's storage for each ``kv_cache_dtype`` (kernels/kv_quant.py is each
kind's contract: what is stored, how it is read back):

  auto            the model's dtype
  fp8, fp8_e4m3   float8_e4m3fn; a scale per layer, K or V, and KV head, from the
                  checkpoint or fitted to the first prefill (engine/kv_scales.py)
  fp8_e5m2        float8_e5m2, unit scales (its range reaches 57,344)
  int8            int8 codes and a float32 scale per token and KV head, in scale caches
                  beside the caches: 4 bytes more per token, head, K or V, counted in
                  ``block_bytes`` and so in the memory budget

Layout: kv [2 (k, v), layers, blocks, block_size, Hkv, D]; int8's scale caches
[2, layers, blocks, block_size, Hkv]. Every 8-bit V cache is laid out as a transposed_view
(kernels/layout.py: the decode kernel's P.V needs V's tokens contiguous); ``kv`` keeps the
same bytes. Each attention layer holds views of its slices: ``k_cache``, ``v_cache``, and
``kv_quant``, the scale keywords its ops take (k_scale ... v_scale_cache; none for 16-bit).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedq.engine import kv_scales
from pagedq.engine.kv_scales import CheckpointScales
from pagedq.kernels.layout import transposed_view

_DTYPES = {"fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2, "int8": torch.int8}
E4M3_CAPABILITY = (8, 9)  # Triton's float8e4nv conversions: Ada and Hopper on


@dataclass(frozen=True, slots=True)
class KVFormat:
    name: str  # "auto", "fp8_e4m3", "fp8_e5m2" or "int8" ("fp8" is "fp8_e4m3")
    dtype: torch.dtype

    @property
    def head_scales(self) -> bool:
        """Per-layer, per-head K and V scales (engine/kv_scales.py)."""
        return self.name == "fp8_e4m3"

    @property
    def token_scales(self) -> bool:
        """Scale caches, one float32 per token and KV head (int8)."""
        return self.name == "int8"

    def token_bytes(self, head_dim: int) -> int:
        """Bytes of one token's K (or V) of one KV head, its scale included."""
        return head_dim * self.dtype.itemsize + (4 if self.token_scales else 0)


def kv_format(setting: str, model_dtype: torch.dtype) -> KVFormat:
    """The format of EngineConfig.kv_cache_dtype (validated there) for a model of
    ``model_dtype``."""
    name = "fp8_e4m3" if setting == "fp8" else setting
    return KVFormat(name, _DTYPES.get(name, model_dtype))


def check_device(fmt: KVFormat, device: torch.device) -> None:
    """ValueError, one line, when ``device`` cannot run the format's kernels."""
    if fmt.dtype != torch.float8_e4m3fn or device.type != "cuda":
        return  # the CPU runs every format (kernels/cpu.py); e5m2 and int8 any GPU
    cap = torch.cuda.get_device_capability(device)
    if cap < E4M3_CAPABILITY:
        raise ValueError(
            f"kv_cache_dtype {fmt.name} (float8_e4m3fn) needs a GPU of compute capability "
            f"{'.'.join(map(str, E4M3_CAPABILITY))} or more; {device} "
            f"({torch.cuda.get_device_name(device)}) is {cap[0]}.{cap[1]}: use fp8_e5m2 or "
            f"int8")


def label(fmt: KVFormat, fit: bool) -> str:
    """The storage in words (the worker's ready line): its dtype and where scales come from
    (``fit``: fp8 e4m3 scales yet to be fitted to the first prefill)."""
    name = str(fmt.dtype).removeprefix("torch.")
    if fmt.head_scales:
        return f"{name}, scales {'fitted to the first prefill' if fit else 'of the checkpoint'}"
    return f"{name}, scale per token and head" if fmt.token_scales else name


def block_bytes(fmt: KVFormat, num_layers: int, block_size: int, num_kv_heads: int,
                head_dim: int) -> int:
    """Bytes of one KV block over all layers, K and V, scale caches included."""
    return 2 * num_layers * block_size * num_kv_heads * fmt.token_bytes(head_dim)


def allocate(fmt: KVFormat, model, num_blocks: int, block_size: int, device: torch.device,
             checkpoint: CheckpointScales, hf_config, tp):
    """(kv, int8 scale caches or None, whether fp8 e4m3 scales are to be fitted to the first
    prefill), zeroed (a kernel that multiplies masked-out garbage by 0 must not see NaN),
    and the views of ``model``'s attention layers assigned. ``checkpoint``: its KV scales
    (engine/kv_scales.py), for ``hf_config``'s heads on rank ``tp.rank``."""
    layers = model.attention_layers()
    num_kv_heads, head_dim = model.num_kv_heads, model.head_dim
    release(layers)
    head_scales, fit = None, False
    if fmt.head_scales:
        head_scales = checkpoint.tensor(hf_config, tp, len(layers), device)
        fit = head_scales is None
        if fit:
            head_scales = kv_scales.unit(len(layers), num_kv_heads, device)
    kv = torch.zeros(2, len(layers), num_blocks, block_size, num_kv_heads, head_dim,
                     dtype=fmt.dtype, device=device)
    scales = torch.zeros(2, len(layers), num_blocks, block_size, num_kv_heads,
                         dtype=torch.float32, device=device) if fmt.token_scales else None
    eight = fmt.dtype.itemsize == 1
    for i, attn in enumerate(layers):
        v = kv[1, i]
        attn.k_cache, attn.v_cache = kv[0, i], transposed_view(v) if eight else v
        if scales is not None:
            attn.kv_quant = dict(k_scale_cache=scales[0, i], v_scale_cache=scales[1, i])
        elif head_scales is not None:
            attn.kv_quant = dict(k_scale=head_scales[i, 0], v_scale=head_scales[i, 1])
        attn.fit_scales = fit
    return kv, scales, fit


def release(layers: list) -> None:
    """The layers hold no view of a cache (before a new one, or once the runner closes)."""
    for attn in layers:
        attn.k_cache = attn.v_cache = torch.tensor([])
        attn.kv_quant = {}
        attn.fit_scales = False
