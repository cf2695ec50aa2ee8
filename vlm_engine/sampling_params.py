"""Per-request decoding controls (the OpenAI sampling fields, engine-side)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vlm_engine.structured.spec import StructuredOutput, StructuredOutputError, from_response_format

MIN_TEMPERATURE = 0.01  # smaller positive temperatures are raised to this (see __post_init__)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1 means no top-k cut
    seed: int | None = None  # reproducible per request when set
    stop: tuple[str, ...] = field(default_factory=tuple)
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's only; k: plus top-k alternatives
    # Constrained output: the one representation the engine uses (see vlm_engine.structured).
    structured_output: StructuredOutput | None = None
    # Conveniences, folded into `structured_output` at construction (at most one may be given).
    response_format: dict[str, Any] | None = None  # OpenAI's {"type": "json_object" | "json_schema", ...}
    json_schema: dict[str, Any] | str | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark, or GBNF/EBNF (rules with ::=)

    def __post_init__(self) -> None:
        # Accept lists / a single string for convenience, store tuples so params stay hashable.
        if isinstance(self.stop, str):
            object.__setattr__(self, "stop", (self.stop,))
        else:
            object.__setattr__(self, "stop", tuple(self.stop or ()))
        object.__setattr__(self, "stop_token_ids", tuple(self.stop_token_ids or ()))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        if 0 < self.temperature < MIN_TEMPERATURE:
            # Logits divided by a tiny temperature overflow float32 to inf and the probabilities
            # turn NaN (the whole batch's sampling would fail); vLLM raises it to the same floor.
            object.__setattr__(self, "temperature", MIN_TEMPERATURE)
        self._fold_structured_output()
        self.validate()

    def _fold_structured_output(self) -> None:
        given = [
            spec
            for spec in (
                self.structured_output,
                from_response_format(self.response_format),
                None if self.json_schema is None else StructuredOutput.json(self.json_schema),
                None if self.regex is None else StructuredOutput.regex(self.regex),
                None if self.choice is None else StructuredOutput.choice(self.choice),
                None if self.grammar is None else StructuredOutput.grammar(self.grammar),
            )
            if spec is not None
        ]
        if len(given) > 1:
            raise StructuredOutputError("give at most one output constraint (response_format, json_schema, regex, ...)")
        object.__setattr__(self, "structured_output", given[0] if given else None)
        for name in ("response_format", "json_schema", "regex", "choice", "grammar"):
            object.__setattr__(self, name, None)  # keeps the params hashable and small on the wire

    def validate(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise ValueError(f"logprobs must be between 0 and 20, got {self.logprobs}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
