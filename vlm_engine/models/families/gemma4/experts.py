"""Gemma 4's mixture-of-experts block (26B-A4B), beside each layer's dense MLP: a router over the
residual stream (a scale-free RMSNorm, a learned per-channel scale times hidden ** -0.5, a projection
to the experts, softmax in fp32, the top k renormalized and then scaled per expert), and GELU-gated
experts in Transformers 5's fused tensors (`experts.gate_up_proj` [E, 2I, hidden], `down_proj`
[E, hidden, I]) run on the pre-normed residual. Transformers' names (`router.*`, `experts.*`)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from vlm_engine.models.families.gemma4.norm import Gemma4RMSNorm
from vlm_engine.models.moe import SparseExperts, mix_experts


class Gemma4Router(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.top_k = int(config.top_k_experts)
        self.norm = Gemma4RMSNorm(hidden, config.rms_norm_eps, with_scale=False)
        self.proj = nn.Linear(hidden, config.num_experts, bias=False)
        self.scale = nn.Parameter(torch.ones(hidden))
        self.per_expert_scale = nn.Parameter(torch.ones(config.num_experts))
        self.input_scale = float(hidden) ** -0.5

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(weights [T, k] in fp32, chosen experts [T, k])."""
        scores = self.proj(self.norm(x) * self.scale * self.input_scale)
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        weights = weights / weights.sum(dim=-1, keepdim=True)
        return weights * self.per_expert_scale[chosen], chosen


def run_experts(
    experts: SparseExperts,
    act: Callable[[torch.Tensor], torch.Tensor],
    routing: tuple[torch.Tensor, torch.Tensor],
    rows: torch.Tensor,
) -> torch.Tensor:
    """The routed experts on `rows`: each down(act(gate) * up), weighted and summed per token."""
    weights, chosen = routing

    def expert(index: int, selected: torch.Tensor) -> torch.Tensor:
        gate, up = F.linear(selected, experts.gate_up_proj[index]).chunk(2, dim=-1)
        return F.linear(act(gate) * up, experts.down_proj[index])

    return mix_experts(rows, chosen, weights, experts.gate_up_proj.shape[0], expert)
