"""The Responses API (`/v1/responses`): conversion units (input items, tools, text.format, error
parameters, the store's bounds, output items and their events), then end to end through the real
server with the official `openai` SDK on the tiny Qwen2-VL: greedy text equal to chat completions
for the same conversation, images, tools round trips, streams, `parse`, stored responses and
`previous_response_id` with prefix-cache hits, and the errors."""

from __future__ import annotations

import base64
import io
import json
from pathlib import Path
from typing import Any, Literal

import httpx
import jsonschema
import openai
import pytest
from openai.types.responses import Response as SdkResponse
from pydantic import BaseModel

from tests.conftest import make_image
from tests.server_helpers import ServerProcess, assert_exact_schema, running
from vlm_engine.server import responses_protocol as R
from vlm_engine.server.errors import ApiError
from vlm_engine.server.responses import OutputItems
from vlm_engine.server.responses_store import ResponseStore

MODEL = "tiny-vlm"
UNIT_TOOL = {
    "type": "function",
    "name": "set_unit",
    "description": "Choose the temperature unit.",
    "parameters": {
        "type": "object",
        "properties": {"unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["unit"],
        "additionalProperties": False,
    },
    "strict": True,
}


def parse(body: dict[str, Any], previous: list[dict[str, Any]] | None = None) -> R.ResponsesRequest:
    return R.parse_responses(body, MODEL, 4096, 4, 1, previous)


def png_uri(width: int, height: int, seed: int) -> str:
    buffer = io.BytesIO()
    make_image(width, height, seed).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


# ---- conversion -------------------------------------------------------------------------------------


def test_string_input_and_instructions_become_chat_messages() -> None:
    request = parse({"input": "Hi", "instructions": "Be brief.", "max_output_tokens": 7, "temperature": 0})
    assert request.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    generate = request.generate
    assert generate.kind == "chat" and generate.api == "responses" and generate.prompts == [request.messages]
    assert generate.sampling.max_tokens == 7 and generate.sampling.temperature < 1e-3
    assert request.store and request.history_start == 1  # instructions are not carried to a follow-up
    assert request.echo["instructions"] == "Be brief." and request.echo["text"] == {"format": {"type": "text"}}


def test_items_become_chat_messages_with_parts_calls_and_outputs() -> None:
    items = [
        {"role": "user", "content": [
            {"type": "input_text", "text": "What is here?"},
            {"type": "input_image", "image_url": "https://example.com/a.png", "detail": "auto"},
            {"type": "input_file", "file_data": "data:application/pdf;base64,JVBERi0=", "filename": "a.pdf"},
        ]},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "A cat."}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"type": "function_call", "call_id": "call_1", "name": "f", "arguments": "{}"},
        {"type": "function_call", "call_id": "call_2", "name": "g", "arguments": "{\"x\": 1}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "one"},
        {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "two"}]},
    ]  # fmt: skip
    messages = parse({"input": items}).messages
    assert messages[0]["content"] == [
        {"type": "text", "text": "What is here?"},
        {"type": "image_url", "image_url": {"url": "https://example.com/a.png"}},
        {"type": "file", "file": {"file_data": "data:application/pdf;base64,JVBERi0=", "filename": "a.pdf"}},
    ]
    assert messages[1] == {"role": "assistant", "content": "A cat."}
    # Consecutive calls are one assistant turn (parallel calls), as chat sends them.
    assert messages[2] == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "call_2", "type": "function", "function": {"name": "g", "arguments": "{\"x\": 1}"}},
        ],
    }
    assert messages[3] == {"role": "tool", "tool_call_id": "call_1", "content": "one"}
    assert messages[4] == {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "two"}]}


def test_previous_conversation_goes_between_instructions_and_input() -> None:
    previous = [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]
    request = parse({"input": "c", "instructions": "sys"}, previous)
    assert [m["content"] for m in request.messages] == ["sys", "a", "b", "c"]
    assert request.messages[request.history_start :] == [*previous, {"role": "user", "content": "c"}]


def test_tools_tool_choice_and_text_format_become_chat_fields() -> None:
    body = {
        "input": "x",
        "tools": [UNIT_TOOL],
        "tool_choice": {"type": "function", "name": "set_unit"},
        "text": {"format": {"type": "json_schema", "name": "out", "schema": {"type": "object"}, "strict": True}},
    }
    chat = R.chat_body(body, [], R.function_tools(body["tools"]))
    assert chat["tools"] == [{"type": "function", "function": {k: v for k, v in UNIT_TOOL.items() if k != "type"}}]
    assert chat["tool_choice"] == {"type": "function", "function": {"name": "set_unit"}}
    assert chat["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}, "strict": True},
    }
    request = parse({"input": "x", "tools": [UNIT_TOOL], "tool_choice": "required"})
    assert request.generate.tool_choice.mode == "required" and request.echo["tools"] == [UNIT_TOOL]
    assert parse({"input": "x", "text": {"format": {"type": "json_object"}}}).generate.sampling.structured_output


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "input[0]", "input item type 'item_reference'"),
        ({"input": [{"type": "nope"}]}, "input[0]", "not supported"),
        ({"input": [{"role": "robot", "content": "x"}]}, "input[0].role", "must be one of"),
        ({"input": [{"role": "user", "content": [{"type": "input_audio"}]}]}, "input[0].content[0]", "input_audio"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "f"}]}]}, "input[0].content[0]",
         "file_id"),
        ({"input": []}, "input", "non-empty"),
        ({"input": "x", "text": {"format": {"type": "xml"}}}, "text.format", "'xml'"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "n"}}}, "text.format.schema", "schema"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "schema": {}}}}, "text.format.name", "name"),
        ({"input": "x", "text": "json"}, "text", "object"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0]", "only function tools"),
        ({"input": "x", "tool_choice": {"type": "file_search"}}, "tool_choice", "tool_choice"),
        ({"input": "x", "tool_choice": "required"}, "tool_choice", "needs 'tools'"),
        ({"input": "x", "background": True}, "background", "background"),
        ({"input": "x", "truncation": "auto"}, "truncation", "disabled"),
        ({"input": "x", "max_output_tokens": 0}, "max_output_tokens", "at least 1"),
        ({"input": "x", "top_logprobs": 30}, "top_logprobs", "between 0 and 20"),
        ({"input": "x", "model": "other"}, "model", "does not exist"),
        ({"input": "x", "metadata": {"k": 1}}, "metadata", "string"),
        ({"input": "x", "metadata": {str(i): "v" for i in range(17)}}, "metadata", "at most 16"),
        ({"input": "x", "user": 5}, "user", "string"),
    ],
)  # fmt: skip
def test_bad_requests_name_the_responses_field(body: dict[str, Any], param: str, words: str) -> None:
    with pytest.raises(ApiError) as info:
        parse(body)
    assert info.value.param == param and words in info.value.message, info.value.message
    assert info.value.status == (404 if param == "model" else 400)


def test_chat_error_parameters_are_told_in_input_terms() -> None:
    origins = R.Origins(["instructions", "previous_response", "input[0]", "input[2]"])
    assert origins.param("messages[3].content[1]") == "input[2].content[1]"
    assert origins.param("messages[1]") == "previous_response"
    assert origins.param("response_format") == "text.format"
    assert origins.message("messages[3].content[1]: bad image") == "input[2].content[1]: bad image"


# ---- the store --------------------------------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_store_keeps_within_count_bytes_and_age() -> None:
    clock = Clock()
    store = ResponseStore(max_entries=3, max_bytes=10_000, max_age_s=60, clock=clock)
    for i in range(4):
        assert store.put({"id": f"r{i}"}, [{"role": "user", "content": "x" * 10}])
    assert store.get("r0") is None and store.get("r1") is not None and len(store) == 3  # count: oldest out
    assert not store.put({"id": "huge"}, [{"role": "user", "content": "x" * 20_000}])  # alone above the bound
    store.put({"id": "big"}, [{"role": "user", "content": "x" * 9_950}])
    assert [store.get(f"r{i}") is None for i in (1, 2, 3)] == [True, True, True]  # bytes: the rest made room
    assert store.bytes <= 10_000 and store.get("big") is not None
    clock.now = 61
    assert store.get("big") is None and len(store) == 0 and store.bytes == 0  # age
    store.put({"id": "a"}, [])
    assert store.delete("a") and not store.delete("a") and store.get("a") is None


# ---- output items and their events -------------------------------------------------------------------


def test_text_events_come_in_the_documented_order() -> None:
    items = OutputItems()
    events = items.add_delta({"content": "Hel"}) + items.add_delta({"content": "lo"}) + items.finish("completed")
    assert [e["type"] for e in events] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert events[0]["item"]["content"] == [] and events[0]["item"]["status"] == "in_progress"
    [message] = items.output
    assert message["status"] == "completed" and message["content"][0]["text"] == "Hello"
    assert events[4]["text"] == "Hello" and events[-1]["item"] is message
    assert {e.get("item_id", message["id"]) for e in events} == {message["id"]}


def test_tool_call_deltas_become_function_call_items_after_the_text() -> None:
    items = OutputItems()
    events = items.add_delta({"content": "Let me check."})
    events += items.add_delta({"tool_calls": [{"index": 0, "id": "call_a", "type": "function",
                                               "function": {"name": "f", "arguments": ""}}]})  # fmt: skip
    events += items.add_delta({"tool_calls": [{"index": 0, "function": {"arguments": "{\"a\":"}}]})
    events += items.add_delta({"tool_calls": [{"index": 0, "function": {"arguments": " 1}"}}]})
    events += items.finish("completed")
    types = [e["type"] for e in events]
    assert types.index("response.output_item.done") < types.index("response.function_call_arguments.delta")
    assert types[-2:] == ["response.function_call_arguments.done", "response.output_item.done"]
    message, call = items.output
    assert message["content"][0]["text"] == "Let me check."
    assert call["call_id"] == "call_a" and call["arguments"] == '{"a": 1}' and call["status"] == "completed"
    assert [e["output_index"] for e in events if e["type"] == "response.function_call_arguments.delta"] == [1, 1]
    assert items.conversation_turn() == {
        "role": "assistant",
        "content": "Let me check.",
        "tool_calls": [{"id": "call_a", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
    }


def test_a_response_with_no_text_still_has_its_message() -> None:
    items = OutputItems()
    events = items.finish("incomplete")
    assert [e["type"] for e in events] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert items.output[0]["status"] == "incomplete" and items.output[0]["content"][0]["text"] == ""


# ---- the real server, with the official SDK --------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    srv = ServerProcess(
        tiny_vlm_dir,
        tmp_path_factory.mktemp("responses") / "server.log",
        "--served-model-name", MODEL,
        "--responses-store-entries", "24",
    )  # fmt: skip
    with running(srv):
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return server.openai_client()


def create(client: openai.OpenAI, **kwargs: Any) -> Any:
    return client.responses.create(model=MODEL, temperature=0, **{"max_output_tokens": 12, **kwargs})


def chat(client: openai.OpenAI, messages: list[dict[str, Any]], max_tokens: int = 12) -> Any:
    return client.chat.completions.create(model=MODEL, messages=messages, max_tokens=max_tokens, temperature=0)


def check_shape(server: ServerProcess, response_id: str) -> dict[str, Any]:
    """The stored body, parsed strictly by the SDK's own model with no field it does not define."""
    body = httpx.get(f"{server.base_url}/responses/{response_id}", timeout=30).json()
    assert_exact_schema(SdkResponse, body)
    return body


@pytest.mark.timeout(300)
def test_text_equals_chat_completions(server: ServerProcess, client: openai.OpenAI) -> None:
    done = create(client, input="Tell me about the sea.", instructions="Answer in one line.")
    reference = chat(client, [{"role": "system", "content": "Answer in one line."},
                              {"role": "user", "content": "Tell me about the sea."}])  # fmt: skip
    assert done.output_text == reference.choices[0].message.content and done.output_text
    assert done.usage.input_tokens == reference.usage.prompt_tokens
    assert done.usage.output_tokens == reference.usage.completion_tokens == 12
    assert done.status == "incomplete" and done.incomplete_details.reason == "max_output_tokens"
    [message] = done.output
    assert message.type == "message" and message.role == "assistant" and message.status == "incomplete"
    assert done.id.startswith("resp_") and message.id.startswith("msg_")
    assert done.instructions == "Answer in one line." and done.model == MODEL and done.max_output_tokens == 12
    assert check_shape(server, done.id)["output"][0]["content"][0]["text"] == done.output_text


@pytest.mark.timeout(300)
def test_images_equal_chat_completions(client: openai.OpenAI) -> None:
    images = [png_uri(53, 37, 1), png_uri(29, 71, 2)]  # odd sizes, two in one message
    parts: list[dict[str, Any]] = [{"type": "input_text", "text": "Compare these."}]
    parts += [{"type": "input_image", "image_url": uri} for uri in images]
    done = create(client, input=[{"role": "user", "content": parts}])
    chat_parts: list[dict[str, Any]] = [{"type": "text", "text": "Compare these."}]
    chat_parts += [{"type": "image_url", "image_url": {"url": uri}} for uri in images]
    reference = chat(client, [{"role": "user", "content": chat_parts}])
    assert done.output_text == reference.choices[0].message.content
    assert done.usage.input_tokens == reference.usage.prompt_tokens > 20  # the images' placeholder tokens
    one = create(client, input=[{"role": "user", "content": parts[:2]}])
    assert one.usage.input_tokens < done.usage.input_tokens


def pdf_data_url(*sizes: tuple[int, int]) -> str:
    pages = [make_image(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    buffer = io.BytesIO()
    pages[0].save(buffer, "PDF", save_all=True, append_images=pages[1:], resolution=72)
    return "data:application/pdf;base64," + base64.b64encode(buffer.getvalue()).decode()


@pytest.mark.timeout(300)
def test_an_input_file_pdf_equals_the_chat_file_part(client: openai.OpenAI) -> None:
    pdf = pdf_data_url((90, 60), (40, 70))
    parts = [{"type": "input_file", "file_data": pdf, "filename": "two.pdf"}, {"type": "input_text", "text": "Sum up."}]
    done = create(client, input=[{"role": "user", "content": parts}])
    reference = chat(client, [{"role": "user", "content": [
        {"type": "file", "file": {"file_data": pdf, "filename": "two.pdf"}}, {"type": "text", "text": "Sum up."}]}])
    assert done.output_text == reference.choices[0].message.content
    assert done.usage.input_tokens == reference.usage.prompt_tokens
    one_page = create(client, input=[{"role": "user", "content": [
        {"type": "input_file", "file_data": pdf_data_url((90, 60)), "filename": "one.pdf"}, parts[1]]}])
    assert one_page.usage.input_tokens < done.usage.input_tokens  # the second page is there
    with pytest.raises(openai.BadRequestError) as info:
        create(client, input=[{"role": "user", "content": [
            {"type": "input_file", "file_data": "data:application/pdf;base64," + base64.b64encode(b"no").decode()}]}])
    assert info.value.body["param"] == "input[0].content[0]"


@pytest.mark.timeout(300)
def test_stream_events_in_order_and_deltas_join_to_the_text(client: openai.OpenAI) -> None:
    whole = create(client, input="Count with me.", store=False)
    with client.responses.stream(model=MODEL, input="Count with me.", max_output_tokens=12, temperature=0) as stream:
        events = list(stream)
    types = [e.type for e in events]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert types[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]  # fmt: skip
    assert types[4 : 4 + len(deltas)] == ["response.output_text.delta"] * len(deltas) and deltas
    assert types[4 + len(deltas) :] == ["response.output_text.done", "response.content_part.done",
                                        "response.output_item.done", "response.incomplete"]  # fmt: skip
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    assert "".join(d.delta for d in deltas) == final.output_text == whole.output_text
    assert events[0].response.id == final.id and events[0].response.status == "in_progress"
    assert final.usage.output_tokens == 12 and final.status == "incomplete"
    item_ids = {e.item_id for e in events if hasattr(e, "item_id")}
    assert item_ids == {final.output[0].id}


class Verdict(BaseModel):
    label: Literal["cat", "dog", "bird"]
    sure: bool


@pytest.mark.timeout(300)
def test_parse_and_stream_with_a_pydantic_model(client: openai.OpenAI) -> None:
    parsed = client.responses.parse(model=MODEL, input="Which animal?", text_format=Verdict, max_output_tokens=40,
                                    temperature=0)  # fmt: skip
    assert isinstance(parsed.output_parsed, Verdict) and parsed.status == "completed"
    assert parsed.text.format.type == "json_schema" and parsed.text.format.strict
    with client.responses.stream(model=MODEL, input="Which animal?", text_format=Verdict, max_output_tokens=40,
                                 temperature=0) as stream:  # fmt: skip
        types = [e.type for e in stream]
        final = stream.get_final_response()
    assert types[-1] == "response.completed"
    assert final.output_parsed == parsed.output_parsed
    # json_object: any JSON object.
    obj = create(client, input="Give JSON.", text={"format": {"type": "json_object"}}, max_output_tokens=40)
    if obj.status == "completed":
        assert isinstance(json.loads(obj.output_text), dict)


@pytest.mark.timeout(300)
def test_a_forced_function_call_and_its_output_sent_back(server: ServerProcess, client: openai.OpenAI) -> None:
    question = [{"role": "user", "content": "Which unit?"}]
    first = create(client, input=question, tools=[UNIT_TOOL], tool_choice={"type": "function", "name": "set_unit"},
                   max_output_tokens=30)  # fmt: skip
    [call] = first.output
    assert call.type == "function_call" and call.name == "set_unit" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_") and first.status == "completed"
    jsonschema.validate(json.loads(call.arguments), UNIT_TOOL["parameters"])
    check_shape(server, first.id)
    # The call and its output sent back as items: the template renders both, the prompt grows.
    follow = [*question, call.model_dump(exclude_none=True),
              {"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"}]  # fmt: skip
    second = create(client, input=follow, tools=[UNIT_TOOL])
    assert second.usage.input_tokens > first.usage.input_tokens + 10
    chat_follow = [*question, {"role": "assistant", "content": None, "tool_calls": [
        {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "18 degrees"}]  # fmt: skip
    reference = client.chat.completions.create(model=MODEL, messages=chat_follow, tools=[
        {"type": "function", "function": {k: v for k, v in UNIT_TOOL.items() if k != "type"}}],
        max_tokens=12, temperature=0)  # fmt: skip
    assert second.usage.input_tokens == reference.usage.prompt_tokens
    # The same through previous_response_id: only the output goes back, the rest is stored.
    third = create(client, previous_response_id=first.id, tools=[UNIT_TOOL],
                   input=[{"type": "function_call_output", "call_id": call.call_id, "output": "18 degrees"}])  # fmt: skip
    assert third.usage.input_tokens == second.usage.input_tokens and third.output_text == second.output_text
    assert third.usage.input_tokens_details.cached_tokens > 0


@pytest.mark.timeout(300)
def test_a_streamed_function_call(client: openai.OpenAI) -> None:
    with client.responses.stream(model=MODEL, input="Which unit?", tools=[UNIT_TOOL], max_output_tokens=30,
                                 tool_choice={"type": "function", "name": "set_unit"}, temperature=0) as stream:  # fmt: skip
        events = list(stream)
        final = stream.get_final_response()
    types = [e.type for e in events]
    assert types[2] == "response.output_item.added" and events[2].item.type == "function_call"
    deltas = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert deltas and len(done) == 1 and "".join(deltas) == done[0].arguments == final.output[0].arguments
    assert types[-1] == "response.completed" and final.output[0].name == "set_unit"


TERSE = "You are terse: answer every question in three words or fewer, and never apologise."


@pytest.mark.timeout(300)
def test_previous_response_id_continues_with_cached_tokens(server: ServerProcess, client: openai.OpenAI) -> None:
    first = create(client, input="Name a colour.", instructions=TERSE)
    second = create(client, input="Another one?", instructions=TERSE, previous_response_id=first.id)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens_details.cached_tokens > 0
    conversation = [
        {"role": "system", "content": TERSE},
        {"role": "user", "content": "Name a colour."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "Another one?"},
    ]
    reference = chat(client, conversation)
    assert second.output_text == reference.choices[0].message.content
    assert second.usage.input_tokens == reference.usage.prompt_tokens
    # Instructions are not carried over: without them the prompt is shorter.
    third = create(client, input="Another one?", previous_response_id=first.id)
    assert third.usage.input_tokens < second.usage.input_tokens
    # store=false: nothing to continue from or retrieve.
    unstored = create(client, input="x", store=False, max_output_tokens=1)
    for call in (lambda: client.responses.retrieve(unstored.id),
                 lambda: create(client, input="y", previous_response_id=unstored.id)):  # fmt: skip
        with pytest.raises(openai.NotFoundError):
            call()


@pytest.mark.timeout(300)
def test_get_delete_and_unknown_ids(server: ServerProcess, client: openai.OpenAI) -> None:
    done = create(client, input="Keep me.", max_output_tokens=2)
    got = client.responses.retrieve(done.id)
    assert got.id == done.id and got.output_text == done.output_text and got.usage == done.usage
    client.responses.delete(done.id)
    for method in ("get", "delete"):
        response = httpx.request(method, f"{server.base_url}/responses/{done.id}", timeout=30)
        assert response.status_code == 404
        assert response.json()["error"]["code"] == "response_not_found" and done.id in response.json()["error"]["message"]
    with pytest.raises(openai.NotFoundError) as info:
        create(client, input="x", previous_response_id="resp_unknown")
    assert info.value.body["param"] == "previous_response_id"


@pytest.mark.timeout(300)
def test_the_store_evicts_the_oldest(client: openai.OpenAI) -> None:
    """The server runs with --responses-store-entries 24."""
    ids = [create(client, input=f"n{i}", max_output_tokens=1).id for i in range(25)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert client.responses.retrieve(ids[-1]).id == ids[-1]


@pytest.mark.timeout(300)
def test_client_errors_are_400s_in_openai_shape(client: openai.OpenAI) -> None:
    broken = "data:image/png;base64," + base64.b64encode(b"\x89PNG not really").decode()
    cases = [
        ({"input": [{"type": "computer_call_output", "call_id": "c"}]}, "input[0]"),
        ({"input": [{"role": "user", "content": [{"type": "input_text", "text": "see"},
                                                 {"type": "input_image", "image_url": broken}]}],
          "instructions": "sys"}, "input[0].content[1]"),
        ({"input": "x", "text": {"format": {"type": "yaml"}}}, "text.format"),
    ]  # fmt: skip
    for body, param in cases:
        with pytest.raises(openai.BadRequestError) as info:
            client.responses.create(model=MODEL, max_output_tokens=4, **body)
        assert info.value.status_code == 400 and info.value.body["param"] == param, info.value.body
        assert info.value.body["type"] == "invalid_request_error" and info.value.body["message"]
    # The server is unharmed: the next request is served.
    assert create(client, input="still there?", max_output_tokens=2).usage.output_tokens == 2


@pytest.mark.timeout(300)
def test_metrics_count_responses(server: ServerProcess, client: openai.OpenAI) -> None:
    def count(api: str) -> float:
        return server.metrics().get(f'vlm_engine:api_requests_total{{api="{api}"}}', 0.0)

    before, chats = count("responses"), count("chat_completions")
    create(client, input="count me", max_output_tokens=2)
    with client.responses.stream(model=MODEL, input="me too", max_output_tokens=2) as stream:
        list(stream)
    assert count("responses") == before + 2 and count("chat_completions") == chats
