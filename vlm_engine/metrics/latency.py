"""Client-visible request latencies, measured where results reach the API process.

TTFT runs from the API accepting a request to its first generated token arriving; inter-token
latency is the gap between token arrivals, spread over the tokens a result carried (the
detokenizer may deliver several at once); end-to-end runs to the last token. Per engine request,
so an n=2 request counts twice, as vLLM counts sequences.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from vlm_engine.metrics.histogram import ITL_BUCKETS, REQUEST_BUCKETS, TTFT_BUCKETS, Histogram


@dataclass
class _Live:
    arrival: float
    last_token: float | None = None
    tokens: int = 0


class RequestLatencies:
    def __init__(self) -> None:
        self.ttft = Histogram.with_bounds(TTFT_BUCKETS)
        self.itl = Histogram.with_bounds(ITL_BUCKETS)
        self.e2e = Histogram.with_bounds(REQUEST_BUCKETS)
        self._live: dict[str, _Live] = {}

    def start(self, engine_id: str, now: float | None = None) -> None:
        self._live[engine_id] = _Live(time.monotonic() if now is None else now)

    def on_result(self, engine_id: str, completion_tokens: int, finished: bool, now: float | None = None) -> None:
        """A result with the request's cumulative `completion_tokens` arrived."""
        live = self._live.get(engine_id)
        if live is None:
            return
        now = time.monotonic() if now is None else now
        new = completion_tokens - live.tokens
        if new > 0:
            if live.last_token is None:
                self.ttft.observe(now - live.arrival)
                if new > 1:  # tokens that came with the first one arrived with no gap
                    self.itl.observe(0.0, new - 1)
            else:
                self.itl.observe((now - live.last_token) / new, new)
            live.last_token, live.tokens = now, completion_tokens
        if finished:
            del self._live[engine_id]
            if live.tokens:
                self.e2e.observe(now - live.arrival)

    def drop(self, engine_id: str) -> None:
        """The request ended without a final result here (aborted, failed)."""
        self._live.pop(engine_id, None)

    @property
    def num_live(self) -> int:
        return len(self._live)
