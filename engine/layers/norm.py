"""RMSNorm (Llama/Qwen flavour: normalise in float32, then scale by weight)."""
from __future__ import annotations

import torch
from torch import nn

from pagedq.engine.layers import ops


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """Without residual: rms_norm(x). With residual: (rms_norm(x + residual), x + residual),
        the second being the next layer's residual stream (one fused pass on GPU)."""
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps)
        return ops.fused_add_rms_norm(x, residual, self.weight, self.eps)
