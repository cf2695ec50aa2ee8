"""Token ids -> what a client sees: one output processor for the in-process `Engine.step()` and the
server's detokenizer process.

Per request it keeps an `IncrementalDetokenizer` (text deltas, held-back partial stop strings and
incomplete UTF-8), ends the text at a stop string, cuts the step's tokens and logprobs after the
token that completed it, and counts completion tokens. An EOS or stop token ends the text without
being part of it, but it counts as a token. It also turns logprob token ids into strings for the
API.

A stop string ends a request that the engine may still be running. The caller then finishes it in
the scheduler (in-process at once; served through `Abort(stopped=True)` to the core, whose outputs
for it until its own finish are dropped here).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from vlm_engine import ipc
from vlm_engine.detokenizer import IncrementalDetokenizer

_MAX_TOKEN_TEXTS = 200_000  # logprob strings cached by token id, bounded


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
