"""Activations on merged projections."""
from __future__ import annotations

import torch
from torch import nn

from pagedq.engine.layers import ops


class SiluAndMul(nn.Module):
    """x = [gate | up] along the last dim (the merged gate_up projection) -> silu(gate) * up."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.silu_and_mul(x)
