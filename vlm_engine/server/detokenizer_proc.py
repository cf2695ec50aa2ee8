"""The detokenizer process: token ids from the engine core -> text deltas for the API server.

It runs `IncrementalDetokenizer` per request (stop strings, held-back partial stop strings and
incomplete UTF-8), turns logprob token ids into strings, and counts completion tokens. When a
stop string ends a request it reports "stop" to the API at once and tells the core to finish the
request (the core then frees its pages); tokens the core produced in between are dropped.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq

from vlm_engine import ipc
from vlm_engine.detokenizer import IncrementalDetokenizer
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
    init_child("vlm-detok", config.log_level, side=True, nice=config.side_process_nice)
    proc = DetokenizerProcess(load_tokenizer(config.model), paths)
    serve_forever("detokenizer", proc.run, proc.close)


@dataclass
class _Stream:
    detok: IncrementalDetokenizer
    params: ipc.DetokParams
    completion_tokens: int = 0
    done: bool = False  # a stop string ended it here; waiting for the core's final output
    timing: ipc.RequestTiming | None = None  # the core's, from the first token on


class Detokenizer:
    """Socket-free logic, so it can be tested in-process."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.streams: dict[str, _Stream] = {}
        self._token_text: dict[int, str] = {}

    def process(self, msg: ipc.EngineOutputs) -> tuple[ipc.ApiOutputs, list[str]]:
        """Returns what to send to the API and the request ids a stop string just finished."""
        for params in msg.added:
            self.streams[params.request_id] = _Stream(IncrementalDetokenizer(self.tokenizer, params.stop), params)
        deltas: list[ipc.Delta] = []
        stopped: list[str] = []
        for out in msg.outputs:
            delta = self._on_output(out, stopped, msg.sent)
            if delta is not None:
                deltas.append(delta)
        for err in msg.errors:
            self.streams.pop(err.request_id, None)
        return ipc.ApiOutputs(deltas=deltas, errors=msg.errors, stats=msg.stats), stopped

    def _on_output(self, out: ipc.TokenOutput, stopped: list[str], sent: float) -> ipc.Delta | None:
        stream = self.streams.get(out.request_id)
        if stream is None:
            return None
        if stream.done:
            if out.finished:
                del self.streams[out.request_id]
            return None
        if out.timing is not None:
            stream.timing = out.timing
        ids = out.new_token_ids
        text_ids = ids
        if out.stop_token_id is not None and ids and ids[-1] == out.stop_token_id:
            text_ids = ids[:-1]  # EOS / stop tokens end the text, they are not part of it
        logprobs = out.logprobs
        if len(text_ids) > 1 and stream.detok.stop:  # several tokens (speculative decoding): stop where the text does
            hit_stop = False
            for n, token_id in enumerate(text_ids, start=1):
                if stream.detok.add([token_id]):
                    hit_stop, ids = True, ids[:n]  # tokens after the stop string never happened
                    logprobs = logprobs[:n] if logprobs else logprobs
                    break
        else:
            hit_stop = stream.detok.add(text_ids) if text_ids else False
        stream.completion_tokens += len(ids)
        finished, reason = out.finished, out.finish_reason
        if hit_stop:
            if not finished:
                stopped.append(out.request_id)
                stream.done = True
                if stream.timing is not None:  # finished here, when the core sent this token
                    stream.timing = msgspec.structs.replace(stream.timing, finished=sent)
            finished, reason = True, "stop"
        if finished and not stream.done:
            del self.streams[out.request_id]
        return ipc.Delta(
            request_id=out.request_id,
            text=stream.detok.take_delta(finished),
            finished=finished,
            finish_reason=reason,
            prompt_tokens=stream.params.prompt_tokens,
            cached_tokens=out.cached_tokens,
            completion_tokens=stream.completion_tokens,
            logprobs=self._logprobs(logprobs) if logprobs else None,
            token_ids=ids,
            timing=stream.timing if finished else None,
        )

    def _logprobs(self, sampled: list[ipc.SampledLogprob]) -> list[ipc.LogprobEntry]:
        entries = []
        for s in sampled:
            token = self._text(s.token_id)
            top = [ipc.TopLogprob(t := self._text(tid), lp, list(t.encode())) for tid, lp in s.top]
            entries.append(ipc.LogprobEntry(token, s.logprob, list(token.encode()), top))
        return entries

    def _text(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id], skip_special_tokens=False)
            if len(self._token_text) < 200_000:
                self._token_text[token_id] = text
        return text


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
