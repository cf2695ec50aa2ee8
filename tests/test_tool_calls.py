"""Tool calls: the Hermes parser and the OpenAI delta stream built from it (units), tool choice
resolution, and end to end on the scripted Qwen2 checkpoint (its greedy output is a fixed
`<tool_call>` script), in-process and through the real server with the official `openai` SDK."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import openai
import pytest

from tests.server_helpers import ServerProcess, running
from vlm_engine.engine import Engine
from vlm_engine.sampling_params import SamplingParams
from vlm_engine.server.tool_parsers import HermesToolParser, ToolCall, ToolOutput, finish_reason_with_calls
from vlm_engine.structured.spec import StructuredOutput, StructuredOutputError
from vlm_engine.structured.tools import ToolChoice, calls_schema, resolve_tool_choice, validate_tools
from testkit.json_schemas import TIME_TOOL, WEATHER_TOOL
from testkit.scripted import TOOL_CALL_SCRIPT, cached_scripted_qwen2, tool_call_script

WEATHER, TIME = WEATHER_TOOL, TIME_TOOL
SCRIPT_ARGS = {"city": "Paris", "unit": "celsius"}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


# ---- HermesToolParser ------------------------------------------------------------------------------


def test_parser_one_call() -> None:
    content, calls = HermesToolParser().parse(TOOL_CALL_SCRIPT)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", SCRIPT_ARGS)]
    assert isinstance(calls[0].arguments, str) and calls[0].id.startswith("call_")
    body = calls[0].body(0)
    assert body == {
        "id": calls[0].id,
        "type": "function",
        "index": 0,
        "function": {"name": "get_weather", "arguments": calls[0].arguments},
    }


def test_parser_two_calls_keep_order_and_get_distinct_ids() -> None:
    text = TOOL_CALL_SCRIPT + "\n" + tool_call_script("get_time", {"zone": "CET"})
    content, calls = HermesToolParser().parse(text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", SCRIPT_ARGS),
        ("get_time", {"zone": "CET"}),
    ]
    assert calls[0].id != calls[1].id


def test_parser_list_form() -> None:
    text = '<tool_call>[{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]</tool_call>'
    content, calls = HermesToolParser().parse(text)
    assert content is None
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("a", {"x": 1}), ("b", {})]


def test_parser_content_before_the_call() -> None:
    text = "Let me look that up.\n\n" + TOOL_CALL_SCRIPT
    content, calls = HermesToolParser().parse(text)
    assert content == "Let me look that up."
    assert [c.name for c in calls] == ["get_weather"]


def test_parser_argument_forms() -> None:
    # Arguments already as JSON text stay as they are; "parameters" is accepted for "arguments";
    # a block cut off before </tool_call> still counts when its JSON is complete.
    text = '<tool_call>{"name": "f", "arguments": "{\\"k\\": 2}"}</tool_call><tool_call>{"name": "g", "parameters": {"p": true}}'
    _, calls = HermesToolParser().parse(text)
    assert [(c.name, c.arguments) for c in calls] == [("f", '{"k": 2}'), ("g", '{"p": true}')]
    _, calls = HermesToolParser().parse('<tool_call>{"name": "h"}</tool_call>')
    assert [(c.name, c.arguments) for c in calls] == [("h", "{}")]


@pytest.mark.parametrize(
    "text",
    [
        "Just an answer, no tools needed.",
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par\n</tool_call>',  # invalid JSON inside
        "<tool_call>not json at all</tool_call>",
        '<tool_call>{"arguments": {"city": "Paris"}}</tool_call>',  # no name
        '<tool_call>["get_weather"]</tool_call>',
        "<tool_call>",
        "",
    ],
)
def test_parser_text_without_a_valid_call_is_all_content(text: str) -> None:
    assert HermesToolParser().parse(text) == (text, [])


# ---- ToolOutput: whole messages and streams -------------------------------------------------------


def pieces(text: str, seed: int, most: int = 5) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, most)
        out.append(text[i : i + n])
        i += n
    return out


def run_stream(
    output: ToolOutput, parts: list[str], finish: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    deltas = [d for part in parts for d in output.stream(part)]
    closing, reason = output.finish(finish)
    return deltas, closing, reason


def test_message_auto_mode() -> None:
    message, reason = ToolOutput(ToolChoice("auto")).message(TOOL_CALL_SCRIPT, "stop")
    assert reason == "tool_calls" and message["content"] is None and message["role"] == "assistant"
    [call] = message["tool_calls"]
    assert call["type"] == "function" and call["id"].startswith("call_") and "index" not in call
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == SCRIPT_ARGS
    message, reason = ToolOutput(ToolChoice("auto")).message("plain text", "length")
    assert reason == "length" and message["content"] == "plain text" and "tool_calls" not in message
    message, reason = ToolOutput(ToolChoice("none")).message(TOOL_CALL_SCRIPT, "stop")
    assert reason == "stop" and message["content"] == TOOL_CALL_SCRIPT and "tool_calls" not in message


@pytest.mark.parametrize("seed", range(6))
def test_stream_auto_holds_back_the_call(seed: int) -> None:
    before = "Sure, checking the weather for you.\n"
    parts = pieces(before + TOOL_CALL_SCRIPT, seed)
    assert len(parts) > 20
    deltas, closing, reason = run_stream(ToolOutput(ToolChoice("auto")), parts, "stop")
    assert all(set(d) == {"content"} and d["content"] for d in deltas), deltas
    # Only text before the call was shown, and never a piece of the marker.
    assert "".join(d["content"] for d in deltas) == before
    assert not any("<" in d["content"] for d in deltas)
    assert reason == "tool_calls"
    [delta] = closing
    [call] = delta["tool_calls"]
    assert call["index"] == 0 and call["id"].startswith("call_") and call["type"] == "function"
    assert call["function"]["name"] == "get_weather" and json.loads(call["function"]["arguments"]) == SCRIPT_ARGS


def test_stream_auto_script_only_sends_no_content() -> None:
    deltas, closing, reason = run_stream(ToolOutput(ToolChoice("auto")), pieces(TOOL_CALL_SCRIPT, 99), "stop")
    assert deltas == [] and reason == "tool_calls" and len(closing) == 1


def test_stream_auto_two_calls_indexed() -> None:
    text = TOOL_CALL_SCRIPT + "\n" + tool_call_script("get_time", {"zone": "UTC"})
    _, closing, reason = run_stream(ToolOutput(ToolChoice("auto")), pieces(text, 3), "stop")
    assert reason == "tool_calls"
    assert [(c["index"], c["function"]["name"]) for c in closing[0]["tool_calls"]] == [
        (0, "get_weather"),
        (1, "get_time"),
    ]


@pytest.mark.parametrize("seed", range(4))
def test_stream_auto_without_a_call_releases_held_text(seed: int) -> None:
    # A "<" that turns out not to start a call is shown once it cannot be the marker any more;
    # a trailing partial marker is released by finish().
    text = "a < b and <tool is not <tool x <tool"
    deltas, closing, reason = run_stream(ToolOutput(ToolChoice("auto")), pieces(text, seed, 3), "stop")
    shown = "".join(d["content"] for d in deltas)
    assert shown + "".join(d["content"] for d in closing) == text
    assert not shown.endswith("<tool") and closing == [{"content": "<tool"}]
    assert reason == "stop"
    # Invalid JSON inside a block: no call, everything held back comes out as content.
    bad = "Hi <tool_call>{broken</tool_call>"
    deltas, closing, reason = run_stream(ToolOutput(ToolChoice("auto")), pieces(bad, seed), "stop")
    assert "".join(d["content"] for d in deltas + closing) == bad and reason == "stop"


@pytest.mark.parametrize("seed", range(3))
def test_stream_named_sends_argument_deltas(seed: int) -> None:
    choice = resolve_tool_choice(
        validate_tools([WEATHER, TIME]), {"type": "function", "function": {"name": "get_weather"}}
    )
    assert choice.mode == "named" and choice.name == "get_weather"
    arguments = json.dumps(SCRIPT_ARGS)
    out = ToolOutput(choice)
    parts = pieces(arguments, seed)
    deltas, closing, reason = run_stream(out, parts, "stop")
    head = deltas[0]["tool_calls"][0]
    assert head["index"] == 0 and head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    rest = [d["tool_calls"][0] for d in deltas[1:]]
    assert len(rest) == len(parts) and all(set(r) == {"index", "function"} and r["index"] == 0 for r in rest)
    assert "".join(r["function"]["arguments"] for r in rest) == arguments
    assert closing == [] and reason == "tool_calls"
    # The whole-message form agrees, and a cut-off answer is not a call.
    message, reason = ToolOutput(choice).message(arguments, "stop")
    assert reason == "tool_calls" and message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": arguments}
    message, reason = ToolOutput(choice).message(arguments[:10], "length")
    assert reason == "length" and "tool_calls" not in message and message["content"] == arguments[:10]
    _, closing, reason = run_stream(ToolOutput(choice), pieces(arguments[:10], seed), "length")
    assert closing == [] and reason == "length"


def test_stream_required_sends_the_array_whole() -> None:
    choice = resolve_tool_choice(validate_tools([WEATHER, TIME]), "required")
    text = json.dumps(
        [{"name": "get_weather", "arguments": SCRIPT_ARGS}, {"name": "get_time", "arguments": {"zone": "CET"}}]
    )
    deltas, closing, reason = run_stream(ToolOutput(choice), pieces(text, 1), "stop")
    assert deltas == [] and reason == "tool_calls"
    assert [
        (c["index"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in closing[0]["tool_calls"]
    ] == [(0, "get_weather", SCRIPT_ARGS), (1, "get_time", {"zone": "CET"})]


def test_finish_reason_with_calls() -> None:
    call = ToolCall("f", "{}")
    assert finish_reason_with_calls("stop", [call]) == "tool_calls"
    assert finish_reason_with_calls("length", [call]) == "length"
    assert finish_reason_with_calls("stop", []) == "stop"


# ---- tool choice -------------------------------------------------------------------------------------


def test_resolve_tool_choice_modes() -> None:
    tools = validate_tools([WEATHER, TIME])
    assert resolve_tool_choice(tools, None) == ToolChoice("auto")
    assert resolve_tool_choice(None, None) == ToolChoice("none")
    assert resolve_tool_choice(tools, "none") == ToolChoice("none")
    assert resolve_tool_choice(None, "none") == ToolChoice("none")
    assert resolve_tool_choice(tools, "auto") == ToolChoice("auto")
    named = resolve_tool_choice(tools, {"type": "function", "function": {"name": "get_time"}})
    assert named == ToolChoice("named", "get_time", StructuredOutput.json(TIME["function"]["parameters"]))
    required = resolve_tool_choice(tools, "required")
    assert required.mode == "required" and required.constraint == StructuredOutput.json(calls_schema(tools, True))
    one = resolve_tool_choice(tools, "required", parallel=False)
    assert json.loads(one.constraint.spec)["maxItems"] == 1 and "maxItems" not in json.loads(required.constraint.spec)
    # The "required" schema accepts calls to the tools and nothing else.
    schema = calls_schema(tools, True)
    jsonschema.validate([{"name": "get_weather", "arguments": SCRIPT_ARGS}], schema)
    for bad in ([], [{"name": "get_stock", "arguments": {}}], [{"name": "get_weather", "arguments": {"city": "x"}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    # A tool without parameters takes any object.
    assert validate_tools([{"type": "function", "function": {"name": "ping"}}])[0]["function"]["parameters"] == {
        "type": "object"
    }


@pytest.mark.parametrize(
    ("tools", "tool_choice", "words"),
    [
        ([WEATHER], {"type": "function", "function": {"name": "get_stock"}}, "get_stock"),
        (None, "required", "needs 'tools'"),
        (None, "auto", "needs 'tools'"),
        (None, {"type": "function", "function": {"name": "get_weather"}}, "needs 'tools'"),
        ([WEATHER], "sometimes", "must be"),
        ([WEATHER], {"type": "function", "function": {}}, "name"),
        ([WEATHER], {"type": "function"}, "name"),
    ],
)
def test_resolve_tool_choice_errors(tools: Any, tool_choice: Any, words: str) -> None:
    with pytest.raises(StructuredOutputError) as info:
        resolve_tool_choice(validate_tools(tools) if tools else None, tool_choice)
    assert info.value.param == "tool_choice" and words in info.value.message, info.value.message


@pytest.mark.parametrize(
    ("tools", "param"),
    [
        ([], "tools"),
        ({"type": "function"}, "tools"),
        ([{"type": "function", "function": {"description": "no name"}}], "tools[0]"),
        ([WEATHER, {"type": "retrieval"}], "tools[1]"),
        ([WEATHER, WEATHER], "tools[1]"),
        ([{"type": "function", "function": {"name": "f", "parameters": "object"}}], "tools[0]"),
    ],
)
def test_validate_tools_errors(tools: Any, param: str) -> None:
    with pytest.raises(StructuredOutputError) as info:
        validate_tools(tools)
    assert info.value.param == param


# ---- the scripted checkpoint, in-process ------------------------------------------------------------


@pytest.fixture(scope="module")
def scripted_dir() -> Path:
    return cached_scripted_qwen2()


@pytest.fixture(scope="module")
def scripted(scripted_dir: Path) -> Engine:
    return Engine(str(scripted_dir), dtype="float32", kv_cache_tokens=8192)


def test_engine_emits_the_script_with_tools_in_the_prompt(scripted: Engine) -> None:
    prompt = scripted.tokenizer.decode(scripted.process_messages(QUESTION, [WEATHER]).token_ids)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt and "The current weather in a city" in prompt
    assert "get_weather" not in scripted.tokenizer.decode(scripted.process_messages(QUESTION).token_ids)
    outs = scripted.chat(
        [QUESTION, QUESTION],
        [SamplingParams(max_tokens=64, temperature=0), SamplingParams(max_tokens=64, temperature=1.0, seed=3)],
        tools=[WEATHER],
    )
    for out in outs:
        assert out.text == TOOL_CALL_SCRIPT and out.finish_reason == "stop"
        assert out.stop_reason in scripted.eos_token_ids
    content, calls = HermesToolParser().parse(outs[0].text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [("get_weather", SCRIPT_ARGS)]


def test_engine_renders_a_tool_round_trip(scripted: Engine) -> None:
    messages = [
        *QUESTION,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps(SCRIPT_ARGS)},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 18}'},
    ]
    prompt = scripted.tokenizer.decode(scripted.process_messages(messages, [WEATHER]).token_ids)
    assert '<tool_response>\n{"temperature": 18}\n</tool_response>' in prompt
    assert (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
        in prompt
    )
    out = scripted.chat([messages], SamplingParams(max_tokens=64, temperature=0), tools=[WEATHER])[0]
    assert out.text == TOOL_CALL_SCRIPT


def test_forced_call_overrides_the_script(scripted: Engine) -> None:
    """The scripted model puts all its weight on `<tool_call>`; a named / required tool choice must
    still produce exactly the constrained JSON (the mask wins over a logit gap of 32)."""
    tools = validate_tools([WEATHER, TIME])
    named = resolve_tool_choice(tools, {"type": "function", "function": {"name": "get_weather"}})
    required = resolve_tool_choice(tools, "required", parallel=False)
    params = [
        SamplingParams(max_tokens=96, temperature=t, seed=1, structured_output=c.constraint)
        for c in (named, required)
        for t in (0.0, 1.0)
    ]
    outs = scripted.chat([QUESTION] * len(params), params, tools=tools)
    for out in outs[:2]:
        jsonschema.validate(json.loads(out.text), WEATHER["function"]["parameters"])
        assert out.finish_reason == "stop"
        message, reason = ToolOutput(named).message(out.text, out.finish_reason)
        assert reason == "tool_calls" and message["tool_calls"][0]["function"]["name"] == "get_weather"
    for out in outs[2:]:
        value = json.loads(out.text)
        jsonschema.validate(value, calls_schema(tools, False))
        assert out.finish_reason == "stop"
    assert scripted.pool.num_used == 0


# ---- the real server, with the official SDK ------------------------------------------------------------


@pytest.fixture(scope="module")
def server(scripted_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = ServerProcess(
        scripted_dir, tmp_path_factory.mktemp("tools") / "server.log", "--served-model-name", "scripted"
    )
    with running(srv):
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.openai_client()


def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.chat.completions.create(model="scripted", max_tokens=64, temperature=0, **kwargs)


def check_script_call(call: Any) -> None:
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == SCRIPT_ARGS


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_server_auto_tool_calls(client: openai.OpenAI) -> None:
    for extra in ({"tool_choice": "auto"}, {}):  # omitted: "auto" because tools are given
        done = create(client, messages=QUESTION, tools=[WEATHER, TIME], **extra)
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls", extra
        assert choice.message.content is None and choice.message.role == "assistant"
        [call] = choice.message.tool_calls
        check_script_call(call)
        assert done.usage.completion_tokens == 4  # three script pieces and the EOS


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_server_streamed_tool_calls(client: openai.OpenAI) -> None:
    for extra in ({"tool_choice": "auto"}, {}):
        stream = create(client, messages=QUESTION, tools=[WEATHER], stream=True, **extra)
        content, calls, finish = [], {}, None
        for chunk in stream:
            for choice in chunk.choices:
                delta = choice.delta
                if delta.content:
                    content.append(delta.content)
                for tc in delta.tool_calls or []:
                    entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
                    entry["id"] = tc.id or entry["id"]
                    if tc.function is not None:
                        entry["name"] += tc.function.name or ""
                        entry["arguments"] += tc.function.arguments or ""
                finish = choice.finish_reason or finish
        assert not any("<tool_call" in c for c in content), content
        assert "".join(content) == ""
        assert finish == "tool_calls"
        assert list(calls) == [0]
        assert calls[0]["id"].startswith("call_") and calls[0]["name"] == "get_weather"
        assert json.loads(calls[0]["arguments"]) == SCRIPT_ARGS


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_server_tool_choice_none_returns_text(client: openai.OpenAI) -> None:
    with_tools = create(client, messages=QUESTION, tools=[WEATHER], tool_choice="auto")
    done = create(client, messages=QUESTION, tools=[WEATHER], tool_choice="none")
    choice = done.choices[0]
    assert choice.finish_reason == "stop" and not choice.message.tool_calls
    assert choice.message.content == TOOL_CALL_SCRIPT
    # "none" also keeps the tools out of the prompt.
    plain = create(client, messages=QUESTION)
    assert done.usage.prompt_tokens == plain.usage.prompt_tokens < with_tools.usage.prompt_tokens
    # Streamed, the text arrives as content.
    text = "".join(
        c.choices[0].delta.content or ""
        for c in create(client, messages=QUESTION, tools=[WEATHER], tool_choice="none", stream=True)
        if c.choices
    )
    assert text == TOOL_CALL_SCRIPT


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_server_accepts_a_tool_round_trip(client: openai.OpenAI) -> None:
    first = create(client, messages=QUESTION, tools=[WEATHER])
    message = first.choices[0].message
    call = message.tool_calls[0]
    follow_up = [
        *QUESTION,
        message.model_dump(exclude_none=True),  # the assistant turn as the SDK returned it
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18, "unit": "celsius"})},
    ]
    assert follow_up[1]["tool_calls"][0]["id"] == call.id
    raw = client.chat.completions.with_raw_response.create(
        model="scripted", messages=follow_up, tools=[WEATHER], max_tokens=64, temperature=0
    )
    assert raw.http_response.status_code == 200
    done = raw.parse()
    # The history reached the template: the prompt grew by the call and the tool's answer.
    assert done.usage.prompt_tokens > first.usage.prompt_tokens + 10
    check_script_call(done.choices[0].message.tool_calls[0])
    assert done.choices[0].finish_reason == "tool_calls"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_server_responses_api_parses_auto_tool_calls(client: openai.OpenAI) -> None:
    """The Responses API shares chat's tool parsing: the script becomes a function_call item, whole
    and streamed (no `<tool_call>` text leaks into output_text events)."""
    flat = [{"type": "function", **WEATHER["function"]}]
    ask = {"model": "scripted", "input": "What is the weather in Paris?", "tools": flat, "max_output_tokens": 64,
           "temperature": 0}  # fmt: skip
    done = client.responses.create(**ask)
    [call] = done.output
    assert call.type == "function_call" and call.call_id.startswith("call_") and done.status == "completed"
    assert call.name == "get_weather" and json.loads(call.arguments) == SCRIPT_ARGS
    with client.responses.stream(**ask) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert not [e for e in events if e.type == "response.output_text.delta"]
    [streamed] = final.output
    assert streamed.type == "function_call" and json.loads(streamed.arguments) == SCRIPT_ARGS
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["function_call"] and events[-1].type == "response.completed"
