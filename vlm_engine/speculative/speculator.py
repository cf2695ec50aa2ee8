"""When to speculate, how far, and what it achieved.

Per batch: verifying k drafts per sequence turns a decode into a small prefill. While the batch
is small the step is memory-bound and the extra rows are nearly free; once it is large enough to
be compute-bound they are not, so speculation is off for steps that start with at least
`disable_batch_size` running requests.

Per request: acceptance is tracked as an exponential average of accepted / proposed. When it
falls below `MIN_ACCEPTANCE` the request stops proposing for a back-off that doubles on each
failed retry (4 .. 64 steps), so text that does not repeat costs almost nothing; a retry that
is accepted well resets the back-off.
"""

from __future__ import annotations

from collections.abc import Mapping, Sized
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

from vlm_engine.config import SpeculativeConfig
from vlm_engine.scheduler.batch import ScheduledChunk, SchedulerOutput
from vlm_engine.scheduler.request import Request

if TYPE_CHECKING:
    from vlm_engine.runner.model_runner import ModelRunner

MIN_ACCEPTANCE = 0.2
EMA_WEIGHT = 0.5  # weight of the newest step in the acceptance average
RETRY_ACCEPTANCE = 0.3  # the average a paused request resumes with: one more failure pauses it again
MIN_BACKOFF, MAX_BACKOFF = 4, 64


class Proposer(Protocol):
    """Fills `chunk.draft` (at most `chunk.num_lookahead` tokens) for decoding chunks. A proposer
    with a distribution stores it as `runner_state.draft_probs` ([len(draft), V]) for sampled
    requests; one without (n-gram lookup) proposes point masses."""

    name: str

    def propose(self, chunks: list[ScheduledChunk]) -> None: ...


@dataclass
class RequestSpeculation:
    """One request's speculation record (kept on `Request.speculation`, survives preemption)."""

    num_drafts: int = 0  # verification steps with at least one draft token
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    acceptance: float = 1.0  # recent accepted / proposed
    paused_steps: int = 0
    backoff: int = MIN_BACKOFF

    @property
    def acceptance_length(self) -> float:
        """Tokens per verification step (accepted drafts plus the one the target always adds)."""
        return 1.0 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass
class SpeculationStats:
    """Cumulative engine-wide counters, plus the last step's acceptance lengths (one per draft)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    last_step_lengths: list[int] = field(default_factory=list)


class Speculator:
    def __init__(self, proposer: Proposer, num_tokens: int, disable_batch_size: int) -> None:
        if num_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be at least 1, got {num_tokens}")
        self.proposer = proposer
        self.num_tokens = num_tokens
        self.disable_batch_size = disable_batch_size
        self.stats = SpeculationStats()
        self._enabled = True

    def reset_counters(self) -> None:
        self.stats = SpeculationStats()

    def begin_step(self, num_running: int) -> None:
        self._enabled = num_running < self.disable_batch_size

    def lookahead(self, request: Request) -> int:
        """Draft slots a decoding request gets this step (the scheduler asks)."""
        if not self._enabled:
            return 0
        state = _state(request)
        if state.paused_steps:
            state.paused_steps -= 1
            return 0
        return self.num_tokens

    def propose(self, plan: SchedulerOutput) -> None:
        """Fill the plan's decoding chunks' drafts (a step's speculation starts here)."""
        self.stats.last_step_lengths.clear()
        chunks = []
        for chunk in plan.chunks:
            if not chunk.num_lookahead:
                continue
            grammar = chunk.request.grammar
            if grammar is not None and not grammar.can_speculate(chunk.request.remaining_tokens, chunk.num_lookahead):
                continue
            chunks.append(chunk)
        self.proposer.propose(chunks)
        for chunk in chunks:
            grammar = chunk.request.grammar
            if grammar is not None and chunk.draft:
                chunk.set_draft(grammar.valid_draft(chunk.draft))
            if not chunk.draft:  # nothing to verify: a draft distribution would only go stale
                chunk.request.runner_state.draft_probs = None

    def observe_step(self, plan: SchedulerOutput, sampled: Mapping[str, Sized]) -> None:
        """The forward pass verified the plan's drafts: `sampled` holds each request's new tokens."""
        for chunk in plan.chunks:
            if chunk.draft and chunk.request.request_id in sampled:
                self.observe(chunk, len(sampled[chunk.request.request_id]))

    def observe(self, chunk: ScheduledChunk, num_tokens: int) -> None:
        """A verified chunk emitted `num_tokens` (its accepted drafts and one more)."""
        proposed = len(chunk.draft)
        if not proposed:
            return
        accepted = num_tokens - 1
        stats, state = self.stats, _state(chunk.request)
        for record in (stats, state):
            record.num_drafts += 1
            record.num_draft_tokens += proposed
            record.num_accepted_tokens += accepted
        stats.last_step_lengths.append(num_tokens)
        state.acceptance = (1 - EMA_WEIGHT) * state.acceptance + EMA_WEIGHT * accepted / proposed
        if state.acceptance < MIN_ACCEPTANCE:
            state.paused_steps = state.backoff
            state.backoff = min(2 * state.backoff, MAX_BACKOFF)
            state.acceptance = RETRY_ACCEPTANCE
        elif accepted:
            state.backoff = MIN_BACKOFF


def build_speculator(config: SpeculativeConfig, draft_runner: ModelRunner | None) -> Speculator | None:
    """The configured speculation: a draft model's (its runner given) or n-gram lookup; None: off."""
    if not config.speculative:
        return None
    proposer: Proposer
    if draft_runner is not None:
        from vlm_engine.speculative.draft_model import DraftModelProposer

        proposer = DraftModelProposer(draft_runner)
    else:
        from vlm_engine.speculative.ngram import NgramProposer

        proposer = NgramProposer(config.speculative_ngram_min, config.speculative_ngram_max)
    return Speculator(proposer, config.num_speculative_tokens, config.speculative_disable_batch_size)


def _state(request: Request) -> RequestSpeculation:
    if request.speculation is None:
        request.speculation = RequestSpeculation()
    return request.speculation
