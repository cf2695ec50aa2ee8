"""A preprocessing worker process: OpenAI messages / prompts -> engine requests.

Chat template, tokenization, media fetch and decode, resize/normalize and content hashing all
happen here (through `preprocess.prompt.PromptProcessor`), off the API server's event loop and off
the engine core. Pixel tensors, token ids and a family's positions leave as raw ZMQ frames.
Client mistakes become a `RequestError` (HTTP 400) sent straight to the API server.

/tokenize and /detokenize jobs run here too (the API process holds no tokenizer): a tokenize job
goes through the very conversion a chat or completions prompt goes through, media included, so its
count is the prompt a generation would run; its answer goes back to the API alone.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import zmq

from preprocess.errors import PromptError
from vlm_engine import ipc
from vlm_engine.host_memory import release_freed_memory
from vlm_engine.inputs import ProcessedPrompt
from vlm_engine.metrics.profiler import TorchProfiler
from vlm_engine.server.config import ServerConfig
from vlm_engine.server.detokenizer_proc import publish_decode_tokenizer
from vlm_engine.server.procs import init_child, serve_forever
from vlm_engine.structured.spec import StructuredOutput, StructuredOutputError

logger = logging.getLogger(__name__)


def run_preprocess_worker(config: ServerConfig, paths: ipc.IpcPaths, index: int) -> None:
    """Child-process entry point."""
    init_child(f"vlm-prep-{index}", config.process.log_level, side=True, nice=config.process.side_process_nice)
    from vlm_engine.models.registry import load_config, prompt_processor, resolve_model

    source = resolve_model(config.engine.model.model, config.engine.model.mmproj)
    processor = prompt_processor(source, load_config(source), config.engine.media)  # as the in-process Engine's
    publish_decode_tokenizer(processor.tokenizer, paths)  # what the (torch-free) detokenizer waits for
    checker = ConstraintChecker(processor)
    if config.process.warmup:
        checker.compiler  # noqa: B018 - build the tokenizer index before the first request needs it
    worker = PreprocessWorker(processor, paths, index, checker)
    serve_forever("preprocess worker", worker.run, worker.close)


def encode_engine_request(request_id: str, sampling: Any, prompt: ProcessedPrompt) -> list[Any]:
    """The multipart message for one engine request; arrays travel as frames, not in msgpack."""
    frames: list[Any] = []
    token_ids = ipc.tensor_frame(np.asarray(prompt.token_ids, dtype=np.int32), frames)
    media = [
        ipc.MediaMeta(
            m.kind,
            m.span.offset,
            m.span.length,
            m.span.content_hash,
            tuple(m.grid_thw),
            ipc.tensor_frame(m.pixel_values, frames),
        )
        for m in prompt.media
    ]
    positions = None
    if prompt.positions is not None:
        positions = ipc.tensor_frame(np.asarray(prompt.positions), frames)
    msg = ipc.EngineRequest(request_id, sampling, token_ids, media, positions, int(prompt.position_delta))
    return ipc.encode(msg, frames)


def choice_sampling(sampling: Any, index: int) -> Any:
    # n > 1 with a seed: each choice gets its own stream (seed + index) so the choices differ
    # but the request as a whole stays reproducible.
    if sampling.seed is None or index == 0:
        return sampling
    return dataclasses.replace(sampling, seed=sampling.seed + index)


class ConstraintChecker:
    """Compiles output constraints (and tools' parameter schemas) here, so a schema the grammar
    library cannot enforce is a 400 before the engine core allocates anything. Compiled grammars
    are cached by spec, so a repeated schema costs a dictionary lookup."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self._compiler: Any = None

    def check(self, request: ipc.PreprocessRequest) -> None:
        specs = []
        if request.sampling.structured_output is not None:
            specs.append((request.sampling.structured_output, "response_format"))
        for i, tool in enumerate(request.tools or []):
            specs.append((StructuredOutput.json(tool["function"]["parameters"]), f"tools[{i}].function.parameters"))
        for spec, param in specs:
            try:
                self.compiler.validate(spec)
            except StructuredOutputError as exc:
                raise StructuredOutputError(exc.message, param=exc.param or param) from None

    @property
    def compiler(self) -> Any:
        if self._compiler is None:
            from vlm_engine.structured.grammar import GrammarCompiler

            tok = self.processor.tokenizer
            self._compiler = GrammarCompiler(tok, self.processor.vocab_size, {int(tok.eos_token_id)})
        return self._compiler


class TokenizeJobs:
    """Answers /tokenize and /detokenize (vLLM's semantics) with the worker's prompt processor."""

    def __init__(self, processor: Any) -> None:
        self.processor = processor
        self.tokenizer = processor.tokenizer
        self._vocab_end: int | None = None  # one past the largest id detokenize accepts
        self._adds_special: bool | None = None  # the tokenizer puts special tokens around plain text

    def answer(self, request: ipc.PreprocessRequest) -> ipc.TokenizeResult:
        rid = f"{request.request_id}-{request.first_index}"
        if request.purpose == "detokenize":
            return ipc.TokenizeResult(rid, text=self.detokenize(list(request.prompt or [])))
        ids = self.tokenize(request)
        strs = list(self.tokenizer.convert_ids_to_tokens(ids)) if request.return_token_strs else None
        return ipc.TokenizeResult(rid, token_ids=ids, token_strs=strs)

    def tokenize(self, request: ipc.PreprocessRequest) -> list[int]:
        if request.messages is not None:
            return self._chat_ids(request)
        text = request.prompt
        if not isinstance(text, str):
            raise PromptError("'prompt' must be a string", param="prompt")
        special = request.add_special_tokens
        # vLLM counts an empty prompt (its special tokens alone); from_text refuses one, as generation must.
        if not text:
            return list(self.tokenizer("", add_special_tokens=special)["input_ids"])
        return list(self.processor.from_text(text, request.max_prompt_tokens, add_special_tokens=special).token_ids)

    def _chat_ids(self, request: ipc.PreprocessRequest) -> list[int]:
        """The prompt a chat completion with these messages runs (its usage.prompt_tokens is the count)."""
        if request.add_special_tokens and self.adds_special_tokens:
            # vLLM would add them on top of the rendered template; our chat prompt is the family's
            # own rendering, so answering that would count a prompt no generation runs.
            raise PromptError(
                "'add_special_tokens' true is not supported with 'messages' for this model "
                "(its chat template already writes the special tokens)",
                param="add_special_tokens",
            )
        prompt = self.processor.from_messages(
            request.messages,
            tools=request.tools,
            mm_processor_kwargs=request.mm_processor_kwargs,
            media_deadline=request.media_deadline,
            max_prompt_tokens=request.max_prompt_tokens,
            add_generation_prompt=request.add_generation_prompt,
        )
        return list(prompt.token_ids)

    def detokenize(self, ids: list[int]) -> str:
        end = self.vocab_end
        bad = next((t for t in ids if not 0 <= t < end), None)
        if bad is not None:
            # A fast tokenizer decodes an unknown id to nothing: a silent wrong answer, so refuse it.
            raise PromptError(f"token id {bad} is outside the vocabulary (0..{end - 1})", param="tokens")
        return self.tokenizer.decode(ids)

    @property
    def vocab_end(self) -> int:
        """Ids the model can produce (its embedding rows) or the tokenizer knows (added tokens)."""
        if self._vocab_end is None:
            self._vocab_end = max(int(self.processor.vocab_size), len(self.tokenizer))
        return self._vocab_end

    @property
    def adds_special_tokens(self) -> bool:
        if self._adds_special is None:
            with_special = self.tokenizer("a", add_special_tokens=True)["input_ids"]
            self._adds_special = list(with_special) != list(self.tokenizer("a", add_special_tokens=False)["input_ids"])
        return self._adds_special


class PreprocessWorker:
    def __init__(
        self, processor: Any, paths: ipc.IpcPaths, index: int, checker: ConstraintChecker | None = None
    ) -> None:
        self.processor = processor
        self.checker = checker or ConstraintChecker(processor)
        self.jobs = TokenizeJobs(processor)
        self.index = index
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(paths.worker(index))
        self.to_core = self.ctx.socket(zmq.PUSH)
        self.to_core.connect(paths.core)
        self.to_api = self.ctx.socket(zmq.PUSH)
        self.to_api.connect(paths.api)
        for sock in (self.inbox, self.to_core, self.to_api):
            sock.setsockopt(zmq.LINGER, 0)
        for sock in (self.to_core, self.to_api):
            sock.setsockopt(zmq.SNDHWM, 0)
        self.decoder = ipc.Decoder(ipc.WorkerInbound)
        self.profiler = TorchProfiler(f"preprocess-{index}")

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    def run(self, keep_going: Any) -> None:
        self.to_api.send_multipart(ipc.encode(ipc.WorkerReady(self.index, os.getpid())))
        logger.info("preprocess worker %d ready", self.index)
        worked = False  # since the last trim
        while True:
            if not self.inbox.poll(500):
                if not keep_going():
                    logger.warning("parent process is gone; preprocess worker exiting")
                    return
                if worked:  # idle for 0.5 s: the requests' image buffers go back to the kernel
                    release_freed_memory()
                    worked = False
                continue
            worked = True
            parts = self.inbox.recv_multipart(copy=False)
            try:
                msg, _ = self.decoder.decode(parts)
            except Exception:
                logger.exception("dropping an undecodable message")
                continue
            if isinstance(msg, ipc.ProfileControl):
                self.to_api.send_multipart(ipc.encode(self.profiler.control(msg)))
                continue
            with self.profiler.range("preprocess"):
                self.handle(msg)

    def handle(self, request: ipc.PreprocessRequest) -> None:
        """Always answers the API with one PreprocessDone (its load balancing counts on it), sent
        before the engine requests leave, so the API knows the prompt before its first token. A
        tokenize / detokenize job's TokenizeResult follows it, and nothing goes to the core."""
        ids = [f"{request.request_id}-{request.first_index + i}" for i in range(request.n)]
        t0 = time.perf_counter()
        done = ipc.PreprocessDone(
            self.index, request.request_id, request.first_index, request.n, purpose=request.purpose
        )
        if request.purpose != "generate":
            answer = self._attempt(request, ids, done, t0, self.jobs.answer)
            if answer is not None:
                self._done(done, t0)
                self.to_api.send_multipart(ipc.encode(answer))
            return
        prompt = self._attempt(request, ids, done, t0, self._prepare)
        if prompt is None:
            return
        done.media_hashes = [f"{m.span.content_hash:016x}" for m in prompt.media]
        if request.want_token_ids:
            done.prompt_token_ids = list(prompt.token_ids)
        self._done(done, t0)
        for i, rid in enumerate(ids):
            self.to_core.send_multipart(
                encode_engine_request(rid, choice_sampling(request.sampling, i), prompt), copy=False
            )

    def _prepare(self, request: ipc.PreprocessRequest) -> ProcessedPrompt:
        self.checker.check(request)
        return self.process(request)

    def _attempt(
        self,
        request: ipc.PreprocessRequest,
        ids: list[str],
        done: ipc.PreprocessDone,
        t0: float,
        work: Callable[[ipc.PreprocessRequest], Any],
    ) -> Any | None:
        """`work(request)`, or None once a failure was answered (its PreprocessDone, then the error)."""
        try:
            return work(request)
        except ValueError as exc:  # PromptError, MediaError, StructuredOutputError: the client's input
            self._done(done, t0)
            message, param = getattr(exc, "message", str(exc)), getattr(exc, "param", None)
            self._fail(ids, 400, message, param, code=getattr(exc, "code", None))
        except Exception as exc:
            logger.exception("preprocessing failed for %s", request.request_id)
            self._done(done, t0)
            self._fail(ids, 500, f"preprocessing failed: {type(exc).__name__}", None, "server_error")
        return None

    def _done(self, done: ipc.PreprocessDone, t0: float) -> None:
        done.seconds = time.perf_counter() - t0
        done.done_at = time.monotonic()
        done.media = [ipc.MediaTiming(kind, seconds) for kind, seconds in self.processor.take_media_timings()]
        self.to_api.send_multipart(ipc.encode(done))

    def process(self, request: ipc.PreprocessRequest) -> ProcessedPrompt:
        if request.messages is not None:
            return self.processor.from_messages(
                request.messages,
                tools=request.tools,
                mm_processor_kwargs=request.mm_processor_kwargs,
                media_deadline=request.media_deadline,
                max_prompt_tokens=request.max_prompt_tokens,
            )
        if isinstance(request.prompt, str):
            return self.processor.from_text(request.prompt, request.max_prompt_tokens)
        return self.processor.from_token_ids(list(request.prompt or []), request.max_prompt_tokens)

    def _fail(
        self,
        ids: list[str],
        status: int,
        message: str,
        param: str | None,
        kind: str = "invalid_request_error",
        code: str | None = None,
    ) -> None:
        for rid in ids:
            self.to_api.send_multipart(ipc.encode(ipc.RequestError(rid, status, message, kind, param, code)))
