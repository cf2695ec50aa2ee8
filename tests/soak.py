"""Soak: a server under steady load with clients that give up and clients that send garbage mixed in; `soak()`
reports whether every good request was answered, every bad one got a 4xx, no KV page leaked and RSS and p99 held.
tests/test_resilience.py runs it for two minutes, with benchmarks/ on sys.path (it uses their client and workloads)."""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import httpx
import numpy as np

import client as C
import peers
import workloads as W

# Request kind -> weight. abort_stream reads a few chunks, then closes the connection; abort_early gives up
# before the answer (client timeout).
MIX = {"chat": 4, "chat_stream": 4, "image_chat": 3, "completion": 2, "abort_stream": 2, "abort_early": 1,
       "bad_json": 1, "bad_field": 1, "bad_image": 1}  # fmt: skip
GOOD = {"chat", "chat_stream", "image_chat", "completion"}
BAD = {"bad_json", "bad_field", "bad_image"}
IMAGE_POOL = 12
PAGES = "vlm_engine:kv_pages_used"


@dataclass
class Outcome:
    kind: str
    status: int | None  # HTTP status; None when the client hung up or the request failed in transport
    finished_at: float  # seconds since the soak started
    latency_s: float
    ok: bool  # the outcome this kind must have
    detail: str = ""


@dataclass
class SoakReport:
    duration_s: float
    concurrency: int
    requests: int
    by_kind: dict[str, int]
    good: int
    good_answered: int
    aborted: int
    bad: int
    bad_rejected: int
    unexpected: list[str]  # up to 20 descriptions of outcomes that broke a rule
    pages_baseline: float
    pages_after: float
    rss_baseline_mb: float
    rss_after_mb: float
    rss_growth: float  # after / baseline - 1
    window_s: float
    p99_by_window_ms: list[float] = field(default_factory=list)  # good requests, by completion time
    requests_by_window: list[int] = field(default_factory=list)

    def lines(self) -> list[str]:
        windows = ", ".join(f"{p:.0f}" for p in self.p99_by_window_ms)
        kinds = ", ".join(f"{k} {v}" for k, v in sorted(self.by_kind.items()))
        return [
            f"soak: {self.duration_s:.0f} s at concurrency {self.concurrency}: {self.requests} requests ({kinds})",
            f"good answered {self.good_answered}/{self.good}, aborted by the client {self.aborted}, "
            f"bad rejected with a 4xx {self.bad_rejected}/{self.bad}, unexpected {len(self.unexpected)}",
            f"KV pages in use: {self.pages_baseline:.0f} before, {self.pages_after:.0f} after",
            f"server RSS: {self.rss_baseline_mb:.0f} MB after warm-up, {self.rss_after_mb:.0f} MB at the end "
            f"({self.rss_growth * 100:+.1f}%)",
            f"p99 latency of good requests per {self.window_s:.0f} s window (ms): {windows}",
            *[f"  unexpected: {u}" for u in self.unexpected],
        ]


# ---- requests ---------------------------------------------------------------------------------


def image_pool(n: int, seed: int) -> list[str]:
    """Small JPEG data URIs of random sizes (a fixed pool, so caches reach a steady state)."""
    sizes = np.random.default_rng(seed).integers(32, 160, size=(n, 2))
    return [W.data_uri(W.image_jpeg(seed * 1000 + i, int(w), int(h)), "image/jpeg") for i, (w, h) in enumerate(sizes)]


class RequestMaker:
    def __init__(self, model: str, images: list[str], rng: random.Random) -> None:
        self.model, self.images, self.rng = model, images, rng

    def kind(self) -> str:
        return self.rng.choices(list(MIX), list(MIX.values()))[0]

    def chat(self, stream: bool, image: bool = False) -> dict[str, Any]:
        text = f"Tell me about the number {self.rng.randint(0, 10**6)}."
        content: Any = text
        if image:
            content = [
                {"type": "image_url", "image_url": {"url": self.rng.choice(self.images)}},
                {"type": "text", "text": text},
            ]
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": content}],
            "max_tokens": self.rng.randint(1, 24),
            "temperature": self.rng.choice([0.0, 0.7]),
            "stream": stream,
        }

    def completion(self) -> dict[str, Any]:
        return {"model": self.model, "prompt": f"Once upon a time {self.rng.random()}", "max_tokens": self.rng.randint(1, 16)}

    def bad_field(self) -> dict[str, Any]:
        body = self.chat(stream=False)
        bad = [("max_tokens", "many"), ("temperature", -3), ("n", 10**6), ("messages", {}), ("stop", [1, 2]), ("top_p", "x")]
        name, value = self.rng.choice(bad)
        body[name] = value
        return body

    def bad_image(self) -> dict[str, Any]:
        junk = base64.b64encode(self.rng.randbytes(self.rng.randint(1, 512))).decode()
        body = self.chat(stream=False, image=True)
        body["messages"][0]["content"][0]["image_url"]["url"] = "data:image/png;base64," + junk
        return body


async def one_request(http: httpx.AsyncClient, maker: RequestMaker, t_start: float) -> Outcome:
    kind = maker.kind()
    t0 = time.monotonic()

    def outcome(status: int | None, ok: bool, detail: str = "") -> Outcome:
        now = time.monotonic()
        return Outcome(kind, status, now - t_start, now - t0, ok, detail)

    try:
        if kind in ("chat", "image_chat", "bad_field", "bad_image", "completion"):
            body = {
                "chat": lambda: maker.chat(stream=False),
                "image_chat": lambda: maker.chat(stream=False, image=True),
                "bad_field": maker.bad_field,
                "bad_image": maker.bad_image,
                "completion": maker.completion,
            }[kind]()
            path = "/v1/completions" if kind == "completion" else "/v1/chat/completions"
            resp = await http.post(path, json=body)
            if kind in BAD:
                return outcome(resp.status_code, _is_client_error(resp), resp.text[:200])
            return outcome(resp.status_code, _is_answer(resp), resp.text[:200])
        if kind == "bad_json":
            headers = {"content-type": "application/json"}
            resp = await http.post("/v1/chat/completions", content=b'{"messages": [', headers=headers)
            return outcome(resp.status_code, _is_client_error(resp), resp.text[:200])
        if kind in ("chat_stream", "abort_stream"):
            hang_up_after = maker.rng.randint(1, 3) if kind == "abort_stream" else None
            body = maker.chat(stream=True)
            if hang_up_after is not None:
                body["max_tokens"] = 64  # long enough that hanging up leaves work to cancel
            async with http.stream("POST", "/v1/chat/completions", json=body) as resp:
                events = 0
                done = False
                async for line in C.sse_lines(resp):
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        done = True
                        break
                    if "error" in json.loads(line[6:]):
                        return outcome(resp.status_code, False, line[:200])
                    events += 1
                    if hang_up_after is not None and events >= hang_up_after:
                        return outcome(None, True, "hung up")
                return outcome(resp.status_code, resp.status_code == 200 and done, f"{events} events, done={done}")
        if kind == "abort_early":
            try:
                await http.post("/v1/chat/completions", json=maker.chat(stream=False), timeout=0.05)
            except httpx.TimeoutException:
                return outcome(None, True, "gave up")
            return outcome(200, True, "answered before the client gave up")
        raise AssertionError(kind)
    except (httpx.HTTPError, ValueError) as exc:
        # A transport failure or an unreadable answer, on a request that did not choose to hang
        # up, is a broken rule.
        return outcome(None, False, f"{type(exc).__name__}: {exc}"[:200])


def _is_answer(resp: httpx.Response) -> bool:
    if resp.status_code != 200:
        return False
    choices = resp.json().get("choices") or []
    return bool(choices) and all(c.get("finish_reason") for c in choices)


def _is_client_error(resp: httpx.Response) -> bool:
    if not 400 <= resp.status_code < 500:
        return False
    error = resp.json().get("error")
    return isinstance(error, dict) and isinstance(error.get("message"), str)


# ---- the server's state -------------------------------------------------------------------------


def pages_in_use(base_url: str) -> float:
    return (C.scrape_metrics(base_url) or {})[PAGES]


def wait_pages_settle(base_url: str, baseline: float, timeout_s: float = 30.0) -> float:
    """Pages in use once the last requests drained (aborted ones finish at the core's next step)."""
    deadline = time.monotonic() + timeout_s
    pages = pages_in_use(base_url)
    while pages > baseline and time.monotonic() < deadline:
        time.sleep(0.2)
        pages = pages_in_use(base_url)
    return pages


def tree_rss_mb(pid: int) -> float:
    return peers.TreeSampler(pid).sample() / 2**20


# ---- the soak ---------------------------------------------------------------------------------


async def soak(
    base_url: str,
    server_pid: int,
    duration_s: float,
    concurrency: int = 32,
    seed: int = 0,
    model: str = "m",
    window_s: float = 300.0,
    warmup_s: float | None = None,
) -> SoakReport:
    """`concurrency` closed-loop clients for `duration_s`; RSS is taken after `warmup_s` (default:
    a tenth of the run, at least 10 s) and at the end, both under load."""
    warmup_s = max(10.0, duration_s / 10) if warmup_s is None else warmup_s
    pages_baseline = pages_in_use(base_url)
    maker = RequestMaker(model, image_pool(IMAGE_POOL, seed), random.Random(seed))
    outcomes: list[Outcome] = []
    rss_baseline: float | None = None
    t_start = time.monotonic()
    stop_at = t_start + duration_s
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(base_url=base_url, timeout=120.0, limits=limits) as http:

        async def client() -> None:
            while time.monotonic() < stop_at:
                outcomes.append(await one_request(http, maker, t_start))

        async def sample_rss() -> None:
            nonlocal rss_baseline
            await asyncio.sleep(warmup_s)
            rss_baseline = tree_rss_mb(server_pid)

        sampler = asyncio.ensure_future(sample_rss())
        await asyncio.gather(*(client() for _ in range(concurrency)))
        rss_after = tree_rss_mb(server_pid)
        sampler.cancel()
    pages_after = wait_pages_settle(base_url, pages_baseline)
    rss_baseline = rss_baseline or rss_after
    return _report(outcomes, duration_s, concurrency, pages_baseline, pages_after, rss_baseline, rss_after, window_s)


def _report(outcomes: list[Outcome], duration_s: float, concurrency: int, pages_baseline: float, pages_after: float,
            rss_baseline: float, rss_after: float, window_s: float) -> SoakReport:  # fmt: skip
    good = [o for o in outcomes if o.kind in GOOD]
    bad = [o for o in outcomes if o.kind in BAD]
    unexpected = [f"{o.kind} at {o.finished_at:.1f}s: status {o.status}: {o.detail}" for o in outcomes if not o.ok]
    n_windows = max(1, int(np.ceil(duration_s / window_s)))
    p99s, counts = [], []
    for w in range(n_windows):
        lat = [o.latency_s for o in good if w * window_s <= o.finished_at < (w + 1) * window_s]
        p99s.append(float(np.percentile(lat, 99)) * 1000 if lat else float("nan"))
        counts.append(len(lat))
    aborted = sum(o.kind.startswith("abort") for o in outcomes)
    return SoakReport(duration_s, concurrency, len(outcomes), dict(Counter(o.kind for o in outcomes)), len(good),
                      sum(o.ok for o in good), aborted, len(bad), sum(o.ok for o in bad), unexpected[:20], pages_baseline,
                      pages_after, rss_baseline, rss_after, rss_after / rss_baseline - 1, window_s, p99s, counts)  # fmt: skip
