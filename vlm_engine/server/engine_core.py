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
from vlm_engine.scheduler import RequestRejected, RequestStatus
from vlm_engine.server.config import ServerConfig
from vlm_engine.server.procs import init_child, serve_forever
from vlm_engine.structured.spec import StructuredOutputError

logger = logging.getLogger(__name__)

_MAX_TOMBSTONES = 8192  # aborts for requests not yet arrived; bounded in case they never arrive
_IDLE_POLL_MS = 500  # idle wake-up period, to notice a dead parent


def run_engine_core(config: ServerConfig, paths: ipc.IpcPaths) -> None:
    """Child-process entry point."""
    init_child("vlm-core", config.log_level, side=False)
    core = EngineCore(config, paths)
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
        self.engine = Engine(config.model, **config.engine_kwargs())
        self.scheduler = self.engine.scheduler
        self.pool = self.engine.pool
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
        self.stats = ipc.CoreStats(pages_total=self.pool.num_pages)
        self._pending = ipc.EngineOutputs(added=[], outputs=[], errors=[])
        self._dirty = False
        if config.warmup:
            self._warmup()
        info = ipc.CoreReady(
            model=config.model_name,
            max_model_len=self.engine.max_model_len,
            num_pages=self.pool.num_pages,
            page_size=self.engine.config.page_size,
            pid=os.getpid(),
        )
        self.outbox.send_multipart(ipc.encode(info))
        logger.info("engine core ready (max_model_len %d, %d KV pages)", info.max_model_len, info.num_pages)

    def _warmup(self) -> None:
        """One short request through the whole path, so the first client does not pay for lazy init."""
        t0 = time.perf_counter()
        prompt = self.engine.processor.from_text("Warm up the engine: one, two, three.")
        self.engine.generate([prompt], SamplingParams(max_tokens=4, temperature=0.0))
        # The grammar compiler's tokenizer index takes 0.4 s (49k vocab) to 2 s (151k) to build:
        # pay it now, not inside the step loop when the first constrained request arrives.
        self.engine.generate([prompt], SamplingParams(max_tokens=2, temperature=0.0, json_schema={"type": "object"}))
        self.pool.reset_prefix_cache()
        self.scheduler.reset_counters()  # the metrics start at the first client request
        self.engine.runner.encoder_cache.reset_counters()
        if self.engine.speculator is not None:
            self.engine.speculator.reset_counters()
        logger.info("warm-up took %.2f s", time.perf_counter() - t0)

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    # ---- loop ----------------------------------------------------------------------------------

    def run(self, keep_going: Any) -> None:
        while True:
            busy = self.scheduler.has_unfinished
            if self.inbox.poll(0 if busy else _IDLE_POLL_MS):
                self._drain()
            elif not busy and not keep_going():
                logger.warning("parent process is gone; engine core exiting")
                return
            if self.scheduler.has_unfinished:
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
            request = self.engine.make_request(rid, build_prompt(msg, frames), msg.sampling)
            self.scheduler.add_request(request)
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
            ipc.DetokParams(rid, msg.sampling.stop, msg.sampling.logprobs, request.num_prompt_tokens)
        )

    def _abort(self, msg: ipc.Abort) -> None:
        status = RequestStatus.FINISHED_STOPPED if msg.stopped else RequestStatus.FINISHED_ABORTED
        for rid in msg.request_ids:
            request = self.scheduler.requests.get(rid)
            if request is None:
                if not msg.stopped:  # not arrived yet (or already finished: the tombstone just ages out)
                    self.tombstones[rid] = None
                    while len(self.tombstones) > _MAX_TOMBSTONES:
                        self.tombstones.popitem(last=False)
                continue
            self.scheduler.finish(request, status)
            self._pending.outputs.append(
                ipc.TokenOutput(
                    rid, [], True, request.finish_reason, cached_tokens=request.num_cached_tokens, timing=_timing(request)
                )
            )

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
        plan = step.plan
        t0 = time.perf_counter()
        for request in step.nonfinite:  # aborted by the engine, pages freed; the batch went on
            self._pending.errors.append(
                ipc.RequestError(
                    request.request_id,
                    500,
                    "the model's logits for this request were not finite (NaN or inf); it was stopped",
                    type="server_error",
                )
            )
            self._dirty = True
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
        decodes = sum(  # decode tokens, drafts included
            c.num_tokens for c in plan.chunks if c.num_tokens - len(c.draft) == 1 and c.start >= c.request.num_prompt_tokens
        )
        s = self.stats
        s.steps += 1
        s.generation_tokens += sum(len(tokens) for _, tokens in step.tokens)
        s.prefill_tokens += plan.num_tokens - decodes
        s.preemptions += len(plan.preempted)
        s.grammar_mask_s += step.stats.mask_s
        speculator = self.engine.speculator
        if speculator is not None:
            spec = speculator.stats
            s.spec_drafts, s.spec_draft_tokens, s.spec_accepted_tokens = (
                spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens
            )
        if self.config.log_stats:
            s.step_schedule_s.observe(step.stats.schedule_s)
            s.step_forward_s.observe(step.stats.forward_s)
            s.step_update_s.observe(step.stats.update_s + time.perf_counter() - t0)
            s.step_batch_size.observe(len(plan.chunks))
            s.step_prefill_tokens.observe(plan.num_tokens - decodes)
            s.step_cached_tokens.observe(plan.num_cached_tokens)
            s.step_decode_tokens.observe(decodes)
            if speculator is not None:
                s.step_spec_propose_s.observe(step.stats.propose_s)
                for length in speculator.stats.last_step_lengths:
                    s.spec_acceptance_length.observe(length)
        self._dirty = True

    def _fail_batch(self, plan: Any, exc: Exception) -> None:
        """The forward pass failed: fail this batch's requests (freeing their pages), keep serving."""
        for chunk in plan.chunks:
            request = chunk.request
            if request.status.finished:
                continue
            self.scheduler.finish(request, RequestStatus.FINISHED_ABORTED)
            self._pending.errors.append(
                ipc.RequestError(request.request_id, 500, f"the forward pass failed: {exc}", type="server_error")
            )
        self._dirty = True

    def _flush(self) -> None:
        s = self.stats
        s.pages_used = self.pool.num_used
        s.pages_cached = self.pool.num_cached
        s.running = len(self.scheduler.running)
        s.waiting = len(self.scheduler.waiting)
        sched, encoder_cache = self.scheduler, self.engine.runner.encoder_cache
        s.prompt_tokens = sched.num_prompt_tokens
        s.prefix_cache_queries = sched.num_prefix_queries
        s.cached_prompt_tokens = sched.num_prefix_hits
        s.mm_cache_hits = encoder_cache.hits
        s.mm_cache_queries = encoder_cache.hits + encoder_cache.misses
        self._pending.stats = s
        self._pending.sent = time.monotonic()
        self.outbox.send_multipart(ipc.encode(self._pending), copy=False)
        self._pending = ipc.EngineOutputs(added=[], outputs=[], errors=[])
        self._dirty = False
