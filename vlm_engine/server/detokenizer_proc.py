"""The detokenizer process: token ids from the engine core -> text deltas for the API server.

It runs the output processor `Engine.step()` runs in-process (vlm_engine.output_processor:
incremental text, stop strings and held-back partial ones, incomplete UTF-8, logprob strings,
completion token counts). When a stop string ends a request it reports "stop" to the API at once
and tells the core to finish the request (the core then frees its pages); tokens the core produced
in between are dropped.

It imports neither torch nor Transformers (~0.7 GiB of RSS they cost here): its tokenizer is the
`tokenizers` library's alone, published by the first preprocess worker that loaded the model's full
one (`publish_decode_tokenizer`; `vlm_engine.detokenizer.DecodeTokenizer`). A tokenizer that cannot
be held that way exactly is loaded in full here, as before.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec
import zmq

from vlm_engine import ipc
from vlm_engine.detokenizer import DecodeTokenizer, decode_tokenizer
from vlm_engine.output_processor import OutputProcessor
from vlm_engine.server.config import ServerConfig
from vlm_engine.server.procs import init_child, serve_forever

logger = logging.getLogger(__name__)


def load_tokenizer(model: str) -> Any:
    """The same tokenizer the engine and the preprocess workers use."""
    from vlm_engine.models.registry import load_config, prompt_processor, resolve_model

    source = resolve_model(model)
    return prompt_processor(source, load_config(source)).tokenizer


def decode_tokenizer_path(paths: ipc.IpcPaths) -> Path:
    return paths.root / "decode-tokenizer.json"


def publish_decode_tokenizer(tokenizer: Any, paths: ipc.IpcPaths) -> None:
    """Called by each preprocess worker once its processor is loaded; the first one writes what the
    detokenizer loads (a worker restarted later finds it there). An atomic rename: the detokenizer
    never reads half a file."""
    target = decode_tokenizer_path(paths)
    if target.exists():
        return
    try:
        light = decode_tokenizer(tokenizer)
    except Exception:
        logger.exception("could not build the detokenizer's light tokenizer")
        light = None
    if light is None:
        logger.info("the detokenizer loads the full tokenizer (%s decodes its own way)", type(tokenizer).__name__)
    tmp = target.with_name(f"{target.name}.{os.getpid()}.tmp")
    tmp.write_text(light.to_json() if light is not None else '{"tokenizer": null}')
    os.replace(tmp, target)


def await_decode_tokenizer(paths: ipc.IpcPaths, model: str, keep_going: Callable[[], bool]) -> Any:
    """The published tokenizer (None if the parent died first); the full one where none could be
    published. Nothing reaches the detokenizer before a worker has prepared a prompt, so waiting
    here delays no request."""
    target = decode_tokenizer_path(paths)
    while not target.exists():
        if not keep_going():
            return None
        time.sleep(0.05)
    light = DecodeTokenizer.from_json(target.read_text())
    return light if light is not None else load_tokenizer(model)


def run_detokenizer(config: ServerConfig, paths: ipc.IpcPaths) -> None:
    """Child-process entry point."""
    init_child(
        "vlm-detok", config.process.log_level, side=True, nice=config.process.side_process_nice, uses_torch=False
    )
    proc = DetokenizerProcess(
        paths, lambda keep_going: await_decode_tokenizer(paths, config.engine.model.model, keep_going)
    )
    serve_forever("detokenizer", proc.run, proc.close)


class Detokenizer:
    """Socket-free logic, so it can be tested in-process: engine outputs -> API deltas through the
    output processor `Engine.step()` uses, plus the core's timings."""

    def __init__(self, tokenizer: Any) -> None:
        self.outputs = OutputProcessor(tokenizer)
        self._timings: dict[str, ipc.RequestTiming] = {}  # the core's, from a request's first token on

    @property
    def streams(self) -> dict[str, Any]:
        return self.outputs.streams

    def process(self, msg: ipc.EngineOutputs) -> tuple[ipc.ApiOutputs, list[str]]:
        """Returns what to send to the API and the request ids a stop string just finished."""
        for params in msg.added:
            self.outputs.add_request(params.request_id, params.stop, params.prompt_tokens)
        deltas: list[ipc.Delta] = []
        stopped: list[str] = []
        for out in msg.outputs:
            delta = self._on_output(out, stopped, msg.sent)
            if delta is not None:
                deltas.append(delta)
        for err in msg.errors:
            self.outputs.drop(err.request_id)
            self._timings.pop(err.request_id, None)
        return ipc.ApiOutputs(deltas=deltas, errors=msg.errors, stats=msg.stats), stopped

    def _on_output(self, out: ipc.TokenOutput, stopped: list[str], sent: float) -> ipc.Delta | None:
        rid = out.request_id
        step = self.outputs.process(
            rid, out.new_token_ids, out.logprobs, out.finished, out.finish_reason, out.stop_token_id
        )
        if step is None:  # unknown, or a stop string ended it and this is the core catching up
            return None
        if out.timing is not None:
            self._timings[rid] = out.timing
        timing = self._timings.pop(rid, None) if step.finished else None
        if step.stop_string is not None and not out.finished:  # the core still runs it: tell it to stop
            stopped.append(rid)
            if timing is not None:  # finished here, when the core sent this token
                timing = msgspec.structs.replace(timing, finished=sent)
        return ipc.Delta(
            request_id=rid,
            text=step.delta,
            finished=step.finished,
            finish_reason=step.finish_reason,
            prompt_tokens=step.prompt_tokens,
            cached_tokens=out.cached_tokens,
            completion_tokens=step.completion_tokens,
            logprobs=self.outputs.logprob_entries(step.logprobs) if step.logprobs else None,
            token_ids=step.token_ids,
            timing=timing,
        )


class DetokenizerProcess:
    def __init__(self, paths: ipc.IpcPaths, tokenizer: Callable[[Callable[[], bool]], Any]) -> None:
        self._tokenizer = tokenizer  # called in `run` (it may wait for a worker): keep_going -> tokenizer
        self.ctx = zmq.Context()
        self.inbox = self.ctx.socket(zmq.PULL)
        self.inbox.bind(paths.detokenizer)
        self.to_api = self.ctx.socket(zmq.PUSH)
        self.to_api.connect(paths.api)
        self.to_core = self.ctx.socket(zmq.PUSH)
        self.to_core.connect(paths.core)
        for sock in (self.inbox, self.to_api, self.to_core):
            sock.setsockopt(zmq.LINGER, 0)
        for sock in (self.to_api, self.to_core):
            sock.setsockopt(zmq.SNDHWM, 0)
        self.decoder = ipc.Decoder(ipc.DetokInbound)

    def close(self) -> None:
        self.ctx.destroy(linger=0)

    def run(self, keep_going: Any) -> None:
        tokenizer = self._tokenizer(keep_going)
        if tokenizer is None:
            logger.warning("parent process is gone; detokenizer exiting")
            return
        logic = Detokenizer(tokenizer)
        logger.info("detokenizer ready (%s)", type(tokenizer).__name__)
        while True:
            if not self.inbox.poll(500):
                if not keep_going():
                    logger.warning("parent process is gone; detokenizer exiting")
                    return
                continue
            # Drain everything queued and answer with one message: under load the API process
            # (at low priority) then wakes once per batch of steps instead of once per step.
            merged = ipc.ApiOutputs(deltas=[], errors=[])
            stopped: list[str] = []
            while True:
                try:
                    parts = self.inbox.recv_multipart(zmq.NOBLOCK, copy=False)
                except zmq.Again:
                    break
                msg, _ = self.decoder.decode(parts)
                if isinstance(msg, (ipc.CoreReady, ipc.ProfileDone)):
                    self.to_api.send_multipart(ipc.encode(msg))
                    continue
                out, stop_ids = logic.process(msg)
                merged.deltas.extend(out.deltas)
                merged.errors.extend(out.errors)
                merged.stats = out.stats or merged.stats
                stopped.extend(stop_ids)
            if stopped:
                self.to_core.send_multipart(ipc.encode(ipc.Abort(stopped, stopped=True)))
            if merged.deltas or merged.errors or merged.stats is not None:
                self.to_api.send_multipart(ipc.encode(merged))
