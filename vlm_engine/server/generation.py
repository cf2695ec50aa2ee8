"""One chat / completions request from submission to its last byte: waiting for results (and
for the client to go away), whole JSON bodies, SSE chunks. The Responses API reuses the waiting
and renders its own bodies (`server/responses.py`)."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
from fastapi import Request
from fastapi.responses import Response, StreamingResponse

from vlm_engine import ipc
from vlm_engine.server import openai_bodies as B
from vlm_engine.server import protocol as P
from vlm_engine.server.engine_client import RequestHandle
from vlm_engine.server.errors import error_body
from vlm_engine.server.http_common import SSE_HEADERS, ServerState, from_engine_error, json_encoder, sse
from vlm_engine.server.tool_parsers import ToolOutput

_DONE = b"data: [DONE]\n\n"

# How often a non-streaming handler checks that its client is still connected (cheap: a
# non-blocking look at the ASGI receive channel).
DISCONNECT_POLL_S = 0.1


@dataclass
class _Choice:
    """What one choice has produced so far."""

    text: list[str] = field(default_factory=list)
    logprobs: list[Any] = field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    text_len: int = 0  # characters already sent (completions' logprob text offsets)
    token_ids: list[int] = field(default_factory=list)

    def add(self, delta: ipc.Delta) -> None:
        if delta.text:
            self.text.append(delta.text)
        self.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            self.logprobs.extend(delta.logprobs)
        if delta.finished:
            self.finish_reason = delta.finish_reason
        self.prompt_tokens = delta.prompt_tokens
        self.cached_tokens = delta.cached_tokens
        self.completion_tokens = delta.completion_tokens


def _usage(choices: list[_Choice], n: int) -> dict[str, Any]:
    # Every prompt is counted once, however many choices it has (as the OpenAI API does).
    firsts = choices[::n]
    return B.usage(
        sum(c.prompt_tokens for c in firsts),
        sum(c.completion_tokens for c in choices),
        sum(c.cached_tokens for c in firsts),
    )


class Generation:
    """Serves one chat / completions request from submission to the last byte."""

    def __init__(self, state: ServerState, request: Request, parsed: P.GenerateRequest, request_id: str) -> None:
        self.state = state
        self.http = request
        self.parsed = parsed
        self.request_id = request_id
        self.created = B.now()
        self.model = parsed.model
        self.choices = [_Choice() for _ in range(parsed.num_choices)]
        with_tools = parsed.kind == "chat" and parsed.tool_choice.mode != "none"
        self.tools = [ToolOutput(parsed.tool_choice, state.config.api.tool_call_parser) if with_tools else None for _ in self.choices]
        self.handle: RequestHandle = state.client.submit(request_id, parsed)
        self.unfinished = set(self.handle.engine_ids)
        self._next_disconnect_check = 0.0  # time.monotonic() of the next connection check

    def abort(self) -> None:
        if self.unfinished:
            self.state.client.abort(list(self.unfinished))
            self.unfinished.clear()

    async def respond(self) -> Response:
        try:
            first = await self._next_or_disconnect()
            if first is None:
                self.abort()
                return Response(status_code=499)
            if isinstance(first, ipc.RequestError):
                self.abort()
                return self._error(first)
            if self.parsed.stream:
                body = self._stream(first)
                return StreamingResponse(body, media_type="text/event-stream", headers=SSE_HEADERS)
            return await self._collect(first)
        except BaseException:
            self.abort()
            raise

    def _error(self, err: ipc.RequestError) -> Response:
        """The HTTP answer to an error that ends the request before its body was sent."""
        return from_engine_error(err)

    async def _next_or_disconnect(self) -> Any | None:
        """The next result, or None once the client has disconnected. The connection is checked
        at least every DISCONNECT_POLL_S, also while results keep arriving: a non-streaming client
        that gives up mid-generation must not keep its request decoding to max_tokens."""
        queue = self.handle.queue
        if time.monotonic() >= self._next_disconnect_check and await self._client_gone():
            return None
        if not queue.empty():
            return queue.get_nowait()
        getter = asyncio.ensure_future(queue.get())
        try:
            while True:
                done, _ = await asyncio.wait({getter}, timeout=DISCONNECT_POLL_S)
                if done:
                    return getter.result()
                if await self._client_gone():
                    return None
        finally:
            if not getter.done():
                getter.cancel()

    async def _client_gone(self) -> bool:
        self._next_disconnect_check = time.monotonic() + DISCONNECT_POLL_S
        return await self.http.is_disconnected()

    def _apply(self, item: Any) -> ipc.RequestError | None:
        """Record a result; returns an error that ends the whole request, if it is one."""
        if isinstance(item, ipc.RequestError):
            self.unfinished.discard(item.request_id)
            return item
        self.choices[self.handle.index_of(item.request_id)].add(item)
        if item.finished:
            self.unfinished.discard(item.request_id)
            if item.finish_reason == "abort":
                return ipc.RequestError(item.request_id, 503, "the request was aborted", "server_error")
        return None

    # ---- non-streaming -------------------------------------------------------------------------

    async def _collect(self, first: Any) -> Response:
        queue = self.handle.queue
        item = first
        while True:
            error = self._apply(item)
            while error is None and not queue.empty():  # everything already here, without awaiting
                error = self._apply(queue.get_nowait())
            if error is not None:
                self.abort()
                return self._error(error)
            if not self.unfinished:
                break
            item = await self._next_or_disconnect()
            if item is None:
                self.abort()
                return Response(status_code=499)
        return Response(json_encoder.encode(self._body()), media_type="application/json")

    def _body(self) -> dict[str, Any]:
        """The whole response, once every choice has finished."""
        usage = _usage(self.choices, self.parsed.n)
        if self.parsed.kind == "chat":
            choices = []
            for i, c in enumerate(self.choices):
                text, reason, message = "".join(c.text), c.finish_reason or "stop", None
                tools = self.tools[i]
                if tools is not None:
                    message, reason = tools.message(text, reason)
                logprobs = B.chat_logprobs(c.logprobs) if self.parsed.logprobs else None
                choices.append(B.chat_choice(i, text, reason, logprobs, message))
                if self.parsed.return_token_ids:
                    choices[-1]["token_ids"] = c.token_ids
            body = B.chat_completion(self.request_id, self.created, self.model, choices, usage)
            if self.parsed.return_token_ids:
                body["prompt_token_ids"] = self.handle.prompt_token_ids.get(0)
        else:
            choices = [
                B.completion_choice(
                    i,
                    "".join(c.text),
                    c.finish_reason or "stop",
                    B.completion_logprobs(c.logprobs, 0) if self.parsed.logprobs else None,
                )
                for i, c in enumerate(self.choices)
            ]
            if self.parsed.return_token_ids:
                for i, (choice, c) in enumerate(zip(choices, self.choices)):
                    choice["prompt_token_ids"] = self.handle.prompt_token_ids.get(i)
                    choice["token_ids"] = c.token_ids
            body = B.completion(self.request_id, self.created, self.model, choices, usage)
        return body

    # ---- streaming -----------------------------------------------------------------------------

    async def _batches(self, first: Any) -> AsyncIterator[list[Any]]:
        """Results in batches: everything already queued is handled in one go (fewer, larger writes)."""
        queue = self.handle.queue
        batch = [first]
        while True:
            while not queue.empty():
                batch.append(queue.get_nowait())
            yield batch
            if not self.unfinished:
                return
            batch = [await queue.get()]

    def _merge(self, batch: list[Any]) -> tuple[dict[int, ipc.Delta], ipc.RequestError | None]:
        """Per choice, one delta for the whole batch."""
        merged: dict[int, ipc.Delta] = {}
        for item in batch:
            error = self._apply(item)
            if error is not None:
                return merged, error
            index = self.handle.index_of(item.request_id)
            prev = merged.get(index)
            if prev is None:
                merged[index] = msgspec.structs.replace(
                    item, logprobs=list(item.logprobs) if item.logprobs else None, token_ids=list(item.token_ids)
                )
            else:
                prev.text += item.text
                prev.token_ids += item.token_ids
                if item.logprobs:
                    prev.logprobs = (prev.logprobs or []) + item.logprobs
                prev.finished, prev.finish_reason = item.finished, item.finish_reason
        return merged, None

    def _usage_now(self) -> dict[str, Any]:
        return _usage(self.choices, self.parsed.n)

    async def _stream(self, first: Any) -> AsyncIterator[bytes]:
        """SSE for both endpoints; only the chunk bodies differ (see `_delta_chunk`/`_usage_chunk`)."""
        p = self.parsed
        with_usage = p.include_usage or p.continuous_usage
        try:
            if p.kind == "chat":
                role = {"role": "assistant", "content": "", "refusal": None}
                chunks = [
                    B.chat_chunk(self.request_id, self.created, self.model, [B.chat_chunk_choice(i, role)], None, with_usage)
                    for i in range(p.num_choices)
                ]
                if p.return_token_ids:  # as vLLM: the prompt's ids ride on the first chunk
                    chunks[0]["prompt_token_ids"] = self.handle.prompt_token_ids.get(0)
                yield b"".join(sse(chunk) for chunk in chunks)
            async for batch in self._batches(first):
                merged, error = self._merge(batch)
                # Skip deltas with nothing to show yet (text held back: partial stop string / UTF-8).
                out = [
                    sse(chunk)
                    for index, d in merged.items()
                    if d.text or d.finished or d.logprobs or (p.return_token_ids and d.token_ids)
                    for chunk in self._delta_chunks(index, d, with_usage)
                ]
                if error is not None:
                    self.abort()
                    out.append(sse(error_body(error.message, error.type, error.param, error.code)))
                    out.append(_DONE)
                    yield b"".join(out)
                    return
                if out:
                    yield b"".join(out)
            if with_usage:
                yield sse(self._usage_chunk())
            yield _DONE
        finally:
            self.abort()  # no-op when finished; a disconnect cancels us mid-stream

    def _delta_chunks(self, index: int, d: Any, with_usage: bool) -> list[dict[str, Any]]:
        p = self.parsed
        finish = d.finish_reason if d.finished else None
        usage = self._usage_now() if p.continuous_usage else None
        if p.kind == "chat":
            tools = self.tools[index]
            if tools is None:
                deltas = [{"content": d.text} if d.text else {}]
            else:
                deltas = tools.stream(d.text)
                if d.finished:
                    closing, finish = tools.finish(finish or "stop")
                    deltas += closing
                if not deltas and not d.finished and not (p.logprobs and d.logprobs):
                    return []  # text held back while a tool call is collected
                deltas = deltas or [{}]
            logprobs = B.chat_logprobs(d.logprobs) if p.logprobs and d.logprobs else None
            last = len(deltas) - 1
            choices = [
                B.chat_chunk_choice(index, delta, finish if k == last else None, logprobs if k == 0 else None)
                for k, delta in enumerate(deltas)
            ]
            if p.return_token_ids:
                choices[0]["token_ids"] = d.token_ids
            return [B.chat_chunk(self.request_id, self.created, self.model, [c], usage, with_usage) for c in choices]
        chunk = self._completion_chunk(index, d, finish, usage, with_usage)
        if p.return_token_ids:
            chunk["choices"][0]["token_ids"] = d.token_ids
        return [chunk]

    def _completion_chunk(self, index: int, d: Any, finish: str | None, usage: Any, with_usage: bool) -> dict[str, Any]:
        p = self.parsed
        offset = self.choices[index].text_len
        logprobs = B.completion_logprobs(d.logprobs, offset) if p.logprobs and d.logprobs else None
        self.choices[index].text_len = offset + len(d.text)
        choice = B.completion_choice(index, d.text, finish, logprobs)
        return B.completion(self.request_id, self.created, self.model, [choice], usage, with_usage)

    def _usage_chunk(self) -> dict[str, Any]:
        if self.parsed.kind == "chat":
            return B.chat_chunk(self.request_id, self.created, self.model, [], self._usage_now(), True)
        return B.completion(self.request_id, self.created, self.model, [], self._usage_now(), True)
