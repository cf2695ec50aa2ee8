"""Request bodies as types: what each endpoint accepts, declared once; `typed` converts.

msgspec, not pydantic: the API process already decodes every body (and the IPC) with msgspec;
converting a typical decoded chat body into ChatBody takes ~0.35 us, pydantic 2's strict
validation of the same model ~2.5 us (side by side, issue 48), on the hot path of every request.
msgspec is as strict as the hand checks it replaces (no "5" -> 5, no true -> 1; an integer is a
number), stops at the first error, and names it by a JSON path (`$.input[0].role`) that is
already the `param` clients are told. What its words do not say as this server always has,
`ERRORS` does, through the one mapper (`typed`).

Unknown fields are ignored; a top-level `null` means "not given" (protocol drops those first).
What other modules check (`messages`, `tools`, `response_format`, `tool_choice`: the workers and
`structured/`) is typed `Any` here, so that their messages and params stay theirs.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta, Struct

from vlm_engine.server.errors import ApiError

Int64 = Annotated[int, Meta(ge=-(2**63), le=2**63 - 1)]  # seed + choice index must still fit the wire
Positive = Annotated[int, Meta(ge=1, le=2**63 - 1)]
Number = int | float  # JSON has one number type
NonEmptyStr = Annotated[str, Meta(min_length=1)]
NonEmptyArray = Annotated[list[Any], Meta(min_length=1)]


class StreamOptions(Struct):
    include_usage: Any = False  # truthy values, as ever
    continuous_usage_stats: Any = False


class _Generate(Struct, kw_only=True):
    """What chat and completions share."""

    n: Int64 = 1
    stream: bool = False
    stream_options: Any = {}  # a StreamOptions, read only when streaming, as ever
    temperature: Number = 1.0
    top_p: Number = 1.0
    top_k: Int64 = 0
    seed: Int64 | None = None
    stop: NonEmptyStr | list[NonEmptyStr] = []
    stop_token_ids: list[int] = []
    ignore_eos: bool = False
    max_tokens: Positive | None = None
    response_format: Any = None
    structured_outputs: Any = None
    return_token_ids: bool = False


class ChatBody(_Generate, kw_only=True):
    messages: NonEmptyArray  # each one is checked by a preprocess worker
    max_completion_tokens: Positive | None = None
    logprobs: bool = False
    top_logprobs: Int64 | None = None
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    mm_processor_kwargs: dict[str, Any] | None = None


class CompletionBody(_Generate, kw_only=True):
    prompt: Any = None  # a string, token ids, or a batch of either (a shape msgspec unions cannot say)
    echo: Any = None  # refused when truthy
    suffix: Any = None
    best_of: Int64 | None = None
    logprobs: Int64 | None = None


class TokenizePrompt(Struct):
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChat(Struct):
    messages: NonEmptyArray
    add_special_tokens: bool = False
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    mm_processor_kwargs: dict[str, Any] | None = None
    return_token_strs: bool = False


class DetokenizeBody(Struct):
    tokens: list[int]


# ---- the Responses API --------------------------------------------------------------------------


class TextFormat(Struct, tag_field="type", tag="text"):
    pass


class JsonObjectFormat(Struct, tag_field="type", tag="json_object"):
    pass


class JsonSchemaFormat(Struct, tag_field="type", tag="json_schema"):
    name: NonEmptyStr
    schema: dict[str, Any]
    strict: Any = False  # read as a truthy value, as ever


class TextConfig(Struct):
    format: TextFormat | JsonObjectFormat | JsonSchemaFormat | None = None


class FunctionTool(Struct):
    type: Literal["function"]
    name: Any = None  # the tool itself is checked as chat's (structured.tools)
    description: Any = None
    parameters: Any = None
    strict: Any = None


class FunctionChoice(Struct):
    type: Literal["function"]
    name: Any = None


Metadata = Annotated[
    dict[Annotated[str, Meta(max_length=64)], Annotated[str, Meta(max_length=512)]], Meta(max_length=16)
]  # OpenAI's bounds


class ResponsesBody(Struct):
    """The fields the Responses API names itself; chat's sampling extras pass through unread."""

    input: str | NonEmptyArray
    instructions: str | None = None
    truncation: str = "disabled"
    metadata: Metadata | None = None
    user: str | None = None
    store: bool = True
    stream: bool = False
    temperature: Number = 1.0  # typed here too for the echo; chat checks their ranges
    top_p: Number = 1.0
    parallel_tool_calls: bool = True
    max_output_tokens: Positive | None = None
    top_logprobs: Int64 | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: str | FunctionChoice | None = None
    text: TextConfig | None = None


class InputText(Struct, tag_field="type", tag="input_text"):
    text: str


class OutputText(Struct, tag_field="type", tag="output_text"):
    text: str


class Refusal(Struct, tag_field="type", tag="refusal"):
    refusal: str


class InputImage(Struct, tag_field="type", tag="input_image"):
    image_url: str | None = None  # required, but a file_id is refused first
    file_id: Any = None


class InputFile(Struct, tag_field="type", tag="input_file"):
    file_data: Any = None  # the preprocess worker checks the file part
    file_url: Any = None
    filename: Any = None
    file_id: Any = None


Part = InputText | OutputText | Refusal | InputImage | InputFile
Role = Literal["user", "assistant", "system", "developer"]


class MessageItem(Struct, tag_field="type", tag="message"):
    role: Role
    content: str | list[Part]


class FunctionCallItem(Struct, tag_field="type", tag="function_call"):
    call_id: str
    name: str
    arguments: str


class FunctionCallOutputItem(Struct, tag_field="type", tag="function_call_output"):
    call_id: str
    output: str | list[Part]


class ReasoningItem(Struct, tag_field="type", tag="reasoning"):
    pass  # the models served here do not reason in separate items; nothing to render


InputItem = MessageItem | FunctionCallItem | FunctionCallOutputItem | ReasoningItem


class InputItems(Struct):
    """`input` as items (a Struct: msgspec caches its decoder, not a bare list[...]'s)."""

    input: list[InputItem]


# ---- the errors msgspec words differently ---------------------------------------------------------

# Path (indices as [], dict keys as [...]) -> message, or (message, param). Templates see `path`,
# `parent` (the path less its last step) and `value` (what the client sent there; None if absent).
# An element's path not here ("stop[]") gets its array's entry; paths in neither get the generic
# messages of `typed`.
_PART = "{parent}: content part type {value!r} is not supported"
_PARTS = "{path} must be a string or an array of parts"
_STRING = "{path} must be a string"
_OBJECT = "{path} must be an object"
ERRORS: dict[str, str | tuple[str, str]] = {
    "messages": "'messages' must be a non-empty array",
    "stop": ("'stop' must be a non-empty string or a list of non-empty strings", "stop"),
    "stop_token_ids": ("'stop_token_ids' must be a list of integers", "stop_token_ids"),
    "tokens": ("'tokens' must be an array of integers", "tokens"),
    "input": "'input' must be a string or a non-empty array of items",
    "metadata": "'metadata' must be an object of at most 16 string values",
    "metadata[...]": ("'metadata' keys are at most 64 characters and values strings of at most 512", "metadata"),
    "text": "'text' must be an object",
    "text.format": "'text.format' must be an object",
    "text.format.type": (
        "'text.format.type' must be 'text', 'json_object' or 'json_schema', got {value!r}", "text.format"
    ),
    "text.format.schema": "'text.format.schema' must be a JSON schema object",
    "text.format.name": "'text.format.name' must be a non-empty string",
    "tools": "'tools' must be an array",
    "tools[]": _OBJECT,
    "tools[].type": ("{parent}: only function tools are supported, got type {value!r}", "{parent}"),
    **dict.fromkeys(
        ("tool_choice", "tool_choice.type"),
        ("'tool_choice' must be 'none', 'auto', 'required' or {{\"type\": \"function\", \"name\": ...}}",
         "tool_choice"),  # fmt: skip
    ),
    "input[]": _OBJECT,
    "input[].type": ("{parent}: input item type {value!r} is not supported", "{parent}"),
    "input[].role": "{path} must be one of user, assistant, system, developer, got {value!r}",
    **dict.fromkeys(("input[].call_id", "input[].name", "input[].arguments"), _STRING),
    **dict.fromkeys(("input[].content", "input[].output"), _PARTS),
    **dict.fromkeys(("input[].content[]", "input[].output[]"), _OBJECT),
    **dict.fromkeys(("input[].content[].type", "input[].output[].type"), (_PART, "{parent}")),
    **dict.fromkeys(
        (f"input[].{where}[].{name}" for where in ("content", "output") for name in ("text", "refusal", "image_url")),
        _STRING,
    ),
}


# ---- the one mapper -----------------------------------------------------------------------------


def given(body: dict[str, Any]) -> dict[str, Any]:
    """The fields given: a top-level null means "not given" (the default), as it always has."""
    return {k: v for k, v in body.items() if v is not None}


def typed(value: Any, model: Any, at: str = "") -> Any:
    """`value` converted to `model` (a Struct or a type like list[Struct]); a msgspec error becomes
    the 400 `request_models.ERRORS` words for its path, or the generic one. `at`: where `value` sits."""
    try:
        return msgspec.convert(value, model)
    except msgspec.ValidationError as exc:
        raise _api_error(str(exc), value, at) from None


_KIND_NAMES = {"int": "integer", "float": "number", "str": "string", "bool": "boolean"}
_STEP = re.compile(r"\.(\w+)|\[(\d+)\]")


def _api_error(error: str, root: Any, at: str) -> ApiError:
    what, _, where = error.partition(" - at ")  # "Expected `int`, got `str`", "`$.n`" or "`key` in `$.metadata`"
    path = where.strip("`").removeprefix("key` in `").removeprefix("$") + ("[...]" if where.startswith("`key`") else "")
    missing = re.match(r"Object missing required field `(\w+)`", what)
    path += f".{missing[1]}" if missing else ""  # told at the field, which is absent (None)
    value, path = _value_at(root, path), (at + path).lstrip(".")
    key = re.sub(r"\[\d+\]", "[]", path)
    rule = ERRORS.get(key) or ERRORS.get(key.removesuffix("[]"))
    if rule is not None:
        message, param = rule if isinstance(rule, tuple) else (rule, "{path}")
        fields = {"path": path, "parent": re.sub(r"(\.\w+|\[\d+\])$", "", path), "value": value}
        return ApiError(400, message.format(**fields), param=param.format(**fields))
    bound = re.match(r"Expected `int` [<>]= (-?\d+)", what)
    kinds = re.match(r"Expected `([^`]+)`, got", what)
    if bound and abs(int(bound[1])) >= 2**63 - 1:
        message = f"'{path}' must be a 64-bit integer, got {value}"  # check_body let at most 20 digits through
    elif bound:
        message = f"'{path}' must be at least {bound[1]}, got {value}"
    elif kinds:
        names = dict.fromkeys(_KIND_NAMES.get(k, k) for k in kinds[1].split(" | ") if k != "null")
        message = f"'{path}' must be of type {' or '.join(names)}"
    else:
        message = f"'{path}': {what}"  # msgspec's own words
    return ApiError(400, message, param=path or None)


def _value_at(root: Any, path: str) -> Any:
    """What the client sent at `path` (".input[0].type"); None where nothing is."""
    node = root
    for name, index in _STEP.findall(path):
        if name and isinstance(node, dict):
            node = node.get(name)
        elif index and isinstance(node, list) and int(index) < len(node):
            node = node[int(index)]
        else:
            return None
    return node
