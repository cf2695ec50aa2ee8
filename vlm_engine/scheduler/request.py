"""A request's state as the scheduler sees it: tokens, pages, progress, and how it ended."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vlm_engine.cache.page_hash import MediaSpan
from vlm_engine.inputs import ProcessedPrompt
from vlm_engine.sampling_params import SamplingParams

if TYPE_CHECKING:  # the scheduler holds these for the runner; it never touches a tensor
    import torch


@dataclass(slots=True)
class SampledToken:
    """A token a step produced for a request, with its logprob and the top alternatives when asked."""

    token_id: int
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class RunnerState:
    """What the model runner and speculative decoding keep per request, between steps.

    The scheduler names none of these fields: it calls `on_preempt()` when it frees the request's
    pages for recomputation and `on_finish()` when the request retires. Each hook resets what its
    owner's state no longer describes once that happens.
    """

    # The runner's: the generator of a seeded request (its draws follow the request, not the batch),
    # and vision-encoder outputs of this prompt's media not yet consumed, by media index.
    generator: torch.Generator | None = None
    media_embeddings: dict[int, torch.Tensor] = field(default_factory=dict)
    # Speculative decoding's: the proposer's distribution q over this step's draft ([len(draft), V],
    # sampled requests of a draft model; the runner's verification takes it), and how many positions
    # of the request a draft model's KV holds.
    draft_probs: torch.Tensor | None = None
    draft_computed: int = 0

    def on_preempt(self) -> None:
        """The request's KV pages were freed: it is recomputed from its tokens when it runs again."""
        self.media_embeddings = {}  # re-encoded (or found in the encoder cache) with its prompt
        self.draft_computed = 0  # a draft model's KV went with the pages

    def on_finish(self) -> None:
        """The request retired: drop everything it held (tensors first of all)."""
        self.generator = None
        self.media_embeddings = {}
        self.draft_probs = None
        self.draft_computed = 0


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: ProcessedPrompt
    sampling: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    max_model_len: int = 1 << 30
    arrival_time: float = field(default_factory=time.monotonic)

    status: RequestStatus = RequestStatus.WAITING
    token_ids: list[int] = field(init=False)  # prompt followed by the generated tokens
    page_ids: list[int] = field(default_factory=list)  # the page table
    # Sliding-window layers' own page table, as long as page_ids, when the model has such layers
    # (scheduler/window.py): entries before `num_window_released` went back to the pool.
    window_page_ids: list[int] = field(default_factory=list)
    num_window_released: int = 0
    # The slot of the linear-attention layers' state (vlm_engine.cache.state_pool), -1: none held.
    state_slot: int = -1
    num_computed_tokens: int = 0  # tokens whose KV is in the pool
    num_cached_tokens: int = 0  # prefix-cache hit at first admission (what the API reports)
    num_preemptions: int = 0
    page_keys: list[int] = field(default_factory=list)  # prefix-cache keys of full pages, a hash chain
    num_registered_pages: int = 0
    stop_token_id: int | None = None  # the token that ended it, when one did
    # The runner's and the speculator's state that lives as long as the request (typed, with hooks).
    runner_state: RunnerState = field(default_factory=RunnerState)
    # The structured-output matcher (vlm_engine.structured.grammar.GrammarMatcher) when constrained;
    # its state follows the output tokens, so it survives preemption unchanged.
    grammar: Any = None
    # Speculative decoding's record (vlm_engine.speculative.RequestSpeculation), created on its first draft.
    speculation: Any = None
    # Timestamps for metrics (monotonic seconds).
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None

    def __post_init__(self) -> None:
        self.token_ids = list(self.prompt.token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def media_spans(self) -> list[MediaSpan]:
        return self.prompt.media_spans

    @property
    def extend_len(self) -> int:
        """Tokens still to run through the model before the next token can be sampled."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def remaining_tokens(self) -> int:
        """Tokens this request may still generate (max_tokens and the context both count)."""
        return min(self.sampling.max_tokens - self.num_output_tokens, self.max_model_len - self.num_tokens)

    @property
    def finish_reason(self) -> str | None:
        if self.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            return self.status.value
        if self.status is RequestStatus.FINISHED_ABORTED:
            return "abort"
        return None

    def append_token(self, token_id: int) -> RequestStatus | None:
        """Add a sampled token; return the finished status it causes, if any."""
        self.token_ids.append(token_id)
        sp = self.sampling
        if token_id in sp.stop_token_ids or (not sp.ignore_eos and token_id in self.eos_token_ids):
            self.stop_token_id = token_id
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= sp.max_tokens or self.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
