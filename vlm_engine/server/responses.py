"""`/v1/responses`: create (whole or streamed), retrieve and delete responses.

A response is served by `ResponseGeneration`, a `Generation` (the chat path: submission, waiting,
disconnects, aborts) that renders Responses bodies instead of chat ones. Its output items are
built by `OutputItems` from the same chat-style deltas the chat stream sends (`{"content": ...}`,
`{"tool_calls": [...]}` from `ToolOutput`), so a whole response and a streamed one are built by
one piece of code and carry the same items.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from vlm_engine import ipc
from vlm_engine.server import openai_bodies as B
from vlm_engine.server import responses_protocol as R
from vlm_engine.server.errors import ApiError
from vlm_engine.server.generation import Generation
from vlm_engine.server.http_common import RouteGuards, ServerState, error_response, sse
from vlm_engine.server.responses_store import ResponseStore


class OutputItems:
    """A response's output items, grown from chat-style deltas; each change comes with the stream
    events that announce it (a whole response drops them)."""

    def __init__(self) -> None:
        self.output: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item still growing (the last one)
        self._pieces: list[str] = []  # its text or arguments so far
        self._logprobs: list[dict[str, Any]] = []

    def add_delta(self, delta: dict[str, Any], logprobs: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
        events: list[dict[str, Any]] = []
        if delta.get("content"):
            events += self.add_text(delta["content"], logprobs or [])
        for call in delta.get("tool_calls") or []:
            fn = call.get("function") or {}
            if call.get("id"):
                events += self.start_call(call["id"], fn.get("name", ""))
            if fn.get("arguments"):
                events += self.add_arguments(fn["arguments"])
        return events

    def add_text(self, text: str, logprobs: list[dict[str, Any]]) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != "message":
            events += self._open_message()
        self._pieces.append(text)
        self._logprobs += logprobs
        events.append({**self._where(), "type": "response.output_text.delta", "content_index": 0, "delta": text,
                       "logprobs": logprobs})  # fmt: skip
        return events

    def _open_message(self) -> list[dict[str, Any]]:
        events = self.close_open()
        events.append(self._added(B.message_item(B.new_item_id("msg"), "in_progress")))
        events.append({**self._where(), "type": "response.content_part.added", "content_index": 0,
                       "part": B.output_text("")})  # fmt: skip
        return events

    def start_call(self, call_id: str, name: str) -> list[dict[str, Any]]:
        events = self.close_open()
        events.append(self._added(B.function_call_item(B.new_item_id("fc"), call_id, name, "", "in_progress")))
        return events

    def add_arguments(self, text: str) -> list[dict[str, Any]]:
        if self._open is None or self._open["type"] != "function_call":
            return []  # arguments without a call header: never sent by ToolOutput
        self._pieces.append(text)
        return [{**self._where(), "type": "response.function_call_arguments.delta", "delta": text}]

    def close_open(self, status: str = "completed") -> list[dict[str, Any]]:
        """Finish the growing item (its `.done` events)."""
        item = self._open
        if item is None:
            return []
        joined = "".join(self._pieces)
        where = self._where()
        item["status"] = status
        if item["type"] == "message":
            part = B.output_text(joined, self._logprobs)
            item["content"] = [part]
            events = [
                {**where, "type": "response.output_text.done", "content_index": 0, "text": joined,
                 "logprobs": self._logprobs},
                {**where, "type": "response.content_part.done", "content_index": 0, "part": part},
            ]  # fmt: skip
        else:
            item["arguments"] = joined
            events = [{**where, "type": "response.function_call_arguments.done", "arguments": joined,
                       "name": item["name"]}]  # fmt: skip
        events.append({"type": "response.output_item.done", "output_index": where["output_index"], "item": item})
        self._open, self._pieces, self._logprobs = None, [], []
        return events

    def finish(self, status: str) -> list[dict[str, Any]]:
        """Close the last item; a response that produced nothing still has its (empty) message."""
        events = self.close_open(status)
        if not self.output:
            events += self._open_message()
            events += self.close_open(status)
        return events

    def conversation_turn(self) -> dict[str, Any]:
        """The output as the chat message a follow-up's conversation holds."""
        text = "".join(p["text"] for item in self.output if item["type"] == "message" for p in item["content"])
        message: dict[str, Any] = {"role": "assistant", "content": text or None}
        calls = [
            {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
            for item in self.output
            if item["type"] == "function_call"
        ]
        if calls:
            message["tool_calls"] = calls
        elif message["content"] is None:
            message["content"] = ""
        return message

    def _added(self, item: dict[str, Any]) -> dict[str, Any]:
        self.output.append(item)
        self._open = item
        return {"type": "response.output_item.added", "output_index": len(self.output) - 1, "item": copy.deepcopy(item)}

    def _where(self) -> dict[str, Any]:
        assert self._open is not None
        return {"item_id": self._open["id"], "output_index": len(self.output) - 1}


class ResponseGeneration(Generation):
    def __init__(
        self, state: ServerState, http: Request, request: R.ResponsesRequest, response_id: str, store: ResponseStore
    ) -> None:
        super().__init__(state, http, request.generate, response_id)
        self.request = request
        self.store = store
        self.items = OutputItems()

    def _error(self, err: ipc.RequestError) -> Response:
        origins = self.request.origins
        return error_response(err.status, origins.message(err.message), err.type, origins.param(err.param), err.code)

    # ---- building the response -------------------------------------------------------------------

    def _feed(self, delta: ipc.Delta) -> list[dict[str, Any]]:
        """Events for one choice delta (a batch of results merged), the closing ones included."""
        tools = self.tools[0]
        choice = self.choices[0]
        if tools is None:
            deltas = [{"content": delta.text}] if delta.text else []
        else:
            deltas = tools.stream(delta.text)
            if delta.finished:
                deltas += tools.finish(choice.finish_reason or "stop")[0]
        # Logprobs follow the text token by token only when no tool call can hold text back.
        logprobs = B.logprob_entries(delta.logprobs) if self.parsed.logprobs and tools is None and delta.logprobs else []
        events = []
        for i, d in enumerate(deltas):
            events += self.items.add_delta(d, logprobs if i == 0 else None)
        if delta.finished:
            events += self.items.finish(self._item_status())
        return events

    def _item_status(self) -> str:
        return "incomplete" if self.choices[0].finish_reason == "length" else "completed"

    def _response(self, status: str, error: dict[str, Any] | None = None) -> dict[str, Any]:
        choice = self.choices[0]
        usage = None
        if status in ("completed", "incomplete"):
            usage = B.response_usage(choice.prompt_tokens, choice.completion_tokens, choice.cached_tokens)
        incomplete = "max_output_tokens" if status == "incomplete" else None
        output = copy.deepcopy(self.items.output) if status == "in_progress" else self.items.output
        return B.response_object(
            self.request_id, self.created, self.model, self.request.echo, status, output, usage, incomplete, error
        )

    def _final(self) -> dict[str, Any]:
        body = self._response(self._item_status())
        if self.request.store:
            turn = self.items.conversation_turn()
            self.store.put(body, [*self.request.messages[self.request.history_start :], turn])
        return body

    def _body(self) -> dict[str, Any]:
        choice, tools = self.choices[0], self.tools[0]
        text, reason = "".join(choice.text), choice.finish_reason or "stop"
        if tools is None:
            if text:
                self.items.add_text(text, B.logprob_entries(choice.logprobs) if self.parsed.logprobs else [])
        else:
            message, _ = tools.message(text, reason)
            self.items.add_delta({"content": message["content"], "tool_calls": message.get("tool_calls")})
        self.items.finish(self._item_status())
        return self._final()

    # ---- streaming -------------------------------------------------------------------------------

    async def _stream(self, first: Any) -> AsyncIterator[bytes]:
        numbers = itertools.count()

        def frames(events: list[dict[str, Any]]) -> bytes:
            return b"".join(sse({**e, "sequence_number": next(numbers)}, e["type"]) for e in events)

        try:
            started = self._response("in_progress")
            yield frames([{"type": "response.created", "response": started},
                          {"type": "response.in_progress", "response": started}])  # fmt: skip
            async for batch in self._batches(first):
                merged, error = self._merge(batch)
                events = [e for delta in merged.values() for e in self._feed(delta)]
                if error is not None:
                    self.abort()
                    events += self.items.close_open("incomplete")
                    failure = {"code": "server_error", "message": self.request.origins.message(error.message)}
                    events.append({"type": "response.failed", "response": self._response("failed", failure)})
                    yield frames(events)
                    return
                if events:
                    yield frames(events)
            final = self._final()
            kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
            yield frames([{"type": kind, "response": final}])
        finally:
            self.abort()  # no-op when finished; a disconnect cancels us mid-stream


def add_responses_routes(app: FastAPI, state: ServerState, guards: RouteGuards) -> ResponseStore:
    """Register the routes; returns the store they share."""
    api = state.config.api
    store = ResponseStore(api.responses_store_entries, api.responses_store_bytes, api.responses_store_ttl_s)
    per_prompt = state.config.engine.media.limit_mm_per_prompt

    def not_found(response_id: str, param: str | None = None) -> ApiError:
        return ApiError(404, f"Response with id '{response_id}' not found.", param=param, code="response_not_found")

    @app.post("/v1/responses")
    async def create_response(request: Request) -> Response:
        guards.auth(request)
        body = await guards.read_json(request)
        guards.serving()
        previous = None
        previous_id = body.get("previous_response_id") if isinstance(body, dict) else None
        if previous_id is not None:
            if not isinstance(previous_id, str):
                raise ApiError(400, "'previous_response_id' must be a string", param="previous_response_id")
            entry = store.get(previous_id)
            if entry is None:
                raise not_found(previous_id, "previous_response_id")
            previous = entry.conversation
        assert state.client.core_info is not None
        parsed = R.parse_responses(
            body,
            state.config.model_name,
            state.client.core_info.max_model_len,
            per_prompt.image,
            per_prompt.video,
            previous,
        )
        guards.room_for(parsed.generate.num_choices)
        return await ResponseGeneration(state, request, parsed, B.new_item_id("resp"), store).respond()

    @app.get("/v1/responses/{response_id}")
    async def get_response(request: Request, response_id: str) -> Response:
        guards.auth(request)
        if request.query_params.get("stream") in ("true", "1"):
            raise ApiError(400, "streaming a stored response again is not supported", param="stream")
        entry = store.get(response_id)
        if entry is None:
            raise not_found(response_id)
        return JSONResponse(entry.body)

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(request: Request, response_id: str) -> Response:
        guards.auth(request)
        if not store.delete(response_id):
            raise not_found(response_id)
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    return store
