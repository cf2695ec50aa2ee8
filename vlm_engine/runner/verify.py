"""Verifying a draft against the target model's logits at every drafted position.

Greedy requests keep the longest draft prefix equal to the target's argmax and then take the
argmax after it, so their output is exactly what decoding one token at a time gives.

Sampled requests use rejection sampling (Leviathan et al. 2023, Chen et al. 2023): draft token x
at position i is accepted with probability min(1, p_i(x) / q_i(x)), where p is the target's
distribution (`target_probs`: temperature, top-k, top-p) and q the proposer's. On the first
rejection a token is drawn from the residual max(0, p_i - q_i) normalised, and verification
stops; when every draft token is accepted a bonus token is drawn from p after the last one.
Every emitted token then follows p exactly. A proposer without a distribution (n-gram lookup)
is a point mass: q(x) = 1, so x is kept with probability p(x) and the residual is p without x.
"""

from __future__ import annotations

import torch

from vlm_engine.runner.sampler import target_probs
from vlm_engine.sampling_params import SamplingParams


def verify_greedy(argmax: list[int], draft: list[int]) -> list[int]:
    """argmax[i] is the target's choice after the known tokens and draft[:i]."""
    accepted = 0
    while accepted < len(draft) and draft[accepted] == argmax[accepted]:
        accepted += 1
    return draft[:accepted] + [argmax[accepted]]


def verify_sampled(
    logits: torch.Tensor,  # [len(draft) + 1, V] target logits (grammar-masked where constrained)
    draft: list[int],
    draft_probs: torch.Tensor | None,  # [len(draft), V] the proposer's q, or None for point masses
    params: SamplingParams,
    generator: torch.Generator | None,
) -> list[int]:
    probs = target_probs(logits, params)  # row-wise: temperature, top-k and top-p per position
    uniforms = torch.rand(len(draft), generator=generator).tolist() if draft else []
    out: list[int] = []
    for i, token in enumerate(draft):
        p = probs[i]
        q_token = 1.0 if draft_probs is None else float(draft_probs[i, token])
        p_token = float(p[token])
        if q_token > 0 and uniforms[i] * q_token < p_token:  # u < p/q without dividing by zero
            out.append(token)
            continue
        residual = _residual(p, token, None if draft_probs is None else draft_probs[i])
        out.append(int(torch.multinomial(residual, 1, generator=generator)))
        return out
    out.append(int(torch.multinomial(probs[len(draft)], 1, generator=generator)))
    return out


def _residual(p: torch.Tensor, token: int, q: torch.Tensor | None) -> torch.Tensor:
    if q is None:
        residual = p.clone()
        residual[token] = 0.0
    else:
        residual = (p - q).clamp_(min=0.0)
    total = float(residual.sum())
    if total <= 0.0:  # p == q (or p was the point mass itself): the rejection had probability 0
        return p
    return residual / total
