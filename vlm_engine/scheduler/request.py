"""A request's state as the scheduler sees it: tokens, pages, progress, and how it ended."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from vlm_engine.cache.page_hash import MediaSpan
from vlm_engine.inputs import ProcessedPrompt
from vlm_engine.sampling_params import SamplingParams


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
    num_computed_tokens: int = 0  # tokens whose KV is in the pool
    num_cached_tokens: int = 0  # prefix-cache hit at first admission (what the API reports)
    num_preemptions: int = 0
    page_keys: list[int] = field(default_factory=list)  # prefix-cache keys of full pages, a hash chain
    num_registered_pages: int = 0
    stop_token_id: int | None = None  # the token that ended it, when one did
    # Runner-side state that lives as long as the request (sampling generator, encoder outputs).
    runner_state: dict[str, Any] = field(default_factory=dict)
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
