"""Structured output and tool calls through the real server: every constrained answer parses and
validates on a model whose free text is noise (the tiny random Qwen2-VL), streamed or not,
greedy or sampled; the official SDK's `parse`; forced and parsed tool calls; bad input -> 400."""

from __future__ import annotations

import json
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from pydantic import BaseModel

from tests.server_helpers import ServerProcess, running, sse_events
from testkit.json_schemas import CHOICES, REGEXES, SCHEMAS, TIME_TOOL, WEATHER_TOOL

pytestmark = [pytest.mark.timeout(600), pytest.mark.slow]

MAX_TOKENS = 512  # the longest shortest answer (nested_invoice) is ~370 tokens in the tiny vocabulary
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER


@pytest.fixture(scope="module")
def server(tiny_vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("structured") / "server.log"
    srv = ServerProcess(
        tiny_vlm_dir, log, "--served-model-name", "tiny", "--kv-cache-tokens", "65536", "--max-num-seqs", "128"
    )
    with running(srv):
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.openai_client(300.0)


def post(server: ServerProcess, body: dict[str, Any], path: str = "/chat/completions") -> httpx.Response:
    return httpx.post(server.base_url + path, json={"model": "tiny", **body}, timeout=300)


def streamed(server: ServerProcess, body: dict[str, Any]) -> tuple[str, str, list[dict[str, Any]]]:
    """(content, finish_reason, tool_call deltas) of a streamed chat answer."""
    with httpx.stream(
        "POST", server.base_url + "/chat/completions", json={"model": "tiny", **body, "stream": True}, timeout=300
    ) as r:
        assert r.status_code == 200, r.read()
        events = sse_events(list(r.iter_lines()))
    assert events[-1] == "[DONE]"
    text, finish, calls = [], None, []
    for event in events[:-1]:
        chunk = json.loads(event)
        assert "error" not in chunk, chunk
        for choice in chunk["choices"]:
            delta = choice["delta"]
            text.append(delta.get("content") or "")
            calls.extend(delta.get("tool_calls") or [])
            finish = choice["finish_reason"] or finish
    return "".join(text), finish, calls


def answer(server: ServerProcess, body: dict[str, Any], stream: bool) -> tuple[str, str]:
    if stream:
        text, finish, _ = streamed(server, body)
        return text, finish
    r = post(server, body)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"], choice["finish_reason"]


def user(text: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": text}]


def test_every_schema_parses_and_validates(server: ServerProcess) -> None:
    cases = [(name, temperature, stream) for name in SCHEMAS for temperature in (0.0, 1.0) for stream in (False, True)]

    def run(case: tuple[str, float, bool]) -> tuple[str, float, bool, str, str]:
        name, temperature, stream = case
        body = {
            "messages": user(f"Describe {name} as JSON."),
            "max_tokens": MAX_TOKENS,
            "temperature": temperature,
            "seed": 7,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": name, "schema": SCHEMAS[name], "strict": True},
            },
        }
        return (name, temperature, stream, *answer(server, body, stream))

    with ThreadPoolExecutor(32) as pool:
        results = list(pool.map(run, cases))
    assert len(SCHEMAS) >= 20
    for name, temperature, stream, text, finish in results:
        where = (name, temperature, stream, finish, text[:200])
        jsonschema.validate(json.loads(text), SCHEMAS[name], format_checker=FORMATS), where
        assert finish == "stop", where
    # Streaming and non-streaming greedy answers are the same text.
    greedy = {(n, s): t for n, temp, s, t, _ in results if temp == 0.0}
    assert all(greedy[(n, False)] == greedy[(n, True)] for n in SCHEMAS)


def test_json_object_regex_and_choice(server: ServerProcess) -> None:
    for stream in (False, True):
        for temperature in (0.0, 1.0):
            text, _ = answer(
                server,
                {
                    "messages": user("json please"),
                    "max_tokens": 256,
                    "temperature": temperature,
                    "response_format": {"type": "json_object"},
                },
                stream,
            )
            assert isinstance(json.loads(text), dict)
            for name, pattern in REGEXES.items():
                text, _ = answer(
                    server,
                    {
                        "messages": user(name),
                        "max_tokens": 128,
                        "temperature": temperature,
                        "structured_outputs": {"regex": pattern},
                    },
                    stream,
                )
                assert re.fullmatch(pattern, text), (name, text)
            for name, choices in CHOICES.items():
                text, _ = answer(
                    server,
                    {
                        "messages": user(name),
                        "max_tokens": 16,
                        "temperature": temperature,
                        "structured_outputs": {"choice": choices},
                    },
                    stream,
                )
                assert text in choices, (name, text)
    grammar = 'root ::= "yes" | "no" | "maybe so"'
    text, finish = answer(
        server, {"messages": user("ok?"), "max_tokens": 8, "structured_outputs": {"grammar": grammar}}, False
    )
    assert text in ("yes", "no", "maybe so") and finish == "stop"


def test_completions_take_structured_outputs(server: ServerProcess) -> None:
    r = post(
        server,
        {
            "prompt": "The date is",
            "max_tokens": 32,
            "temperature": 0,
            "structured_outputs": {"regex": REGEXES["iso_date"]},
        },
        "/completions",
    )
    assert r.status_code == 200, r.text
    assert re.fullmatch(REGEXES["iso_date"], r.json()["choices"][0]["text"])


class Colour(BaseModel):
    name: str
    hex: str
    warm: bool


class Palette(BaseModel):
    title: str
    colours: list[Colour]
    score: float


def test_sdk_parse_returns_the_pydantic_object(client: openai.OpenAI) -> None:
    completion = client.chat.completions.parse(
        model="tiny", messages=user("A palette, please."), response_format=Palette, max_tokens=MAX_TOKENS, temperature=0
    )
    message = completion.choices[0].message
    assert isinstance(message.parsed, Palette), message.content
    assert message.parsed == Palette.model_validate_json(message.content)


WEATHER, TIME = WEATHER_TOOL, TIME_TOOL
SCHEMA_OF = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}


def check_calls(calls: list[Any]) -> None:
    assert calls
    for call in calls:
        assert call.id.startswith("call_") and call.type == "function"
        jsonschema.validate(json.loads(call.function.arguments), SCHEMA_OF[call.function.name])


def test_named_and_required_tool_calls(client: openai.OpenAI, server: ServerProcess) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    for temperature in (0.0, 1.0):
        done = client.chat.completions.create(
            model="tiny",
            messages=user("Weather in Paris?"),
            tools=[WEATHER, TIME],
            tool_choice=named,
            max_tokens=128,
            temperature=temperature,
        )
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert [c.function.name for c in choice.message.tool_calls] == ["get_weather"]
        check_calls(choice.message.tool_calls)
        done = client.chat.completions.create(
            model="tiny",
            messages=user("Weather or time?"),
            tools=[WEATHER, TIME],
            tool_choice="required",
            max_tokens=256,
            temperature=temperature,
        )
        choice = done.choices[0]
        assert choice.finish_reason == "tool_calls"
        check_calls(choice.message.tool_calls)
    # Streamed: the named call's arguments arrive as deltas and add up to valid JSON.
    _, finish, deltas = streamed(
        server, {"messages": user("Weather?"), "tools": [WEATHER], "tool_choice": named, "max_tokens": 128}
    )
    assert (
        finish == "tool_calls"
        and deltas[0]["function"]["name"] == "get_weather"
        and deltas[0]["id"].startswith("call_")
    )
    jsonschema.validate(
        json.loads("".join(d["function"].get("arguments", "") for d in deltas)), SCHEMA_OF["get_weather"]
    )
    _, finish, deltas = streamed(
        server, {"messages": user("Any?"), "tools": [WEATHER, TIME], "tool_choice": "required", "max_tokens": 256}
    )
    assert finish == "tool_calls" and deltas
    for d in deltas:
        jsonschema.validate(json.loads(d["function"]["arguments"]), SCHEMA_OF[d["function"]["name"]])


def _schema(s: Any) -> dict[str, Any]:
    return {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": s}}}


# (the request's extra fields, the error's param, words its message must hold)
BAD_CONSTRAINTS = [
    pytest.param(_schema({"type": "frobnicate"}), "response_format", "Invalid type", id="schema-unknown-type"),
    pytest.param(  # cannot be enforced
        _schema({"type": "array", "uniqueItems": True}), "response_format", "uniqueItems", id="schema-uniqueItems"
    ),
    pytest.param(_schema({"$ref": "#/$defs/missing"}), "response_format", "missing", id="schema-dangling-ref"),
    pytest.param(_schema({"type": "string", "pattern": "(("}), "response_format", "regex", id="schema-bad-pattern"),
    pytest.param({"response_format": {"type": "yaml"}}, "response_format", "response_format", id="unknown-format"),
    pytest.param({"structured_outputs": {"regex": "[a-z"}}, "response_format", "regex", id="bad-regex"),
    pytest.param({"structured_outputs": {"choice": []}}, "structured_outputs", "choice", id="empty-choice"),
    pytest.param(
        {"structured_outputs": {"regex": "a", "choice": ["b"]}}, "structured_outputs", "exactly one", id="two-kinds"
    ),
    pytest.param({"structured_outputs": {"grammar": "start: nowhere"}}, "response_format", "nowhere", id="bad-grammar"),
    pytest.param(
        {"response_format": {"type": "json_object"}, "structured_outputs": {"regex": "a"}},
        "structured_outputs",
        "only one",
        id="format-and-structured-outputs",
    ),
    pytest.param(
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_stock"}}},
        "tool_choice",
        "get_stock",
        id="named-tool-not-given",
    ),
    pytest.param({"tool_choice": "required"}, "tool_choice", "tools", id="required-without-tools"),
    pytest.param(
        {"tools": [{"type": "function", "function": {"description": "no name"}}]},
        "tools[0]",
        "name",
        id="tool-without-name",
    ),
    pytest.param(
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
        "tools[0].function.parameters",
        "nope",
        id="tool-bad-parameters",
    ),
]


@pytest.mark.parametrize(("extra", "param", "words"), BAD_CONSTRAINTS)
def test_a_bad_constraint_is_400_and_generates_nothing(
    server: ServerProcess, extra: dict[str, Any], param: str, words: str
) -> None:
    before = server.metrics()
    r = post(server, {"messages": user("hi"), "max_tokens": 4, **extra})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["type"] == "invalid_request_error"
    assert error["param"] == param and words in error["message"], error
    after = server.metrics()
    assert after["vlm_engine:kv_pages_used"] == 0 and after.get("vlm_engine:generation_tokens_total") == before.get(
        "vlm_engine:generation_tokens_total"
    )


def test_the_server_keeps_serving_after_bad_constraints(server: ServerProcess) -> None:
    text, finish = answer(server, {"messages": user("still there?"), "max_tokens": 8, "temperature": 0}, False)
    assert finish in ("stop", "length") and text


def test_constrained_and_free_requests_share_a_batch(server: ServerProcess) -> None:
    prompts = [f"Tell me about item {i}." for i in range(6)]
    alone = [answer(server, {"messages": user(p), "max_tokens": 24, "temperature": 0}, False)[0] for p in prompts]

    def run(i: int) -> str:
        body = {"messages": user(prompts[i // 2]), "max_tokens": 24, "temperature": 0}
        if i % 2:
            body = {
                **body,
                "messages": user(f"json {i}"),
                "max_tokens": 200,
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "s", "schema": SCHEMAS["nested_object"]},
                },
            }
        return answer(server, body, stream=i % 4 == 0)[0]

    with ThreadPoolExecutor(12) as pool:
        mixed = list(pool.map(run, range(12)))
    assert [mixed[i] for i in range(0, 12, 2)] == alone
    for i in range(1, 12, 2):
        jsonschema.validate(json.loads(mixed[i]), SCHEMAS["nested_object"])
