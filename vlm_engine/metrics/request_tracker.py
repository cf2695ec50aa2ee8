"""Every engine request's life as the API process sees it, from acceptance to its last token.

Client-visible latencies are measured here, where results reach the API process: TTFT runs from
the API accepting a request to its first generated token arriving; inter-token latency is the gap
between token arrivals, spread over the tokens a result carried (the detokenizer may deliver several
at once); end-to-end runs to the last token. The worker's and the engine core's timestamps (time in
preprocessing, queue, prefill, decode) arrive with the results and complete the record. Per engine
request, so an n=2 request counts twice, as vLLM counts sequences.

A finished record goes to the sinks: the Prometheus metrics and, with --request-log, one JSON line.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Protocol

from vlm_engine import ipc


@dataclass
class RequestRecord:
    engine_id: str
    arrival: float  # time.monotonic() when the API accepted it
    first_token: float | None = None  # when the API received the first token
    last_token: float | None = None
    finished: float | None = None
    completion_tokens: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    finish_reason: str | None = None
    error: ipc.RequestError | None = None
    preprocess: ipc.PreprocessDone | None = None
    timing: ipc.RequestTiming | None = None  # the engine core's timestamps
    media_fetch_s: float | None = None  # downloading the prompt's http(s) media, in the API process
    output_token_ids: list[int] | None = None  # kept only when a sink wants token ids
    api: str = ""  # the OpenAI API that asked: "chat_completions" | "completions" | "responses"

    @property
    def request_id(self) -> str:
        return self.engine_id.rsplit("-", 1)[0]

    @property
    def choice(self) -> int:
        return int(self.engine_id.rsplit("-", 1)[1])


class RecordSink(Protocol):
    def on_first_token(self, ttft_s: float) -> None: ...

    def on_token_gap(self, gap_s: float, times: int) -> None: ...

    def on_preprocessed(self, done: ipc.PreprocessDone) -> None: ...

    def on_finished(self, record: RequestRecord) -> None: ...


@dataclass
class RequestTracker:
    sinks: list[RecordSink] = field(default_factory=list)
    keep_token_ids: bool = False  # the request log wants every output token id
    live: dict[str, RequestRecord] = field(default_factory=dict)

    def start(self, engine_id: str, now: float | None = None, api: str = "") -> None:
        record = RequestRecord(engine_id, time.monotonic() if now is None else now, api=api)
        if self.keep_token_ids:
            record.output_token_ids = []
        self.live[engine_id] = record

    def on_preprocessed(self, done: ipc.PreprocessDone) -> None:
        """A worker finished the prompt behind choices first_index .. first_index + n - 1."""
        for sink in self.sinks:
            sink.on_preprocessed(done)
        for i in range(done.first_index, done.first_index + done.n):
            record = self.live.get(f"{done.request_id}-{i}")
            if record is not None:
                record.preprocess = done

    def on_media_fetched(self, engine_ids: list[str], seconds: float) -> None:
        """A prompt's downloads (one per prompt, so only its first choice carries them)."""
        record = self.live.get(engine_ids[0]) if engine_ids else None
        if record is not None:
            record.media_fetch_s = seconds

    def on_delta(self, delta: ipc.Delta, now: float | None = None) -> None:
        record = self.live.get(delta.request_id)
        if record is None:
            return
        now = time.monotonic() if now is None else now
        new = delta.completion_tokens - record.completion_tokens
        if new > 0:
            if record.first_token is None:
                record.first_token = now
                for sink in self.sinks:
                    sink.on_first_token(now - record.arrival)
                    if new > 1:  # tokens that came with the first one arrived with no gap
                        sink.on_token_gap(0.0, new - 1)
            else:
                for sink in self.sinks:
                    sink.on_token_gap((now - record.last_token) / new, new)  # type: ignore[operator]
            record.last_token, record.completion_tokens = now, delta.completion_tokens
        if record.output_token_ids is not None:
            record.output_token_ids.extend(delta.token_ids)
        record.prompt_tokens, record.cached_tokens = delta.prompt_tokens, delta.cached_tokens
        if delta.finished:
            record.finish_reason = delta.finish_reason
            record.timing = delta.timing
            self._finish(record, now)

    def on_error(self, err: ipc.RequestError, now: float | None = None) -> None:
        record = self.live.get(err.request_id)
        if record is not None:
            record.error = err
            self._finish(record, time.monotonic() if now is None else now)

    def on_abort(self, engine_id: str, now: float | None = None) -> None:
        """The API gave up on it (the client left, a sibling choice failed): finished as "abort"."""
        record = self.live.get(engine_id)
        if record is not None:
            record.finish_reason = "abort"
            self._finish(record, time.monotonic() if now is None else now)

    def _finish(self, record: RequestRecord, now: float) -> None:
        del self.live[record.engine_id]
        record.finished = now
        for sink in self.sinks:
            sink.on_finished(record)

    @property
    def num_live(self) -> int:
        return len(self.live)
