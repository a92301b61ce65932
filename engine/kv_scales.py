"""The scales of an fp8 e4m3 KV cache: one per layer, K or V, and KV head, real = stored *
scale (kernels/kv_quant.py), held on the device as float32 [layers, 2, Hkv] that the
kernels read through pointers (so CUDA graphs captured before the scales were set read them).

From the checkpoint, when it has them: per layer, under the names vLLM reads
(compressed-tensors, ModelOpt and vLLM's own fp8 checkpoints):

  model.layers.N.self_attn.k_scale, .v_scale            (also ...self_attn.attn.k_scale)
  model.layers.N.self_attn.k_proj.output_scale, .v_proj.output_scale   (ModelOpt)
  model.layers.N.self_attn.kv_scale                     (older: one scale for K and V)

each a scalar or one value per KV head of the checkpoint (a tensor-parallel rank takes its
heads'). Every layer must have both then. Other caches than fp8 e4m3 ignore them.

Else fitted once, to the first step that prefills (the engine's first prompts; a runner's
warm-up on a throwaway cache does not count): per layer and KV head,

  scale = max(1, max |x| / 224)

over that step's K (rotated, as stored) and V. A model whose values stay within half of
e4m3's 448 stores them as they are (scale 1, as before scales existed); one whose values
pass it gets the scale that maps them to 224, leaving twice that room for later prompts
(larger values saturate at 448). Never below 1: stretching small values toward 448 buys
nothing (e4m3 keeps 3 mantissa bits from 2**-6 up) and leaves later, larger ones less room.
"""
from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch

FIT_TARGET = 224.0  # a fitted scale maps the first prefill's max |x| here (half of 448)

_NAMES = re.compile(r"^(?:model\.)?layers\.(\d+)\.self_attn\.(?:attn\.)?"
                    r"(?:(k|v|kv)_scale|(k|v)_proj\.output_scale)$")


class CheckpointScales:
    """Takes the KV scales out of a checkpoint's tensors as they stream to the model."""

    def __init__(self) -> None:
        self.found: dict[tuple[int, str], torch.Tensor] = {}  # (layer, "k" or "v") -> values

    def take(self, weights: Iterable[tuple[str, object]]) -> Iterator[tuple[str, object]]:
        """``weights`` without its KV scale tensors, which are kept (float32, CPU)."""
        from pagedq.engine.loader import materialize

        for name, w in weights:
            m = _NAMES.match(name)
            if m is None:
                yield name, w
                continue
            which = m[2] or m[3]
            t = materialize(w).detach().float().cpu().reshape(-1)
            for kv in ("k", "v") if which == "kv" else (which,):
                self.found[(int(m[1]), kv)] = t

    def tensor(self, hf_config, tp, num_layers: int,
               device: torch.device) -> torch.Tensor | None:
        """float32 [layers, 2, Hkv] of the heads of rank ``tp.rank`` (engine/parallel.py), or
        None when the checkpoint has no KV scales. ValueError when some layer lacks one, or
        has a count of values that is neither 1 nor the checkpoint's KV heads, or one <= 0."""
        if not self.found:
            return None
        from pagedq.engine.parallel import head_slice

        nh = hf_config.num_attention_heads
        total_kv_heads = getattr(hf_config, "num_key_value_heads", None) or nh
        hs = head_slice(nh, total_kv_heads, tp.size, tp.rank)
        kv_start, kv_count = hs.kv_start, hs.kv_count
        out = torch.ones(num_layers, 2, kv_count)
        for layer in range(num_layers):
            for j, kv in enumerate(("k", "v")):
                t = self.found.get((layer, kv))
                if t is None:
                    raise ValueError(f"the checkpoint has KV cache scales, but none for layer "
                                     f"{layer}'s {kv.upper()} (self_attn.{kv}_scale)")
                if t.numel() not in (1, total_kv_heads) or not bool((t > 0).all()):
                    raise ValueError(f"the checkpoint's {kv.upper()} cache scale of layer "
                                     f"{layer} must be one value or one per KV head "
                                     f"({total_kv_heads}), all > 0; got {t.tolist()}")
                out[layer, j] = t if t.numel() == 1 else t[kv_start:kv_start + kv_count]
        return out.to(device)


def unit(num_layers: int, kv_count: int, device: torch.device) -> torch.Tensor:
    """Scales of 1 (float32 [layers, 2, Hkv]), to be fitted to the first prefill."""
    return torch.ones(num_layers, 2, kv_count, device=device)


@torch.no_grad()
def fit_(scale: torch.Tensor, x: torch.Tensor) -> None:
    """Set ``scale`` (float32 [Hkv], in place) by the fitting rule (module doc) from the
    rows x [T, Hkv, D] to be stored."""
    amax = x.float().abs().amax(dim=(0, 2)) if x.shape[0] else torch.zeros_like(scale)
    scale.copy_(torch.clamp(amax / FIT_TARGET, min=1.0))
