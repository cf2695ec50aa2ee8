"""Tool calls out of generated text, for the chat API (whole responses and streams).

A forced call ("required", a named function) was constrained by its schema, so its text is
known JSON. With "auto" the model chose through its chat template's tool format, so the text is
parsed per model family; the Qwen2 / Hermes `<tool_call>{"name": ..., "arguments": ...}</tool_call>`
style (also used by SmolLM and many fine-tunes) is the one implemented.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from vlm_engine.structured.tools import ToolChoice


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def body(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


def _call_from(obj: Any) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class HermesToolParser:
    """`<tool_call>JSON</tool_call>` blocks; the JSON is one call or a list of calls."""

    start = "<tool_call>"
    end = "</tool_call>"
    _block = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """(content outside the calls or None, the calls); text without a valid call is all content."""
        if self.start not in text:
            return text, []
        calls: list[ToolCall] = []
        for body in self._block.findall(text):
            try:
                parsed = json.loads(body)
            except json.JSONDecodeError:
                continue
            for obj in parsed if isinstance(parsed, list) else [parsed]:
                call = _call_from(obj)
                if call is not None:
                    calls.append(call)
        if not calls:
            return text, []
        content = text[: text.index(self.start)].strip()
        return content or None, calls


TOOL_PARSERS = {"hermes": HermesToolParser}
DEFAULT_TOOL_PARSER = "hermes"


def finish_reason_with_calls(reason: str, calls: list[ToolCall]) -> str:
    return "tool_calls" if calls and reason == "stop" else reason


class ToolOutput:
    """Turns one choice's text into OpenAI message fields, whole or as stream deltas."""

    def __init__(self, choice: ToolChoice, parser: str = DEFAULT_TOOL_PARSER) -> None:
        self.choice = choice
        self.parser = TOOL_PARSERS[parser]()
        self.call: ToolCall | None = ToolCall(choice.name, "") if choice.mode == "named" and choice.name else None
        self._text: list[str] = []  # everything seen (streams)
        self._shown = 0  # characters of content already streamed (auto)
        self._started = False  # the named call's header delta went out

    # ---- whole responses ---------------------------------------------------------------------

    def message(self, text: str, finish_reason: str) -> tuple[dict[str, Any], str]:
        content, calls = self._calls(text, finish_reason)
        message: dict[str, Any] = {"role": "assistant", "content": content, "refusal": None, "annotations": []}
        if calls:
            message["tool_calls"] = [c.body() for c in calls]
        return message, finish_reason_with_calls(finish_reason, calls)

    def _calls(self, text: str, finish_reason: str) -> tuple[str | None, list[ToolCall]]:
        mode = self.choice.mode
        if mode == "named" and self.call is not None:
            if finish_reason != "stop":  # cut off: the arguments are not complete JSON
                return text, []
            return None, [ToolCall(self.call.name, text, self.call.id)]
        if mode == "required":
            try:
                parsed = json.loads(text)
            except json.JSONDecodeError:
                return text, []
            calls = [c for c in (_call_from(o) for o in (parsed if isinstance(parsed, list) else [parsed])) if c]
            return (None, calls) if calls else (text, [])
        if mode == "auto":
            return self.parser.parse(text)
        return text, []

    # ---- streams -----------------------------------------------------------------------------

    def stream(self, text: str) -> list[dict[str, Any]]:
        """Deltas to send for new text (possibly none while a call is being collected)."""
        if not text:
            return []
        self._text.append(text)
        mode = self.choice.mode
        if mode == "named" and self.call is not None:
            deltas = []
            if not self._started:
                self._started = True
                deltas.append(
                    {"tool_calls": [{**self.call.body(0), "function": {"name": self.call.name, "arguments": ""}}]}
                )
            deltas.append({"tool_calls": [{"index": 0, "function": {"arguments": text}}]})
            return deltas
        if mode == "auto":
            return self._stream_auto()
        if mode == "required":
            return []  # one JSON array: sent whole when it is complete
        return [{"content": text}]

    def _stream_auto(self) -> list[dict[str, Any]]:
        full = "".join(self._text)
        start = self.parser.start
        at = full.find(start)
        end = at if at != -1 else len(full) - _partial_suffix(full, start)
        delta = full[self._shown : max(end, self._shown)]
        self._shown = max(end, self._shown)
        return [{"content": delta}] if delta else []

    def finish(self, finish_reason: str) -> tuple[list[dict[str, Any]], str]:
        """The closing deltas (collected calls, held-back text) and the choice's finish reason."""
        full = "".join(self._text)
        mode = self.choice.mode
        if mode == "named" and self.call is not None:
            return [], finish_reason_with_calls(finish_reason, [self.call] if finish_reason == "stop" else [])
        if mode not in ("auto", "required"):
            return [], finish_reason
        _, calls = self._calls(full, finish_reason)  # content before a call has been streamed already
        deltas: list[dict[str, Any]] = []
        if calls:
            deltas.append({"tool_calls": [c.body(i) for i, c in enumerate(calls)]})
        else:
            rest = full[self._shown :]  # no call after all: what was held back is content
            if rest:
                deltas.append({"content": rest})
        return deltas, finish_reason_with_calls(finish_reason, calls)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0
