"""The one client: asyncio + httpx SSE streaming, closed loop (fixed concurrency) and open loop (Poisson); what
each timing means: benchmarks/README.md, "Metrics"."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np
from workloads import BenchRequest

from vlm_engine.metrics.scrape import parse_metrics

# ---- SSE ----------------------------------------------------------------------------------------


@dataclass
class SSEEvent:
    done: bool = False  # the `data: [DONE]` sentinel
    data: dict[str, Any] | None = None


def sse_event(line: str) -> SSEEvent | None:
    """The event an SSE line carries: only `data:` fields matter for the OpenAI protocol (comments, other fields
    and blank lines carry none). Servers put one JSON object per data line, so each is an event at once, not at
    the blank line after it: a chunk is timestamped when its bytes arrive."""
    name, _, value = line.rstrip("\r\n").partition(":")
    if name != "data":
        return None
    text = value.removeprefix(" ")
    return SSEEvent(done=True) if text.strip() == "[DONE]" else SSEEvent(data=json.loads(text))


async def sse_lines(response: httpx.Response) -> AsyncIterator[str]:
    """The lines of an SSE body, split where the SSE spec splits them (LF, CRLF, CR) and nowhere
    else. httpx's aiter_lines() also splits at U+2028, U+0085, form feeds and other characters
    str.splitlines() knows, which JSON may carry raw inside a string: a chunk would come apart."""
    buffer = b""
    async for data in response.aiter_bytes():
        buffer += data
        *lines, buffer = buffer.split(b"\n")
        for line in lines:
            yield line.rstrip(b"\r").decode("utf-8", errors="replace")
    if buffer:
        yield buffer.rstrip(b"\r").decode("utf-8", errors="replace")


def chunk_content(chunk: dict[str, Any]) -> str:
    """Text a chat.completion(.chunk) or text_completion chunk adds (content or reasoning)."""
    out = []
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        if delta is not None:
            out.append(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning") or "")
        else:
            out.append(choice.get("text") or "")
    return "".join(out)


# ---- one request --------------------------------------------------------------------------------


@dataclass
class RequestRecord:
    index: int
    media: str
    requested_output_tokens: int
    scheduled_s: float = 0.0  # intended send time, relative to the run's start
    start_s: float = 0.0  # actual send time
    first_token_s: float | None = None
    first_chunk_s: float | None = None  # first chunk with a delta, text or not (llama-server: prompt done)
    end_s: float = 0.0
    chunk_times: list[float] = field(default_factory=list)  # arrival of each content chunk
    output_tokens: int = 0
    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    usage_reported: bool = False
    status: int = 0
    error: str | None = None
    text: str = ""
    finish_reason: str | None = None

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def ttft(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.start_s

    @property
    def e2e(self) -> float:
        return self.end_s - self.start_s

    @property
    def tpot(self) -> float | None:
        if self.ttft is None or self.output_tokens < 2:
            return None
        return (self.e2e - self.ttft) / (self.output_tokens - 1)

    @property
    def decode_itl(self) -> float | None:
        """First to last content chunk over the tokens in between: guidellm's per-request
        inter-token latency (TPOT without the stream's tail)."""
        if len(self.chunk_times) < 2 or self.output_tokens < 2:
            return None
        return (self.chunk_times[-1] - self.chunk_times[0]) / (self.output_tokens - 1)

    @property
    def itls(self) -> list[float]:
        """Per-token gaps. When chunks carry several tokens each, a gap is spread over the tokens
        it delivered (the average tokens per chunk after the first)."""
        if len(self.chunk_times) < 2:
            return []
        gaps = np.diff(np.asarray(self.chunk_times))
        tokens_after_first = max(self.output_tokens - 1, len(gaps))
        per_chunk = tokens_after_first / len(gaps)
        if per_chunk <= 1.0 + 1e-9:
            return gaps.tolist()
        return np.repeat(gaps / per_chunk, round(per_chunk)).tolist()

    @property
    def first_chunk(self) -> float | None:
        """Send -> first chunk of any kind: ours sends it with the first token, llama-server when the
        prompt (image included) is processed, and its json_schema grammar may hold back the first text."""
        return None if self.first_chunk_s is None or not self.ok else self.first_chunk_s - self.start_s

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d.update(ttft=self.ttft, e2e=self.e2e, tpot=self.tpot, decode_itl=self.decode_itl, first_chunk=self.first_chunk)
        return d


async def send_request(
    client: httpx.AsyncClient, url: str, req: BenchRequest, t0: float, timeout_s: float, record: RequestRecord
) -> RequestRecord:
    """Stream one chat completion into `record` (times relative to `t0`); never raises."""
    record.start_s = time.perf_counter() - t0
    try:
        await asyncio.wait_for(_stream(client, url, req, t0, record), timeout_s)
    except TimeoutError:
        record.error = f"timeout after {timeout_s:.0f} s"
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as exc:
        record.error = f"{type(exc).__name__}: {exc}"[:300]
    record.end_s = time.perf_counter() - t0
    if record.error is None and not record.usage_reported:
        record.output_tokens = len(record.chunk_times)
    return record


async def _stream(client: httpx.AsyncClient, url: str, req: BenchRequest, t0: float, record: RequestRecord) -> None:
    async with client.stream("POST", url, json=req.payload) as response:
        record.status = response.status_code
        if response.status_code != 200:
            body = (await response.aread()).decode(errors="replace")
            record.error = f"HTTP {response.status_code}: {body[:300]}"
            return
        async for line in sse_lines(response):
            event = sse_event(line)
            if event is None:
                continue
            if event.done:
                break
            apply_chunk(record, event.data or {}, time.perf_counter() - t0)
            if record.error is not None:
                return


def apply_chunk(record: RequestRecord, chunk: dict[str, Any], now: float) -> None:
    if "error" in chunk:
        err = chunk["error"]
        record.error = f"stream error: {err.get('message') if isinstance(err, dict) else err}"[:300]
        return
    choices = chunk.get("choices") or []
    if choices and record.first_chunk_s is None:
        record.first_chunk_s = now
    for choice in choices:
        record.finish_reason = choice.get("finish_reason") or record.finish_reason
    text = chunk_content(chunk)
    if text:
        if record.first_token_s is None:
            record.first_token_s = now
        record.chunk_times.append(now)
        record.text += text
    usage = chunk.get("usage")
    if usage:
        # With continuous usage stats every chunk carries usage; the last one is the total.
        record.usage_reported = True
        record.output_tokens = int(usage.get("completion_tokens") or 0)
        record.prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        record.cached_tokens = details.get("cached_tokens")


# ---- arrival processes -------------------------------------------------------------------------


def poisson_arrivals(rate: float, n: int, seed: int) -> list[float]:
    """Send times (s from start) of n requests arriving as a Poisson process at `rate` req/s."""
    if rate <= 0:
        raise ValueError("rate must be > 0")
    gaps = np.random.default_rng(seed).exponential(1.0 / rate, n)
    times = np.cumsum(gaps) - gaps[0]  # the first request goes at t = 0
    return times.tolist()


@dataclass(frozen=True)
class LoadPoint:
    """One point of a sweep: closed loop at `concurrency`, or open loop at `rate` req/s."""

    mode: str  # "closed" | "open"
    value: float
    num_requests: int
    max_duration_s: float  # stop issuing new requests after this (in-flight ones finish)
    request_timeout_s: float
    max_inflight: int = 256  # open loop: protect the client when the server falls behind

    @property
    def label(self) -> str:
        return f"c={int(self.value)}" if self.mode == "closed" else f"rate={self.value:g}/s"


def _client(limit: int, timeout_s: float) -> httpx.AsyncClient:
    limits = httpx.Limits(max_connections=limit + 4, max_keepalive_connections=limit + 4)
    return httpx.AsyncClient(limits=limits, timeout=httpx.Timeout(timeout_s, connect=30.0))


async def run_point(
    url: str,
    build: Callable[[int], BenchRequest],
    point: LoadPoint,
    seed: int = 0,
    first_index: int = 0,
) -> tuple[list[RequestRecord], float]:
    """Run one load point; returns the records (in index order) and the wall duration (first send
    to last completion)."""
    if point.mode not in ("closed", "open"):
        raise ValueError(f"unknown mode {point.mode!r}")
    closed = point.mode == "closed"
    limit = max(1, int(point.value)) if closed else point.max_inflight
    async with _client(limit, point.request_timeout_s) as client:
        if closed:
            records = await _closed_loop(client, url, build, point, first_index)
        else:
            records = await _open_loop(client, url, build, point, seed, first_index)
    records.sort(key=lambda r: r.index)
    return records, (max(r.end_s for r in records) - min(r.start_s for r in records)) if records else 0.0


async def _closed_loop(
    client: httpx.AsyncClient, url: str, build: Callable[[int], BenchRequest], point: LoadPoint, first_index: int
) -> list[RequestRecord]:
    records: list[RequestRecord] = []
    next_index = iter(range(first_index, first_index + point.num_requests))
    t0 = time.perf_counter()

    async def worker() -> None:
        for i in next_index:  # shared iterator: each index is taken by exactly one worker
            if time.perf_counter() - t0 > point.max_duration_s:
                return
            req = build(i)
            record = RequestRecord(i, req.media, req.output_tokens, scheduled_s=time.perf_counter() - t0)
            records.append(await send_request(client, url, req, t0, point.request_timeout_s, record))

    await asyncio.gather(*(worker() for _ in range(max(1, int(point.value)))))
    return records


async def _open_loop(client: httpx.AsyncClient, url: str, build: Callable[[int], BenchRequest], point: LoadPoint,
                     seed: int, first_index: int) -> list[RequestRecord]:  # fmt: skip
    arrivals = poisson_arrivals(point.value, point.num_requests, seed)
    # Build payloads (images, base64) before the clock starts: the arrival times must not slip.
    built = [build(first_index + k) for k in range(point.num_requests)]
    records: list[RequestRecord] = []
    inflight = asyncio.Semaphore(point.max_inflight)
    t0 = time.perf_counter()

    async def one(req: BenchRequest, at: float) -> None:
        async with inflight:
            record = RequestRecord(req.index, req.media, req.output_tokens, scheduled_s=at)
            records.append(await send_request(client, url, req, t0, point.request_timeout_s, record))

    tasks = []
    for req, at in zip(built, arrivals):
        if at > point.max_duration_s:
            break
        delay = at - (time.perf_counter() - t0)
        if delay > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(one(req, at)))
    await asyncio.gather(*tasks)
    return records


# ---- server probes -------------------------------------------------------------------------------


async def probe(url: str, req: BenchRequest, timeout_s: float = 300.0) -> RequestRecord:
    """Send one request alone (a warm-up or a probe)."""
    async with _client(1, timeout_s) as client:
        record = RequestRecord(req.index, req.media, req.output_tokens)
        return await send_request(client, url, req, time.perf_counter(), timeout_s, record)


def served_model_id(base_url: str) -> str | None:
    """The first model id from GET /v1/models, or None if the server does not say."""
    try:
        r = httpx.get(base_url.rstrip("/") + "/v1/models", timeout=10.0)
        data = r.json().get("data") or []
        return data[0]["id"] if r.status_code == 200 and data else None
    except (httpx.HTTPError, ValueError, KeyError, IndexError):
        return None


def scrape_metrics(base_url: str) -> dict[str, float]:
    """Prometheus samples from GET /metrics (ours: `vlm_engine:` counters, e.g. per-step times); {} if none."""
    try:
        r = httpx.get(base_url.rstrip("/") + "/metrics", timeout=5.0)
        return parse_metrics(r.text) if r.status_code == 200 else {}
    except (httpx.HTTPError, ValueError):  # ValueError: not the Prometheus text format
        return {}
