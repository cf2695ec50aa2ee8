"""Where batch requests run: the in-process `Engine` (fed as a stream, so the scheduler always has
a full batch) or one or more OpenAI-compatible servers (work to the server with the fewest
requests outstanding; a server that fails is rested and its work retried elsewhere); engines in
Ray actors are a third (`ray_data.py`).

All take jobs (an item and its chat request body) and report one `Outcome` per attempt; whether
to try again is the caller's decision (`vlm_engine.batch.run`)."""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from vlm_engine.batch.inputs import WorkItem
from vlm_engine.batch.media import PDF_LONGEST_SIDE, request_body


@dataclass(frozen=True)
class BodyOptions:
    """All that shapes an item's request body besides the item: plain values, so a Ray worker
    builds byte for byte the body the local CLI builds (`ray_data.py`)."""

    model: str
    max_tokens: int = 512
    temperature: float = 0.0
    fps: float | None = None
    max_frames: int | None = None
    pdf_longest_side: int = PDF_LONGEST_SIDE
    extra_body: dict[str, Any] = field(default_factory=dict)  # merged into every media request

    def body(self, item: WorkItem) -> dict[str, Any]:
        o = self
        body = request_body(item, o.model, o.max_tokens, o.temperature, o.fps, o.max_frames, o.pdf_longest_side)
        return body if item.kind == "openai" else {**body, **o.extra_body}


@dataclass
class Job:
    item: WorkItem
    build: Callable[[Job], dict[str, Any]]  # the chat request body, built when first sent (files read then)
    attempts: int = 0
    temperature: float | None = None  # set by a retry that raises it
    started: float = field(default_factory=time.monotonic)
    _body: dict[str, Any] | None = None

    def body(self) -> dict[str, Any]:
        if self._body is None:
            self._body = self.build(self)
        if self.temperature is not None:
            return {**self._body, "temperature": self.temperature}
        return self._body


@dataclass
class Outcome:
    job: Job
    response: dict[str, Any] | None = None  # an OpenAI chat.completion body
    error: str | None = None
    status: int = 200
    transient: bool = False  # worth retrying (server down, 5xx, timeout), unlike a bad input
    server: str | None = None


Report = Callable[[Outcome], None]


class Backend(Protocol):
    """What `run.py` drives: jobs in, one `Outcome` per attempt out through `report`."""

    report: Report
    model_name: str

    def submit(self, job: Job, avoid: str | None = None) -> None: ...

    def run(self, more_expected: Callable[[], bool]) -> None: ...

    def close(self) -> None: ...


class EngineBackend:
    """The in-process engine. Request bodies are validated exactly as the server validates them
    (`protocol.parse_chat`) and preprocessed on a background thread, ahead of the step loop."""

    report: Report

    def __init__(self, model: str, concurrency: int, dtype: str = "auto", **engine_kwargs: Any) -> None:
        from vlm_engine import Engine

        self.engine = Engine(model, dtype=dtype, max_num_seqs=max(1, concurrency), **engine_kwargs)
        self.model_name = self.engine.source.name
        self.concurrency = concurrency
        self._inbox: queue.Queue[Job] = queue.Queue()
        self._prepared: deque[Future[Any]] = deque()
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="batch-prep")

    def submit(self, job: Job, avoid: str | None = None) -> None:
        """`avoid` (a server to keep away from) means nothing here: there is one engine."""
        self._inbox.put(job)

    def _prepare(self, job: Job) -> tuple[Job, Any, Any]:
        """(job, prompt, sampling), or raises with the client-facing reason."""
        from vlm_engine.server import protocol as P

        engine = self.engine
        # One model in process: a batch file naming another model (e.g. written for OpenAI) runs on it.
        body = {**job.body(), "model": self.model_name}
        parsed = P.parse_chat(body, self.model_name, 1, engine.max_model_len, 64, 16)
        prompt = engine.process_messages(
            parsed.prompts[0], tools=parsed.tools, mm_processor_kwargs=parsed.mm_processor_kwargs
        )
        return job, prompt, parsed.sampling

    def run(self, more_expected: Callable[[], bool]) -> None:
        """Steps until no job is left and `more_expected()` says none will come; every attempt
        goes to `self.report` (set by the caller before submitting)."""
        from vlm_engine.server import openai_bodies as B

        engine = self.engine
        report = self.report
        running: dict[str, tuple[Job, Any]] = {}
        while True:
            self._fill_prepared()
            # Admit prepared jobs while there is room; block for one only when nothing runs.
            while self._prepared and len(running) < self.concurrency:
                if not self._prepared[0].done() and running:
                    break
                future = self._prepared.popleft()
                try:
                    job, prompt, sampling = future.result()
                except Exception as exc:  # noqa: BLE001 - every failure of one input is its row
                    job = future.job  # type: ignore[attr-defined]
                    report(Outcome(job, error=failure_reason(exc), status=getattr(exc, "status", 400)))
                    continue
                try:
                    request_id = engine.add_request(prompt, sampling)
                except ValueError as exc:  # RequestRejected, StructuredOutputError: the input's fault
                    report(Outcome(job, error=failure_reason(exc), status=400))
                    continue
                running[request_id] = (job, prompt)
            if running:
                for out in engine.step():
                    if not out.finished:
                        continue
                    job, prompt = running.pop(out.request_id)
                    choice = B.chat_choice(0, out.text, out.finish_reason, None)
                    usage = B.usage(out.prompt_tokens, len(out.token_ids), out.cached_tokens)
                    response = B.chat_completion(
                        f"chatcmpl-{out.request_id}", B.now(), self.model_name, [choice], usage
                    )
                    report(Outcome(job, response=response))
                continue
            if not self._prepared and self._inbox.empty() and not more_expected():
                return
            if not self._prepared:
                try:
                    job = self._inbox.get(timeout=0.05)
                except queue.Empty:
                    continue
                self._prepare_later(job)

    def _fill_prepared(self) -> None:
        # Keep two batches' worth preprocessed ahead so the step loop never waits on decoding.
        while len(self._prepared) < 2 * self.concurrency:
            try:
                job = self._inbox.get_nowait()
            except queue.Empty:
                return
            self._prepare_later(job)

    def _prepare_later(self, job: Job) -> None:
        future = self._pool.submit(self._prepare, job)
        future.job = job  # type: ignore[attr-defined] - read back when preparing failed
        self._prepared.append(future)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class ServerBackend:
    """Several OpenAI-compatible servers; `concurrency` requests in flight over all of them."""

    report: Report

    REST_S = 5.0  # a server that failed gets no new work for this long

    def __init__(self, urls: list[str], concurrency: int, api_key: str | None = None, timeout_s: float = 600.0) -> None:
        import httpx

        self.urls = [u.rstrip("/").removesuffix("/v1") for u in urls]
        self.outstanding = dict.fromkeys(self.urls, 0)
        self.sent = dict.fromkeys(self.urls, 0)
        self.resting_until = dict.fromkeys(self.urls, 0.0)
        self._lock = threading.Lock()
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.client = httpx.Client(
            timeout=timeout_s, headers=headers, limits=httpx.Limits(max_connections=concurrency + 4)
        )
        self.pool = ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="batch-http")
        self._pending = 0
        self._done = threading.Condition()
        self.model_name = self._model()

    def _model(self) -> str:
        problems = []
        for url in self.urls:
            try:
                return self.client.get(url + "/v1/models", timeout=10).json()["data"][0]["id"]
            except Exception as exc:  # noqa: BLE001 - try the next server
                problems.append(f"{url}: {exc}")
        raise RuntimeError(f"none of the servers answered /v1/models: {'; '.join(problems)}")

    def _pick(self, avoid: str | None) -> str:
        with self._lock:
            now = time.monotonic()
            ready = (
                [u for u in self.urls if self.resting_until[u] <= now and u != avoid]
                or [u for u in self.urls if u != avoid]
                or self.urls
            )
            url = min(ready, key=lambda u: self.outstanding[u])
            self.outstanding[url] += 1
            self.sent[url] += 1
            return url

    def submit(self, job: Job, avoid: str | None = None) -> None:
        with self._done:
            self._pending += 1
        self.pool.submit(self._send, job, avoid)

    def _send(self, job: Job, avoid: str | None) -> None:
        import httpx

        try:
            body = job.body()
        except Exception as exc:  # noqa: BLE001 - an unreadable file is that input's error row
            self._finish(Outcome(job, error=failure_reason(exc), status=400))
            return
        url = self._pick(avoid)
        outcome: Outcome
        try:
            response = self.client.post(url + "/v1/chat/completions", json=body)
            if response.status_code == 200:
                outcome = Outcome(job, response=response.json(), server=url)
            else:
                try:
                    message = response.json()["error"]["message"]
                except Exception:  # noqa: BLE001 - not an OpenAI error body
                    message = response.text[:200]
                transient = response.status_code == 429 or response.status_code >= 500
                outcome = Outcome(job, error=message, status=response.status_code, transient=transient, server=url)
        except httpx.HTTPError as exc:
            with self._lock:
                self.resting_until[url] = time.monotonic() + self.REST_S
            outcome = Outcome(job, error=f"{url}: {type(exc).__name__}: {exc}", status=0, transient=True, server=url)
        finally:
            with self._lock:
                self.outstanding[url] -= 1
        self._finish(outcome)

    def _finish(self, outcome: Outcome) -> None:
        try:
            self.report(outcome)
        finally:
            with self._done:
                self._pending -= 1
                self._done.notify_all()

    def run(self, more_expected: Callable[[], bool]) -> None:
        with self._done:
            while self._pending or more_expected():
                self._done.wait(timeout=0.1)

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        self.client.close()


def failure_reason(exc: BaseException) -> str:
    return getattr(exc, "message", None) or str(exc) or type(exc).__name__
