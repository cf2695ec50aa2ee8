"""`vlm-engine batch`: inputs -> work items -> a backend -> one JSON row per input, resumably.

Retries: transient failures (a server down, 5xx, 429, timeouts) go again, with backoff, to
another server where there is one; with `--schema`, an answer that does not parse and validate
goes again with a higher temperature (olmOCR's rule; with constrained decoding it takes running
out of `max_tokens` to get there). A bad input (an unreadable file, a 4xx) is an error row at once.
The backend is the in-process engine, servers, or engines in Ray actors (`--ray`); this logic, the
rows and resuming are the same for all three.
"""

from __future__ import annotations

import argparse
import json
import sys
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from vlm_engine.batch.backends import Backend, BodyOptions, EngineBackend, Job, Outcome, ServerBackend
from vlm_engine.batch.inputs import WorkItem, expand_inputs
from vlm_engine.batch.media import PDF_LONGEST_SIDE
from vlm_engine.batch.rows import RowWriter
from vlm_engine.config import DTYPES, Section, above, at_least, comma_list, doc

RETRY_BACKOFF_S = (0.5, 1.0, 2.0, 4.0, 8.0)


def _json_file(path: str) -> Any:
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except OSError as exc:  # a usage error of the flag, with its reason
        raise argparse.ArgumentTypeError(f"cannot read {path}: {exc.strerror}") from None


@dataclass(frozen=True)
class BatchOptions(Section):
    """`vlm-engine batch`'s options: its flags are generated from these fields (vlm_engine.cli), as
    `serve`'s are from the server's config; the Python API builds it directly."""

    inputs: list[str] = field(
        metadata=doc("files, folders (recursive), globs, a JSONL manifest or an OpenAI batch file", flag="inputs")
    )
    out: str = field(metadata=doc("JSONL output; rerunning with the same file resumes", metavar="PATH"))
    prompt: str | None = field(default=None, metadata=doc("what to ask about each input", metavar="TEXT"))
    schema: dict[str, Any] | None = field(
        default=None,
        metadata=doc(
            "a JSON Schema file: answers are constrained to it and parsed", parse=_json_file, metavar="FILE"
        ),
    )
    model: str | None = field(
        default=None, metadata=doc("in-process model (default: the embedded default)", metavar="MODEL")
    )
    servers: list[str] = field(
        default_factory=list,
        metadata=doc("an OpenAI-compatible server URL (repeatable)", flag="--server", repeat=True, metavar="URL"),
    )
    api_key: str | None = field(default=None, metadata=doc("the servers' API key", metavar="KEY"))
    concurrency: int = field(
        default=16, metadata=doc("requests in flight (in process: the engine's batch)", check=at_least(1))
    )
    fps: float | None = field(default=None, metadata=doc("video frames sampled per second", check=above(0)))
    max_frames: int | None = field(default=None, metadata=doc("most frames per video", check=at_least(1)))
    pdf_pages: str = field(default="each", metadata=doc("a row per page or per PDF", choices=("each", "document")))
    pdf_longest_side: int = field(
        default=PDF_LONGEST_SIDE, metadata=doc("pixels of a rendered page's longest side", check=at_least(1))
    )
    retries: int = field(default=2, metadata=doc("retries for transient errors and unparsable answers"))
    limit: int | None = field(default=None, metadata=doc("only the first N inputs", check=at_least(1)))
    max_tokens: int = field(default=512, metadata=doc("most tokens of each answer", check=at_least(1)))
    temperature: float = field(
        default=0.0, metadata=doc("sampling temperature (a retry of an unparsable answer raises it)")
    )
    dtype: str = field(default="auto", metadata=doc("in-process model: weights and activations", choices=DTYPES))
    progress: bool = field(default=True, metadata=doc("a progress bar on stderr"))
    extra_body: dict[str, Any] = field(
        default_factory=dict,
        metadata=doc("JSON merged into every request body, e.g. '{\"top_p\": 0.9}'", parse=json.loads, metavar="JSON"),
    )
    # Servers apply their own media rules; these are the in-process model's (its MediaConfig).
    allow_private_media_urls: bool = field(
        default=False,
        metadata=doc(
            "in-process model: media URLs may reach loopback, private and link-local addresses (an intranet)"
        ),
    )
    allowed_media_domains: tuple[str, ...] | None = field(
        default=None,
        metadata=doc("in-process model: fetch media only from these hosts", parse=comma_list, metavar="HOSTS"),
    )
    # Each Ray actor holds one in-process engine with `concurrency` requests in its scheduler.
    ray: str | None = field(
        default=None,
        metadata=doc(
            'run on a Ray cluster over Ray Data: its address, "auto", or "local" to start one here (pip install '
            "vlm-engine[ray]); rows and resuming are as without it",
            metavar="ADDRESS",
        ),
    )
    ray_actors: int = field(default=1, metadata=doc("with --ray: engine actors (each one model)", check=at_least(1)))
    ray_actor_cpus: float = field(default=1.0, metadata=doc("with --ray: CPUs each actor reserves", check=above(0)))

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ray is not None and self.servers:
            raise ValueError("--ray runs the model in Ray actors; it does not go with --server")


@dataclass
class Summary:
    inputs: int = 0
    skipped: int = 0  # already in --out
    rows: int = 0
    errors: int = 0
    retries: int = 0
    completion_tokens: int = 0
    elapsed_s: float = 0.0
    per_server: dict[str, int] = field(default_factory=dict)  # rows (attempts) per server or Ray actor

    def line(self) -> str:
        rate = self.rows / self.elapsed_s if self.elapsed_s else 0.0
        tokens = self.completion_tokens / self.elapsed_s if self.elapsed_s else 0.0
        return (
            f"{self.rows} rows ({self.errors} errors, {self.retries} retries) in {self.elapsed_s:.1f} s: "
            f"{rate:.2f} items/s, {tokens:.1f} tokens/s; {self.skipped} of {self.inputs} inputs were already done"
        )


def _validator(schema: dict[str, Any]) -> Any:
    import jsonschema

    return jsonschema.Draft202012Validator(schema, format_checker=jsonschema.FormatChecker())


def _parse_answer(item: WorkItem, text: str) -> tuple[Any, str | None]:
    """(the parsed row object, why it is not acceptable or None)."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"the answer is not JSON: {exc}"
    if item.schema is not None:
        errors = sorted(_validator(item.schema).iter_errors(value), key=lambda e: list(e.path))
        if errors:
            return value, f"the answer does not match the schema: {errors[0].message}"
    return value, None


class BatchRun:
    def __init__(self, options: BatchOptions, backend: Backend | None = None) -> None:
        self.o = options
        self._given_backend = backend  # built by the caller (e.g. to time the run without the model load)
        self.summary = Summary()
        self._lock = threading.Lock()
        self._waiting_retries = 0

    def _backend(self) -> Backend:
        if self.o.servers:
            return ServerBackend(self.o.servers, self.o.concurrency, self.o.api_key)
        from vlm_engine.config import DEFAULT_MODEL

        model = self.o.model or DEFAULT_MODEL
        engine_kwargs = {
            "allow_private_media_urls": self.o.allow_private_media_urls,
            "allowed_media_domains": self.o.allowed_media_domains,
        }
        if self.o.ray is not None:
            # Imported only here: Ray is an optional extra, and the CLI without --ray never loads it.
            from vlm_engine.batch.ray_data import RayBackend

            return RayBackend(
                self.o.ray,
                self._body_options(model),
                actors=self.o.ray_actors,
                actor_cpus=self.o.ray_actor_cpus,
                concurrency=self.o.concurrency,
                dtype=self.o.dtype,
                engine_kwargs=engine_kwargs,
            )
        return EngineBackend(model, self.o.concurrency, dtype=self.o.dtype, **engine_kwargs)

    def run(self) -> Summary:
        start = self._start = time.monotonic()
        items = expand_inputs(self.o.inputs, self.o.prompt, self.o.schema, self.o.pdf_pages)
        if self.o.limit is not None:
            items = items[: self.o.limit]
        self.writer = RowWriter(self.o.out)
        todo = [item for item in items if not self.writer.is_done(item)]
        self.summary.inputs, self.summary.skipped = len(items), len(items) - len(todo)
        if self.writer.repaired_bytes:
            print(f"cut a torn last line ({self.writer.repaired_bytes} bytes) from {self.o.out}", file=sys.stderr)
        self.bar = self._progress(len(todo))
        self.backend = self._given_backend or (self._backend() if todo else None)
        try:
            if self.backend is not None:
                self.backend.report = self._report
                for item in todo:
                    job = Job(item, self._build)
                    if item.error is not None:
                        self._report(Outcome(job, error=item.error, status=400))
                    else:
                        self.backend.submit(job)
                self.backend.run(lambda: self._waiting_retries > 0)
        finally:
            if self.backend is not None:
                self.backend.close()
                self.summary.per_server = dict(getattr(self.backend, "sent", {}))
            self.writer.close()
            if self.bar is not None:
                self.bar.close()
        self.summary.elapsed_s = time.monotonic() - start
        return self.summary

    def _progress(self, total: int) -> Any:
        if not self.o.progress:
            return None
        from tqdm import tqdm

        return tqdm(total=total, unit="item", dynamic_ncols=True, file=sys.stderr)

    def _body_options(self, model: str) -> BodyOptions:
        o = self.o
        return BodyOptions(model, o.max_tokens, o.temperature, o.fps, o.max_frames, o.pdf_longest_side, o.extra_body)

    def _build(self, job: Job) -> dict[str, Any]:
        model = self.backend.model_name if self.backend is not None else (self.o.model or "")
        return self._body_options(model).body(job.item)

    # ---- one attempt's outcome ------------------------------------------------------------------

    def _report(self, outcome: Outcome) -> None:
        job = outcome.job
        job.attempts += 1
        can_retry = job.attempts <= self.o.retries
        if outcome.error is not None and outcome.transient and can_retry:
            self._retry(job, RETRY_BACKOFF_S[min(job.attempts - 1, len(RETRY_BACKOFF_S) - 1)], outcome.server)
            return
        parsed, problem = None, None
        if outcome.response is not None and job.item.kind != "openai" and job.item.schema is not None:
            parsed, problem = _parse_answer(job.item, _content(outcome.response))
            if problem is not None and can_retry:
                job.temperature = min(1.0, self.o.temperature + 0.3 * job.attempts)
                self._retry(job, 0.0, None)
                return
        row = self._row(outcome, parsed, problem)
        with self._lock:
            self.writer.write(row)
            self.summary.rows += 1
            failed = outcome.error is not None or problem is not None
            self.summary.errors += int(failed)
            usage = (outcome.response or {}).get("usage") or {}
            self.summary.completion_tokens += int(usage.get("completion_tokens", 0))
            if self.bar is not None:
                elapsed = max(1e-9, time.monotonic() - self._start)
                self.bar.set_postfix(
                    errors=self.summary.errors, tok_s=f"{self.summary.completion_tokens / elapsed:.0f}"
                )
                self.bar.update(1)

    def _retry(self, job: Job, delay_s: float, avoid: str | None) -> None:
        with self._lock:
            self.summary.retries += 1
            self._waiting_retries += 1

        def again() -> None:
            try:
                self.backend.submit(job, avoid=avoid)
            finally:
                with self._lock:
                    self._waiting_retries -= 1

        if delay_s <= 0:
            again()
        else:
            timer = threading.Timer(delay_s, again)
            timer.daemon = True
            timer.start()

    def _row(self, outcome: Outcome, parsed: Any, problem: str | None) -> dict[str, Any]:
        job, item = outcome.job, outcome.job.item
        if item.kind == "openai":
            return _openai_row(item, outcome)
        response = outcome.response or {}
        choice = (response.get("choices") or [{}])[0]
        usage = response.get("usage") or {}
        text = _content(response) if outcome.response is not None else None
        if outcome.response is not None and item.schema is None:
            parsed = None  # free text: the row holds the text
        return {
            "key": item.key,
            "source": item.source,
            "kind": item.kind,
            "page": item.page,
            "pages": item.num_pages,
            "content_hash": item.content_hash,
            "prompt": item.prompt,
            "output": parsed,
            "text": text,
            "finish_reason": choice.get("finish_reason"),
            "usage": {k: usage.get(k, 0) for k in ("prompt_tokens", "completion_tokens")},
            "latency_s": round(time.monotonic() - job.started, 3),
            "attempts": job.attempts,
            "server": outcome.server,
            "error": outcome.error if outcome.error is not None else problem,
        }


def _content(response: dict[str, Any]) -> str:
    choices = response.get("choices") or [{}]
    return (choices[0].get("message") or {}).get("content") or ""


def _openai_row(item: WorkItem, outcome: Outcome) -> dict[str, Any]:
    """OpenAI's batch output line: the response (status + body) or, when none came, an error."""
    row: dict[str, Any] = {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": item.custom_id}
    if outcome.response is not None:
        row["response"] = {"status_code": 200, "request_id": outcome.response.get("id"), "body": outcome.response}
        row["error"] = None
    elif outcome.status >= 400:
        body = {"error": {"message": outcome.error, "type": "invalid_request_error", "param": None, "code": None}}
        row["response"] = {"status_code": outcome.status, "request_id": None, "body": body}
        row["error"] = None
    else:
        row["response"] = None
        row["error"] = {"code": "request_failed", "message": outcome.error}
    return row


def run_batch(options: BatchOptions, backend: Backend | None = None) -> Summary:
    return BatchRun(options, backend).run()
