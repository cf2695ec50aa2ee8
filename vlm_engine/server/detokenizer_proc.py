"""The detokenizer process: token ids from the engine core -> text deltas for the API server.

It runs the output processor `Engine.step()` runs in-process (vlm_engine.output_processor:
incremental text, stop strings and held-back partial ones, incomplete UTF-8, logprob strings,
completion token counts). When a stop string ends a request it reports "stop" to the API at once
and tells the core to finish the request (the core then frees its pages); tokens the core produced
in between are dropped.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import zmq

from vlm_engine import ipc
from vlm_engine.output_processor import OutputProcessor
from vlm_engine.server.config import ServerConfig
from vlm_engine.server.procs import init_child, serve_forever

logger = logging.getLogger(__name__)


def load_tokenizer(model: str) -> Any:
    """The same tokenizer the engine and the preprocess workers use."""
    from vlm_engine.models.registry import load_config, prompt_processor, resolve_model

    source = resolve_model(model)
    return prompt_processor(source, load_config(source)).tokenizer


def run_detokenizer(config: ServerConfig, paths: ipc.IpcPaths) -> None:
    """Child-process entry point."""
    init_child("vlm-detok", config.process.log_level, side=True, nice=config.process.side_process_nice)
    proc = DetokenizerProcess(load_tokenizer(config.engine.model.model), paths)
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
    def __init__(self, tokenizer: Any, paths: ipc.IpcPaths) -> None:
        self.logic = Detokenizer(tokenizer)
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
        logger.info("detokenizer ready")
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
                out, stop_ids = self.logic.process(msg)
                merged.deltas.extend(out.deltas)
                merged.errors.extend(out.errors)
                merged.stats = out.stats or merged.stats
                stopped.extend(stop_ids)
            if stopped:
                self.to_core.send_multipart(ipc.encode(ipc.Abort(stopped, stopped=True)))
            if merged.deltas or merged.errors or merged.stats is not None:
                self.to_api.send_multipart(ipc.encode(merged))
