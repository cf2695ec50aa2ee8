"""Turning the sampled rows' logits into tokens: greedy, temperature, top-k, top-p, seeds, logprobs."""

from __future__ import annotations

import math
from collections.abc import Callable
import torch

from vlm_engine.sampling_params import SamplingParams
from vlm_engine.scheduler.request import SampledToken  # the scheduler's, since it applies them

__all__ = ["SampledToken", "batch_argmax", "sample", "target_probs", "token_logprobs"]


ArgmaxFn = Callable[[torch.Tensor], torch.Tensor]


def sample(
    logits: torch.Tensor,  # [B, V] float32 or the model's bf16 (converted per row where fp32 is needed)
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    argmax: ArgmaxFn | None = None,  # row argmax with torch.argmax's result (the C++ one is faster)
) -> list[SampledToken | None]:
    """A token per row, or None for a row whose logits are not finite: there is no distribution to
    draw from or score, and the caller fails that request alone instead of the batch."""
    tokens, finite = batch_argmax(logits, argmax)
    results: list[SampledToken | None] = []
    for i, p in enumerate(params):
        if not finite[i]:
            results.append(None)
            continue
        token = tokens[i] if p.greedy else _sample_row(logits[i].float(), p, generators[i])
        if p.logprobs is not None:
            results.append(token_logprobs(logits[i : i + 1], [token], p.logprobs)[0])
        else:
            results.append(SampledToken(token))
    return results


def batch_argmax(logits: torch.Tensor, argmax: ArgmaxFn | None = None) -> tuple[list[int], list[bool]]:
    """Each row's argmax (one argmax call for the batch) and whether the row's logits are usable,
    judged from the argmax alone: it is a NaN whenever the row holds one (torch's semantics, which
    the C++ argmax keeps), +inf if any is, and -inf only when all are; a finite maximum leaves a
    finite softmax. B values read, not B x V, and judged in Python (torch.isfinite on them cost ~40 us)."""
    best = argmax(logits) if argmax is not None else logits.argmax(dim=-1)
    peaks = logits.gather(1, best.view(-1, 1)).view(-1).tolist()
    return best.tolist(), [math.isfinite(v) for v in peaks]


def _sample_row(logits: torch.Tensor, p: SamplingParams, generator: torch.Generator | None) -> int:
    return int(torch.multinomial(target_probs(logits, p), 1, generator=generator))


def target_probs(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """The distribution a non-greedy request samples from: temperature, then top-k, then top-p.
    Speculative verification uses the same function, so accepted tokens follow it exactly."""
    logits = logits.float() / p.temperature
    if p.top_k and p.top_k < logits.shape[-1]:
        kth = torch.topk(logits, p.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if p.top_p < 1.0:
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        # Drop a token when the tokens strictly before it already reach top_p (keeps at least one).
        drop = probs.cumsum(-1) - probs >= p.top_p
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        logits = torch.full_like(logits, float("-inf")).scatter(-1, order, sorted_logits)
    return logits.softmax(-1)


def token_logprobs(logits: torch.Tensor, tokens: list[int], n_top: int) -> list[SampledToken]:
    """Logprobs (from the unmodified logits) of row i's token tokens[i], with top-n alternatives."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    results = []
    for i, token in enumerate(tokens):
        top = None
        if n_top:
            values, ids = logprobs[i].topk(n_top)
            top = list(zip(ids.tolist(), values.tolist()))
        results.append(SampledToken(token, float(logprobs[i, token]), top))
    return results
