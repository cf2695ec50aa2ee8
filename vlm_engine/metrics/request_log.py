"""`--request-log PATH`: one JSON line per finished engine request, token ids included.

What a tokenizer bug or a slow drift is found with after the fact: the exact prompt and output
token ids, every phase's timestamp (Unix seconds), the media it saw (content hashes), what the
prefix cache gave it, and the error the client got, if any. Lines are flushed as they are written.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import msgspec

from vlm_engine import ipc
from vlm_engine.metrics.request_tracker import RequestRecord


class RequestLog:
    def __init__(self, path: str | Path, model_name: str, replica: str) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("ab", buffering=0)
        self._encoder = msgspec.json.Encoder()
        self.model_name, self.replica = model_name, replica
        # Monotonic readings (from every process) become Unix time through one offset taken here.
        self._to_unix = time.time() - time.monotonic()

    def close(self) -> None:
        self._file.close()

    def _unix(self, t: float | None) -> float | None:
        return None if t is None else round(t + self._to_unix, 6)

    def entry(self, record: RequestRecord) -> dict[str, Any]:
        prep, timing, err = record.preprocess, record.timing, record.error
        return {
            "request_id": record.request_id,
            "choice": record.choice,
            "api": record.api,
            "model": self.model_name,
            "replica": self.replica,
            "arrival": self._unix(record.arrival),
            "preprocess_done": self._unix(prep.done_at) if prep is not None else None,
            "first_scheduled": self._unix(timing.first_scheduled) if timing is not None else None,
            "first_token": self._unix(record.first_token),
            "finish": self._unix(record.finished),
            "prompt_token_ids": prep.prompt_token_ids if prep is not None else None,
            "output_token_ids": record.output_token_ids,
            "num_prompt_tokens": record.prompt_tokens,
            "num_output_tokens": record.completion_tokens,
            "cached_tokens": record.cached_tokens,
            "media_hashes": prep.media_hashes if prep is not None else [],
            "finish_reason": None if err is not None else record.finish_reason,
            "preemptions": timing.preemptions if timing is not None else 0,
            **_speculation(timing),
            "error": _error(err),
        }

    # ---- RecordSink ---------------------------------------------------------------------------

    def on_first_token(self, ttft_s: float) -> None:
        pass

    def on_token_gap(self, gap_s: float, times: int) -> None:
        pass

    def on_preprocessed(self, done: ipc.PreprocessDone) -> None:
        pass

    def on_finished(self, record: RequestRecord) -> None:
        self._file.write(self._encoder.encode(self.entry(record)) + b"\n")


def _speculation(timing: ipc.RequestTiming | None) -> dict[str, Any]:
    drafts = timing.spec_drafts if timing is not None else 0
    return {
        "spec_drafts": drafts,
        "spec_draft_tokens": timing.spec_draft_tokens if timing is not None else 0,
        "spec_accepted_tokens": timing.spec_accepted_tokens if timing is not None else 0,
        "spec_acceptance_length": round(1 + timing.spec_accepted_tokens / drafts, 4) if timing and drafts else None,
    }


def _error(err: ipc.RequestError | None) -> dict[str, Any] | None:
    if err is None:
        return None
    return {"status": err.status, "message": err.message, "type": err.type, "param": err.param, "code": err.code}
