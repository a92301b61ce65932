"""Rotary position embedding (HF-Llama rotate_half layout).

cos_sin_cache: [max_position, head_dim] float32, first half cos, second half sin
(kernels/reference.py:rotary_cos_sin). Built lazily on the device of the first use, so
the module can be constructed on the meta device. The rotation itself is applied by
Attention (ops.qk_norm_rope_store), fused with the K/V store.
"""
from __future__ import annotations

import torch
from torch import nn

from pagedq.kernels.reference import rotary_cos_sin

SUPPORTED_ROPE_TYPES = ("default", "llama3")


def rope_params(hf_config) -> tuple[float, dict | None]:
    """(theta, scaling dict or None) from a transformers 5.x ``rope_parameters`` dict or the
    4.x ``rope_theta`` / ``rope_scaling`` attributes. ValueError for unsupported scaling."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and params and all(isinstance(v, dict) for v in params.values()):
        params = params.get("full_attention") or next(iter(params.values()))  # per layer type
    if isinstance(params, dict) and params:
        theta = params.get("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
        scaling = params
    else:
        theta = getattr(hf_config, "rope_theta", 10000.0)
        scaling = getattr(hf_config, "rope_scaling", None) or None
    rope_type = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope scaling {rope_type!r}; supported: "
                         f"{', '.join(SUPPORTED_ROPE_TYPES)}")
    return float(theta), (dict(scaling) if rope_type != "default" else None)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float,
                 scaling: dict | None = None) -> None:
        super().__init__()
        self.head_dim, self.max_position = head_dim, max_position
        self.base, self.scaling = base, scaling
        self._cache: torch.Tensor | None = None  # not a buffer: survives meta construction

    def cos_sin_cache(self, device: torch.device) -> torch.Tensor:
        if self._cache is None or self._cache.device != device:
            cache = rotary_cos_sin(self.head_dim, self.max_position, self.base, self.scaling)
            self._cache = cache.to(device)
        return self._cache
