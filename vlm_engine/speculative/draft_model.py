"""Draft-model speculation: a smaller model with the target's vocabulary proposes k tokens.

The draft model has its own KV tensors but shares the target's page tables: it writes position p
of a request into the same page slot the target uses, so the scheduler's allocation, prefix
sharing, preemption and rollback cover both. Its KV lags the target's: each step it first runs
the tokens it has not seen (the whole prompt on a request's first draft; afterwards the accepted
tokens), which also yields the first draft token, then one token per further draft position.
`runner_state.draft_computed` counts the positions whose draft KV is valid; anything past the
target's computed tokens (a rejected draft) is recomputed. A sampled request draws its draft from
the draft's own distribution q (same temperature, top-k, top-p), kept for rejection sampling.
"""

from __future__ import annotations

import torch

from vlm_engine.runner.model_runner import ModelRunner
from vlm_engine.runner.sampler import target_probs
from vlm_engine.scheduler.batch import ScheduledChunk
from vlm_engine.scheduler.request import Request


class DraftModelProposer:
    name = "draft"

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner

    def propose(self, chunks: list[ScheduledChunk]) -> None:
        if not chunks:
            return
        drafts: list[list[int]] = [[] for _ in chunks]
        probs: list[list[torch.Tensor]] = [[] for _ in chunks]
        # First pass: catch up on unseen tokens; its last row gives each request's first draft token.
        steps = []
        for chunk in chunks:
            request = chunk.request
            done = min(request.runner_state.draft_computed, request.num_computed_tokens)
            steps.append(ScheduledChunk(request, done, request.num_tokens - done))
        active = list(range(len(chunks)))
        while active:
            logits = self.runner.forward_logits([steps[i] for i in active])
            assert logits is not None
            for row, i in enumerate(active):
                token, q = self._draw(logits[row], chunks[i].request)
                drafts[i].append(token)
                if q is not None:
                    probs[i].append(q)
            active = [i for i in active if len(drafts[i]) < chunks[i].num_lookahead]
            for i in active:
                request = chunks[i].request  # feed the newest draft token at its position
                steps[i] = ScheduledChunk(request, request.num_tokens + len(drafts[i]) - 1, 1, draft=drafts[i])
        for chunk, draft, q in zip(chunks, drafts, probs):
            request = chunk.request
            # Positions fed: every known token and all draft tokens but the last.
            request.runner_state.draft_computed = request.num_tokens + len(draft) - 1
            chunk.set_draft(draft)
            if q:
                request.runner_state.draft_probs = torch.stack(q)

    def _draw(self, logits: torch.Tensor, request: Request) -> tuple[int, torch.Tensor | None]:
        params = request.sampling
        if params.greedy:
            return int(logits.argmax()), None
        q = target_probs(logits, params)
        return int(torch.multinomial(q, 1, generator=self.runner.generator(request))), q
