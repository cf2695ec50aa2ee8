"""One representation of "constrain this output" inside the engine.

Every way a client can ask for structure (OpenAI `response_format`, vLLM's `structured_outputs`,
a forced tool call, `SamplingParams(json_schema=...)`) becomes a `StructuredOutput`: a kind and a
canonical text. It is small, hashable and travels inside `SamplingParams` between processes; the
canonical text is also the grammar cache key, so the same schema compiles once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class StructuredOutputError(ValueError):
    """The client's constraint is malformed or cannot be enforced; the message names the problem."""

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


@dataclass(frozen=True)
class StructuredOutput:
    kind: str  # one of KINDS
    spec: str = ""  # schema as canonical JSON, a regex, a JSON list of choices, or a grammar text

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise StructuredOutputError(f"unknown structured output kind {self.kind!r}; expected one of {KINDS}")

    @classmethod
    def json(cls, schema: dict[str, Any] | str | bool) -> StructuredOutput:
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise StructuredOutputError(f"the JSON schema is not valid JSON: {exc}") from None
        if not isinstance(schema, (dict, bool)):
            raise StructuredOutputError("a JSON schema must be an object")
        return cls("json_schema", canonical_json(schema))

    @classmethod
    def json_object(cls) -> StructuredOutput:
        return cls("json_object", "")

    @classmethod
    def regex(cls, pattern: str) -> StructuredOutput:
        if not isinstance(pattern, str) or not pattern:
            raise StructuredOutputError("a regex constraint must be a non-empty string")
        return cls("regex", pattern)

    @classmethod
    def choice(cls, choices: list[str]) -> StructuredOutput:
        if not isinstance(choices, (list, tuple)) or not choices or not all(isinstance(c, str) and c for c in choices):
            raise StructuredOutputError("a choice constraint must be a non-empty list of non-empty strings")
        return cls("choice", json.dumps(list(choices)))

    @classmethod
    def grammar(cls, text: str) -> StructuredOutput:
        if not isinstance(text, str) or not text.strip():
            raise StructuredOutputError("a grammar constraint must be a non-empty string")
        return cls("grammar", text)

    @property
    def choices(self) -> list[str]:
        return json.loads(self.spec) if self.kind == "choice" else []


def canonical_json(value: Any) -> str:
    # Keys keep their order: JSON output follows the schema's property order.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


def from_response_format(response_format: Any) -> StructuredOutput | None:
    """OpenAI's `response_format`: text, json_object, or json_schema {name, schema, strict}."""
    if response_format is None:
        return None
    if not isinstance(response_format, dict):
        raise StructuredOutputError("'response_format' must be an object", param="response_format")
    kind = response_format.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutput.json_object()
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        if not isinstance(spec, dict):
            raise StructuredOutputError("'response_format.json_schema' must be an object", param="response_format")
        schema = spec.get("schema", {"type": "object"})  # OpenAI allows a name alone
        name = spec.get("name")
        if name is not None and not isinstance(name, str):
            raise StructuredOutputError("'response_format.json_schema.name' must be a string", param="response_format")
        try:
            return StructuredOutput.json(schema)
        except StructuredOutputError as exc:
            raise StructuredOutputError(exc.message, param="response_format") from None
    raise StructuredOutputError(
        f"'response_format.type' must be 'text', 'json_object' or 'json_schema', got {kind!r}", param="response_format"
    )


def from_structured_outputs(value: Any, param: str = "structured_outputs") -> StructuredOutput | None:
    """vLLM's extension: exactly one of json / regex / choice / grammar (json_object: true too)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise StructuredOutputError(f"'{param}' must be an object", param=param)
    # `json_object: false` asks for nothing, like a missing key.
    given = {
        k: v
        for k, v in value.items()
        if k in ("json", "regex", "choice", "grammar", "json_object") and v is not None and v is not False
    }
    if len(given) != 1:
        raise StructuredOutputError(
            f"'{param}' needs exactly one of 'json', 'regex', 'choice', 'grammar', 'json_object'", param=param
        )
    ((kind, spec),) = given.items()
    try:
        if kind == "json":
            return StructuredOutput.json(spec)
        if kind == "json_object":
            return StructuredOutput.json_object()
        if kind == "regex":
            return StructuredOutput.regex(spec)
        if kind == "choice":
            return StructuredOutput.choice(spec)
        return StructuredOutput.grammar(spec)
    except StructuredOutputError as exc:
        raise StructuredOutputError(exc.message, param=param) from None
