"""The engine-core process: owns the `Engine` (scheduler + model runner) and loops its steps.

Between steps it drains its inbox without blocking (new requests, aborts, stop-string finishes);
it blocks on the inbox only when it has no work, so it never waits on another process while
there is something to compute. Each step's sampled token ids go out in one message to the
detokenizer; text, stop strings and logprob strings are the detokenizer's job, so the core calls
`Engine.step_tokens()` (the token-level step `Engine.step()` is built on) and never detokenizes.

Every request the core accepted ends with exactly one finished `TokenOutput` (stop, length,
abort) or one `RequestError`, so the detokenizer can drop its state.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from typing import Any

import torch
import zmq

from vlm_engine import ipc
from vlm_engine.cache.page_hash import MediaSpan
from vlm_engine.engine import Engine, StepFailed
from vlm_engine.inputs import MediaInput, ProcessedPrompt
from vlm_engine.metrics.profiler import TorchProfiler
from vlm_engine.sampling_params import SamplingParams
from vlm_engine.scheduler import RequestRejected
from vlm_engine.server.config import ServerConfig
from vlm_engine.server.procs import exit_child, init_child, serve_forever
from vlm_engine.structured.spec import StructuredOutputError

logger = logging.getLogger(__name__)

_MAX_TOMBSTONES = 8192  # aborts for requests not yet arrived; bounded in case they never arrive
_IDLE_POLL_MS = 500  # idle wake-up period, to notice a dead parent


def run_engine_core(config: ServerConfig, paths: ipc.IpcPaths) -> None:
    """Child-process entry point."""
    init_child("vlm-core", config.process.log_level, side=False)
    try:
        core = EngineCore(config, paths)
    except (ValueError, FileNotFoundError) as exc:
        # A checkpoint or an option the engine refuses (an unsupported quantization format, a missing file, an
        # option that does not fit the model) is the user's to fix: one line saying what, not a traceback.
        logger.error("could not start: %s", exc)
        logger.debug("start-up failure", exc_info=True)
        exit_child(2)
    serve_forever("engine core", core.run, core.close)


def _timing(request: Any) -> ipc.RequestTiming:
    spec = request.speculation
    return ipc.RequestTiming(
        request.arrival_time,
        request.first_scheduled_time,
        request.first_token_time,
        request.finished_time,
        request.num_preemptions,
        spec.num_drafts if spec is not None else 0,
        spec.num_draft_tokens if spec is not None else 0,
        spec.num_accepted_tokens if spec is not None else 0,
    )


def build_prompt(msg: ipc.EngineRequest, frames: list[Any]) -> ProcessedPrompt:
    """Rebuild the worker's `ProcessedPrompt` from the message and its raw frames (no copies)."""
    token_ids = ipc.frame_array(msg.token_ids, frames).tolist()
    media = [
        MediaInput(
            kind=m.kind,
            span=MediaSpan(m.offset, m.length, m.content_hash),
            pixel_values=torch.from_numpy(ipc.frame_array(m.pixels, frames)),
            grid_thw=m.grid_thw,
        )
        for m in msg.media
    ]
    positions = None
    if msg.positions is not None:
        positions = ipc.frame_array(msg.positions, frames)
    return ProcessedPrompt(token_ids=token_ids, media=media, positions=positions, position_delta=msg.position_delta)


class EngineCore:
    def __init__(self, config: ServerConfig, paths: ipc.IpcPaths) -> None:
        self.config = config
        self.engine = Engine(config.engine)
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.setsockopt(zmq.LINGER, 0)
        self.inbox.bind(paths.core)
        self.outbox = self.ctx.socket(zmq.PUSH)
        self.outbox.setsockopt(zmq.LINGER, 0)
        self.outbox.setsockopt(zmq.SNDHWM, 0)  # never block the step loop on a slow reader
        self.outbox.connect(paths.detokenizer)
        self.decoder = ipc.Decoder(ipc.CoreInbound)
        self.tombstones: OrderedDict[str, None] = OrderedDict()
        self.profiler = TorchProfiler("engine-core")
        self._pending = ipc.EngineOutputs(added=[], outputs=[], errors=[])
        self._dirty = False
        if config.process.warmup:
            self._warmup()
        info = ipc.CoreReady(
            model=config.model_name,
            max_model_len=self.engine.max_model_len,
            num_pages=self.engine.num_pages,
            page_size=self.engine.page_size,
            pid=os.getpid(),
        )
        self.outbox.send_multipart(ipc.encode(info))
        logger.info("engine core ready (max_model_len %d, %d KV pages)", info.max_model_len, info.num_pages)

    def _warmup(self) -> None:
        """One short request through the whole path, so the first client does not pay for lazy init."""
        t0 = time.perf_counter()
        prompt = self.engine.process_prompt("Warm up the engine: one, two, three.")
        self.engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))
        # The grammar compiler's tokenizer index takes 0.4 s (49k vocab) to 2 s (151k) to build:
        # pay it now, not inside the step loop when the first constrained request arrives.
        self.engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, json_schema={"type": "object"}))
        self.engine.reset_prefix_cache()
        self.engine.reset_counters()  # the metrics start at the first client request
        logger.info("warm-up took %.2f s", time.perf_counter() - t0)

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    # ---- loop ----------------------------------------------------------------------------------

    def run(self, keep_going: Any) -> None:
        while True:
            busy = self.engine.has_unfinished
            if self.inbox.poll(0 if busy else _IDLE_POLL_MS):
                self._drain()
            elif not busy and not keep_going():
                logger.warning("parent process is gone; engine core exiting")
                return
            if self.engine.has_unfinished:
                self._step()
            if self._dirty:
                self._flush()

    def _drain(self) -> None:
        while True:
            try:
                parts = self.inbox.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg, frames = self.decoder.decode(parts)
            except Exception:
                logger.exception("dropping an undecodable message")
                continue
            if isinstance(msg, ipc.EngineRequest):
                self._add(msg, frames)
            elif isinstance(msg, ipc.ProfileControl):
                self.outbox.send_multipart(ipc.encode(self.profiler.control(msg)))
            else:
                self._abort(msg)
            self._dirty = True

    def _add(self, msg: ipc.EngineRequest, frames: list[Any]) -> None:
        rid = msg.request_id
        if rid in self.tombstones:  # the client left while this was being preprocessed
            del self.tombstones[rid]
            return
        try:
            prompt = build_prompt(msg, frames)
            self.engine.add_request(prompt, msg.sampling, rid)
        except RequestRejected as exc:
            code = "context_length_exceeded" if "context" in str(exc) else None
            self._pending.errors.append(ipc.RequestError(rid, 400, str(exc), param="messages", code=code))
            return
        except StructuredOutputError as exc:  # the workers validate first; this is the backstop
            self._pending.errors.append(ipc.RequestError(rid, 400, exc.message, param=exc.param or "response_format"))
            return
        except Exception as exc:  # a malformed request must not take the core down
            logger.exception("could not add request %s", rid)
            self._pending.errors.append(ipc.RequestError(rid, 500, f"internal error: {exc}", type="server_error"))
            return
        self._pending.added.append(
            ipc.DetokParams(rid, msg.sampling.stop, msg.sampling.logprobs, len(prompt.token_ids))
        )

    def _abort(self, msg: ipc.Abort) -> None:
        """The client left, or (`stopped`) the detokenizer found a stop string: finish them."""
        finished = self.engine.abort_requests(msg.request_ids, stop_string=msg.stopped)
        if not msg.stopped and len(finished) < len(msg.request_ids):
            done = {request.request_id for request in finished}
            for rid in msg.request_ids:  # not arrived yet (or already finished: the tombstone just ages out)
                if rid not in done:
                    self.tombstones[rid] = None
            while len(self.tombstones) > _MAX_TOMBSTONES:
                self.tombstones.popitem(last=False)
        for request in finished:
            self._pending.outputs.append(
                ipc.TokenOutput(
                    request.request_id, [], True, request.finish_reason, cached_tokens=request.num_cached_tokens,
                    timing=_timing(request),
                )
            )  # fmt: skip

    # ---- one step ------------------------------------------------------------------------------

    def _step(self) -> None:
        try:
            with self.profiler.range("engine_step"):
                step = self.engine.step_tokens()
        except StepFailed as failed:
            logger.exception("forward pass failed for %d requests", len(failed.plan.chunks))
            self._fail_batch(failed.plan, failed.__cause__ or failed)
            return
        if step is None:
            # Nothing fits right now (transient); wait briefly for an abort instead of spinning.
            if self.inbox.poll(5):
                self._drain()
            return
        t0 = time.perf_counter()
        for request, reason in step.failed:  # finished by the engine, pages freed; the batch went on
            self._pending.errors.append(ipc.RequestError(request.request_id, 500, reason, type="server_error"))
        outputs = self._pending.outputs
        for request, tokens in step.tokens:
            finished = request.status.finished
            logprobs = None
            if request.sampling.logprobs is not None:
                logprobs = [ipc.SampledLogprob(t.token_id, t.logprob or 0.0, t.top_logprobs or []) for t in tokens]
            first = request.num_output_tokens == len(tokens)
            outputs.append(
                ipc.TokenOutput(
                    request.request_id,
                    [t.token_id for t in tokens],
                    finished,
                    request.finish_reason,
                    request.stop_token_id if finished else None,
                    request.num_cached_tokens,
                    logprobs,
                    _timing(request) if finished or first else None,
                )
            )
        step.stats.update_s += time.perf_counter() - t0
        self.engine.record_step(step, histograms=self.config.observability.log_stats)
        self._dirty = True

    def _fail_batch(self, plan: Any, exc: BaseException) -> None:
        """The forward pass failed: fail this batch's requests (the engine frees their pages), keep serving."""
        for request in self.engine.fail_batch(plan):
            self._pending.errors.append(
                ipc.RequestError(request.request_id, 500, f"the forward pass failed: {exc}", type="server_error")
            )
        self._dirty = True

    def _flush(self) -> None:
        self._pending.stats = self.engine.make_stats()
        self._pending.sent = time.monotonic()
        self.outbox.send_multipart(ipc.encode(self._pending), copy=False)
        self._pending = ipc.EngineOutputs(added=[], outputs=[], errors=[])
        self._dirty = False
