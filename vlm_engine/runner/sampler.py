"""Turning the sampled rows' logits into tokens: greedy, temperature, top-k, top-p, seeds, logprobs."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from vlm_engine.sampling_params import SamplingParams


@dataclass
class SampledToken:
    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


ArgmaxFn = Callable[[torch.Tensor], torch.Tensor]


def sample(
    logits: torch.Tensor,  # [B, V] float32
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    argmax: ArgmaxFn | None = None,  # row argmax with torch.argmax's result (the C++ one is faster)
) -> list[SampledToken]:
    tokens = _choose(logits, params, generators, argmax)
    results = [SampledToken(t) for t in tokens]
    wants_logprobs = [i for i, p in enumerate(params) if p.logprobs is not None]
    if wants_logprobs:
        rows = torch.tensor(wants_logprobs, device=logits.device)
        logprobs = torch.log_softmax(logits.index_select(0, rows).float(), dim=-1)
        for k, i in enumerate(wants_logprobs):
            results[i].logprob = float(logprobs[k, tokens[i]])
            n = params[i].logprobs or 0
            if n:
                values, ids = logprobs[k].topk(n)
                results[i].top_logprobs = list(zip(ids.tolist(), values.tolist()))
    return results


def _choose(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    argmax: ArgmaxFn | None,
) -> list[int]:
    # One host sync for the whole batch.
    tokens = (argmax(logits) if argmax is not None else logits.argmax(dim=-1)).tolist()
    for i, p in enumerate(params):
        if p.greedy:
            continue
        tokens[i] = _sample_row(logits[i].float(), p, generators[i])
    return tokens


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    logits = logits / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens strictly before it already reach top_p (keeps at least one).
        drop = probs.cumsum(-1) - probs >= p.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(0, order, sorted_logits)
    probs = logits.softmax(-1)
    return int(torch.multinomial(probs, 1, generator=generator))
