"""OpenAI `tools` / `tool_choice` -> what the engine does: which tools the chat template sees, and
the output constraint for a forced call.

- "none": no tools in the prompt, free text.
- "auto": tools in the prompt, free text; the model's calls are parsed out of it afterwards
  (`vlm_engine.server.tool_parsers`, per model family).
- "required": a JSON array of one or more calls, each `{"name": <a tool>, "arguments": <its
  parameters>}`, constrained by one schema (an `anyOf` over the tools).
- {"type": "function", "function": {"name": N}}: the output is N's arguments, constrained by N's
  parameter schema.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlm_engine.structured.spec import StructuredOutput, StructuredOutputError

DEFAULT_PARAMETERS: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolChoice:
    mode: str  # "none" | "auto" | "required" | "named"
    name: str | None = None  # the forced function, when mode == "named"
    constraint: StructuredOutput | None = None


def validate_tools(tools: Any) -> list[dict[str, Any]]:
    """Check OpenAI's tool list shape; returns it with each function's parameters filled in."""
    if not isinstance(tools, list) or not tools:
        raise StructuredOutputError("'tools' must be a non-empty array", param="tools")
    seen: set[str] = set()
    out = []
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise StructuredOutputError(f"{where} must be an object with type 'function'", param=where)
        fn = tool.get("function")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise StructuredOutputError(f"{where}.function must be an object with a non-empty name", param=where)
        params = fn.get("parameters", DEFAULT_PARAMETERS)
        if params is None:
            params = DEFAULT_PARAMETERS
        if not isinstance(params, dict):
            raise StructuredOutputError(f"{where}.function.parameters must be a JSON schema object", param=where)
        if fn["name"] in seen:
            raise StructuredOutputError(f"{where}: the function name {fn['name']!r} is used twice", param=where)
        seen.add(fn["name"])
        out.append({"type": "function", "function": {**fn, "parameters": params}})
    return out


def resolve_tool_choice(tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool = True) -> ToolChoice:
    if tool_choice is None:
        tool_choice = "auto" if tools else "none"
    if tool_choice == "none":
        return ToolChoice("none")
    if not tools:
        raise StructuredOutputError("'tool_choice' needs 'tools'", param="tool_choice")
    if tool_choice == "auto":
        return ToolChoice("auto")
    if tool_choice == "required":
        return ToolChoice("required", constraint=StructuredOutput.json(calls_schema(tools, parallel)))
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if not isinstance(name, str):
            raise StructuredOutputError("'tool_choice.function.name' must be a string", param="tool_choice")
        for tool in tools:
            if tool["function"]["name"] == name:
                return ToolChoice("named", name, StructuredOutput.json(tool["function"]["parameters"]))
        known = ", ".join(t["function"]["name"] for t in tools)
        raise StructuredOutputError(
            f"'tool_choice' names the function {name!r}, which is not in 'tools' ({known})", param="tool_choice"
        )
    raise StructuredOutputError(
        "'tool_choice' must be 'none', 'auto', 'required' or {\"type\": \"function\", \"function\": {\"name\": ...}}",
        param="tool_choice",
    )


def calls_schema(tools: list[dict[str, Any]], parallel: bool) -> dict[str, Any]:
    """The schema of a "required" answer: an array of calls to the given tools."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t["function"]["name"]}, "arguments": t["function"]["parameters"]},
            "required": ["name", "arguments"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    schema: dict[str, Any] = {
        "type": "array",
        "items": calls[0] if len(calls) == 1 else {"anyOf": calls},
        "minItems": 1,
    }
    if not parallel:
        schema["maxItems"] = 1
    return schema
