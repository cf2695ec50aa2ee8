"""What the scheduler plans and reports, as plain data: the chunks of one step (`SchedulerOutput`), what
`Scheduler.update()` made of their results (`StepUpdate`), its configuration, and the rejection of a request
that can never run. The runner and the speculators read these; only scheduler.py makes them."""

from __future__ import annotations

from dataclasses import dataclass, field

from vlm_engine.config import SchedulingConfig
from vlm_engine.scheduler.request import Request, SampledToken


class RequestRejected(ValueError):
    """The request can never run (e.g. its prompt does not fit the context); nothing was allocated."""


@dataclass(frozen=True)
class SchedulerConfig:
    """The user's scheduling options and what the engine derives for its model and pool."""

    options: SchedulingConfig
    max_model_len: int  # the context, capped so that any one request fits the pool alone
    # Pages kept free when admitting new work so running requests can grow a little without
    # immediately preempting the newcomer.
    watermark_pages: int = 0
    # The model's media tokens attend to each other both ways (Gemma 3's images): a prefill chunk
    # must not end inside a media span, since its queries see the span's later keys.
    atomic_media_spans: bool = False


@dataclass
class ScheduledChunk:
    request: Request
    start: int  # position of the first token computed this step
    num_tokens: int  # known tokens plus draft tokens run this step
    # Speculative decoding: KV slots reserved past the last known token, and the proposed tokens
    # (at most that many) that follow the known ones in this chunk and are verified by it.
    num_lookahead: int = 0
    draft: list[int] = field(default_factory=list)

    @property
    def end(self) -> int:
        return self.start + self.num_tokens

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the last known token (and its draft), so the step yields tokens."""
        return self.end == self.request.num_tokens + len(self.draft)

    @property
    def num_sample_rows(self) -> int:
        """Rows whose logits are needed: the last known token's, then one per draft token."""
        return min(self.num_tokens, 1 + len(self.draft)) if self.samples else 0

    def set_draft(self, draft: list[int]) -> None:
        """Attach proposed tokens (at most `num_lookahead`) to a decoding chunk."""
        if len(draft) > self.num_lookahead or self.num_tokens != 1 + len(self.draft):
            raise ValueError("a draft needs a decoding chunk with enough reserved slots")
        self.draft = list(draft)
        self.num_tokens = 1 + len(self.draft)

    def input_ids(self) -> list[int]:
        """The token ids this chunk runs: the request's known tokens, then its draft."""
        known = self.request.token_ids
        if not self.draft:
            return known[self.start : self.end]
        n = len(known)
        return known[self.start : n] + self.draft[max(0, self.start - n) : self.end - n]


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    schedule_time_s: float = 0.0
    num_cached_tokens: int = 0  # prefix-cache hits of the requests admitted for the first time

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)

    @property
    def num_decode_tokens(self) -> int:
        """Tokens of decoding chunks (past their prompt, one known token), drafts included."""
        return sum(
            c.num_tokens
            for c in self.chunks
            if c.num_tokens - len(c.draft) == 1 and c.start >= c.request.num_prompt_tokens
        )

    @property
    def is_empty(self) -> bool:
        return not self.chunks


@dataclass(frozen=True, slots=True)
class StepUpdate:
    """What `Scheduler.update()` made of one step's results."""

    # The tokens appended, in chunk order: cut after a stop token, the length limit or a completed
    # grammar, and the grammar's choice where its closer replaced the sampled token.
    tokens: list[tuple[Request, list[SampledToken]]]
    # Requests that failed alone (logits not finite, a token the grammar rejected), with why:
    # finished ("abort") and their pages freed; the rest of the batch went on.
    failed: list[tuple[Request, str]]
    finished: list[Request]  # every request this step finished, the failed ones first

    @property
    def num_tokens(self) -> int:
        return sum(len(tokens) for _, tokens in self.tokens)
