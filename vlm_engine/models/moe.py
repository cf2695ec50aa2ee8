"""Sparse mixture-of-experts MLPs with Transformers 5's fused expert tensors (Qwen3-VL-MoE, Qwen3.5-MoE):
`gate` (the router, a linear of the hidden size to the experts) and `experts.gate_up_proj` [E, 2I, hidden] /
`experts.down_proj` [E, hidden, I], as Transformers names them, so checkpoints load by name."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class SparseExperts(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, num_experts: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))


class SparseMoE(nn.Module):
    """Top-k softmax routing over SiLU-gated experts, renormalized over the chosen k. Sums in
    Transformers' order (experts ascending, index_add_ into zeros) so fp32 outputs match it exactly;
    each expert runs on the rows routed to it only. `experts`: the fused tensors (default), or a
    module list of `GatedMLP`s (checkpoints that store each expert apart, Qwen3.5-MoE's). `normalize`
    False keeps the chosen probabilities as they are (Qwen3-Next's `norm_topk_prob`)."""

    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        num_experts: int,
        top_k: int,
        experts: nn.Module | None = None,
        normalize: bool = True,
    ) -> None:
        super().__init__()
        self.num_experts = num_experts
        self.top_k = top_k
        self.normalize = normalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = experts if experts is not None else SparseExperts(hidden_size, intermediate_size, num_experts)

    def expert(self, index: int, rows: torch.Tensor) -> torch.Tensor:
        """Expert `index` on `rows`: down(silu(gate) * up)."""
        if isinstance(self.experts, nn.ModuleList):
            return self.experts[index](rows)
        gate, up = F.linear(rows, self.experts.gate_up_proj[index]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.experts.down_proj[index])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = self.gate(x)
        probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
        weights, chosen = torch.topk(probs, self.top_k, dim=-1)
        if self.normalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return mix_experts(x, chosen, weights.to(logits.dtype), self.num_experts, self.expert)


def mix_experts(
    x: torch.Tensor,
    chosen: torch.Tensor,
    weights: torch.Tensor,
    num_experts: int,
    expert: Callable[[int, torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """sum over each token's chosen experts of weight * expert(token), [T, hidden]: `chosen` / `weights`
    [T, k]. Each expert runs once, on the rows routed to it, and the sums go in Transformers' order
    (experts ascending, index_add_ into zeros), so fp32 outputs match it exactly."""
    out = torch.zeros_like(x)
    # [E, k, T]: which (slot, token) pairs each expert serves, slot-major as Transformers' torch.where
    routed = F.one_hot(chosen, num_experts).permute(2, 1, 0)
    for index in routed.sum(dim=(1, 2)).nonzero().flatten().tolist():
        slot, token = torch.where(routed[index])
        out.index_add_(0, token, (expert(index, x[token]) * weights[token, slot, None]).to(out.dtype))
    return out
