"""Token ids -> what a client sees: one output processor for the in-process `Engine.step()` and the
server's detokenizer process.

Per request it keeps an `IncrementalDetokenizer` (text deltas, held-back partial stop strings and
incomplete UTF-8), ends the text at a stop string, cuts the step's tokens and logprobs after the
token that completed it, and counts completion tokens. An EOS or stop token ends the text without
being part of it, but it counts as a token. It also turns logprob token ids into strings for the
API.

A stop string ends a request that the engine may still be running. The caller then finishes it in
the scheduler's `end_at_stop_string` (in-process at once; served through `Abort(stopped=True)` to
the core, whose outputs for it until its own finish are dropped here).

In-process, `process_request` takes a scheduler request's new tokens and `request_output` makes the
`RequestOutput` that `Engine.step()` returns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from vlm_engine import ipc
from vlm_engine.detokenizer import IncrementalDetokenizer

if TYPE_CHECKING:
    from vlm_engine.scheduler.request import Request, SampledToken

_MAX_TOKEN_TEXTS = 200_000  # logprob strings cached by token id, bounded


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)


@dataclass
class RequestOutput:
    """What the in-process engine returns for a request after a step."""

    request_id: str
    token_ids: list[int]
    text: str
    finished: bool
    finish_reason: str | None  # "stop" | "length" | "abort" | None while running
    prompt_tokens: int
    cached_tokens: int
    new_token_ids: list[int] = field(default_factory=list)  # tokens added by the last step
    new_text: str = ""  # text made safe to show by the last step (stop strings held back)
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None  # the stop string or token id that ended it


@dataclass(slots=True)
class TextStep:
    """What one engine output did to a request's text."""

    token_ids: list[int]  # the output's tokens that happened: cut after the one that completed a stop string
    logprobs: list[Any] | None  # theirs, cut the same way (whatever entries the caller passed)
    delta: str  # new text safe to show (all of it once finished)
    text: str  # all text so far
    finished: bool
    finish_reason: str | None  # "stop" when a stop string ended it
    prompt_tokens: int
    completion_tokens: int  # so far, including tokens whose text is still held back
    stop_string: str | None  # the stop string that ended the text, when one did
    history: list[Any] | None  # every kept logprob entry so far, for a stream that keeps them


@dataclass(slots=True)
class _Stream:
    detok: IncrementalDetokenizer
    prompt_tokens: int
    completion_tokens: int = 0
    done: bool = False  # a stop string ended it while the engine still ran it: drop outputs until its finish
    history: list[Any] | None = None


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.streams: dict[str, _Stream] = {}
        self._token_text: dict[int, str] = {}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self.streams

    def add_request(
        self, request_id: str, stop: Sequence[str], prompt_tokens: int, keep_logprobs: bool = False
    ) -> None:
        """Start a request's stream; `keep_logprobs` keeps every entry (`TextStep.history`)."""
        detok = IncrementalDetokenizer(self.tokenizer, tuple(stop))
        self.streams[request_id] = _Stream(detok, prompt_tokens, history=[] if keep_logprobs else None)

    def drop(self, request_id: str) -> None:
        """Forget a request (it failed, or its finish needs no further output)."""
        self.streams.pop(request_id, None)

    def process(
        self,
        request_id: str,
        token_ids: list[int],
        logprobs: list[Any] | None,
        finished: bool,
        finish_reason: str | None,
        stop_token_id: int | None = None,
    ) -> TextStep | None:
        """Apply one engine output (the step's new tokens, whether the engine finished the request
        and why, the stop token that ended it); None for a request without a stream, or one a stop
        string already ended."""
        stream = self.streams.get(request_id)
        if stream is None:
            return None
        if stream.done:
            if finished:
                del self.streams[request_id]
            return None
        ids = token_ids
        text_ids = ids[:-1] if stop_token_id is not None and ids and ids[-1] == stop_token_id else ids
        detok = stream.detok
        hit = False
        if text_ids and detok.stop:
            # One token at a time (several come from a speculative step): the token that completes a
            # stop string ends the text, and the tokens after it never happened.
            for n, token_id in enumerate(text_ids, start=1):
                if detok.add([token_id]):
                    hit = True
                    if n < len(ids):
                        ids = ids[:n]
                        logprobs = logprobs[:n] if logprobs else logprobs
                    break
        elif text_ids:
            detok.add(text_ids)
        stream.completion_tokens += len(ids)
        if stream.history is not None and logprobs:
            stream.history.extend(logprobs)
        if hit:
            stream.done = not finished
            finished, finish_reason = True, "stop"
        if finished and not stream.done:
            del self.streams[request_id]
        return TextStep(
            ids,
            logprobs,
            detok.take_delta(finished),
            detok.text,
            finished,
            finish_reason,
            stream.prompt_tokens,
            stream.completion_tokens,
            detok.stopped_on,
            stream.history,
        )

    def process_request(self, request: Request, tokens: list[SampledToken]) -> TextStep:
        """In-process: a scheduler request's new tokens, as the step left the request (its
        stream starts with its first output)."""
        rid, sampling = request.request_id, request.sampling
        logprobs = None
        if sampling.logprobs is not None:
            logprobs = [TokenLogprob(t.token_id, t.logprob or 0.0, t.top_logprobs or []) for t in tokens]
        finished = request.status.finished
        reason, stop_token = (request.finish_reason, request.stop_token_id) if finished else (None, None)
        if rid not in self.streams:
            self.add_request(rid, sampling.stop, request.num_prompt_tokens, sampling.logprobs is not None)
        text = self.process(rid, [t.token_id for t in tokens], logprobs, finished, reason, stop_token)
        assert text is not None  # in-process, a stop string drops the stream as it finishes the request
        return text

    # ---- logprob strings -----------------------------------------------------------------------

    def logprob_entries(self, sampled: list[ipc.SampledLogprob]) -> list[ipc.LogprobEntry]:
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
            if len(self._token_text) < _MAX_TOKEN_TEXTS:
                self._token_text[token_id] = text
        return text


def request_output(request: Request, text: TextStep) -> RequestOutput:
    """The in-process output of a request whose step's tokens made `text`."""
    return RequestOutput(
        request_id=request.request_id,
        token_ids=request.output_token_ids,
        text=text.text,
        finished=request.status.finished,
        finish_reason=request.finish_reason,
        prompt_tokens=request.num_prompt_tokens,
        cached_tokens=request.num_cached_tokens,
        new_token_ids=text.token_ids,
        new_text=text.delta,
        logprobs=text.history,
        stop_reason=text.stop_string if text.stop_string is not None else request.stop_token_id,
    )
