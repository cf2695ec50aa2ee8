"""Gemma 4's RMSNorm (Transformers' Gemma4RMSNorm), shared by its decoder and its experts' router."""

from __future__ import annotations

import torch
from torch import nn


class Gemma4RMSNorm(nn.Module):
    """Transformers' Gemma4RMSNorm: fp32 rows times (mean square + eps) ** -0.5 (pow, not rsqrt),
    times the stored scale in fp32 (none for the v norm), one rounding to the input's dtype."""

    def __init__(self, size: int, eps: float, with_scale: bool = True) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size)) if with_scale else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.pow(h.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        if self.weight is not None:
            h = h * self.weight.float()
        return h.type_as(x)
