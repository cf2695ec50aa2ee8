"""Every message the server's processes exchange, and how they travel.

Wiring (ZeroMQ PUSH/PULL over `ipc://` sockets in one per-run directory; each PULL is bound by
the process that reads it, every writer connects a PUSH):

    api ──PreprocessRequest──> worker[i] ──EngineRequest + frames──> core
    api ──Abort / ProfileControl─────────────────────────────────────> core
    api ──ProfileControl──> worker[i] ──ProfileDone──> api
    core ──CoreReady / EngineOutputs / ProfileDone──> detokenizer ──CoreReady / ApiOutputs / ProfileDone──> api
    detokenizer ──Abort(stopped=True)──> core   (a stop string ended the request)
    worker ──WorkerReady / RequestError / PreprocessDone / TokenizeResult──> api

A message is one msgpack frame (a tagged `msgspec.Struct`) followed by zero or more raw frames:
token ids, a family's rotary positions and pixel tensors go as numpy buffers, zero-copy on both ends, never
pickled. `TensorMeta.frame` says which extra frame holds a tensor.

Ids: the API gives each OpenAI request an id (`chatcmpl-…`, `cmpl-…`, `resp_…`); every choice of it is one
engine request `"{id}-{index}"`. All messages below carry engine request ids.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import msgspec
import numpy as np

from vlm_engine.histogram import Histogram
from vlm_engine.sampling_params import SamplingParams


class Message(msgspec.Struct, tag=True, tag_field="msg"):
    """Base of every top-level message: the class name travels as the `msg` tag."""


# ---- tensors as frames ---------------------------------------------------------------------------


class TensorMeta(msgspec.Struct, array_like=True, frozen=True):
    frame: int  # index into the message's extra frames
    dtype: str  # numpy dtype name
    shape: tuple[int, ...]


def tensor_frame(array: Any, frames: list[Any]) -> TensorMeta:
    """Append a numpy array (or CPU torch tensor) to `frames` without copying; returns its meta."""
    if hasattr(array, "detach"):  # torch.Tensor: share its memory through numpy
        array = array.detach().contiguous().numpy()
    array = np.ascontiguousarray(array)
    frames.append(array.data if array.size else b"")
    return TensorMeta(len(frames) - 1, array.dtype.str, tuple(array.shape))


def frame_array(meta: TensorMeta, frames: list[Any]) -> np.ndarray:
    """The numpy view of a received frame (zero-copy over the zmq buffer, writable)."""
    frame = frames[meta.frame]
    buffer = frame.buffer if hasattr(frame, "buffer") else frame
    return np.frombuffer(buffer, dtype=np.dtype(meta.dtype)).reshape(meta.shape)


# ---- api -> preprocess worker --------------------------------------------------------------------


class PreprocessRequest(Message):
    """One prompt to turn into engine requests; `n` choices share its preprocessing.

    With `purpose` "tokenize" (/tokenize: `prompt` text or chat `messages`) or "detokenize"
    (/detokenize: `prompt` holds the ids) it is a job for the worker alone: answered with a
    `TokenizeResult` (after its PreprocessDone, as always), nothing goes to the core.
    """

    request_id: str  # the OpenAI request id; choices become f"{request_id}-{index}"
    first_index: int  # index of the first choice this prompt produces
    n: int
    sampling: SamplingParams
    messages: Any = None  # chat: the raw OpenAI message list (validated by the worker)
    prompt: str | list[int] | None = None  # completions: text or token ids
    tools: Any = None  # chat: the validated OpenAI tool list the chat template renders
    mm_processor_kwargs: Any = None  # chat: video sampling overrides (fps, max_frames), checked by the worker
    worker: int = 0  # which worker got it (echoed in PreprocessDone for load balancing)
    want_token_ids: bool = False  # echo the prompt's token ids in PreprocessDone (request log, return_token_ids)
    # time.monotonic() (one clock for every process on the host) by which the request's media must
    # be loaded and decoded: its media time budget, counted from its arrival (fetching included).
    media_deadline: float | None = None
    max_prompt_tokens: int | None = None  # the context length: a longer prompt is refused before tokenizing
    purpose: str = "generate"  # "generate" | "tokenize" | "detokenize"
    # tokenize only (vLLM's /tokenize options; the route sets each form's default):
    add_generation_prompt: bool = True  # messages: end with the assistant turn's opening
    add_special_tokens: bool = True  # the tokenizer's own special tokens (BOS...) around the text
    return_token_strs: bool = False  # also answer the tokenizer's string for every id


# ---- worker -> core --------------------------------------------------------------------------------


class MediaMeta(msgspec.Struct, array_like=True):
    kind: str  # "image" | "video"
    offset: int
    length: int
    content_hash: int
    grid_thw: tuple[int, int, int]
    pixels: TensorMeta


class EngineRequest(Message):
    """A preprocessed prompt; frames hold token ids (int32), the family's positions and pixels."""

    request_id: str
    sampling: SamplingParams
    token_ids: TensorMeta
    media: list[MediaMeta] = []
    positions: TensorMeta | None = None
    position_delta: int = 0


# ---- api / detokenizer -> core ---------------------------------------------------------------------


class Abort(Message):
    """Finish requests early: `stopped` (a stop string hit) reports "stop", otherwise "abort".

    Ids the core has not seen yet (still in a preprocess worker) are remembered and dropped on arrival.
    """

    request_ids: list[str]
    stopped: bool = False


class ProfileControl(Message):
    """api -> core and every worker: start or stop the torch profiler (only with --profile-dir)."""

    start: bool
    directory: str


# ---- core -> detokenizer ---------------------------------------------------------------------------


class CoreReady(Message):
    model: str
    max_model_len: int
    num_pages: int
    page_size: int
    pid: int


class DetokParams(msgspec.Struct, array_like=True):
    """What the detokenizer needs to know about a request; sent once, before its first tokens."""

    request_id: str
    stop: tuple[str, ...]
    logprobs: int | None
    prompt_tokens: int


class SampledLogprob(msgspec.Struct, array_like=True):
    token_id: int
    logprob: float
    top: list[tuple[int, float]]


class RequestTiming(msgspec.Struct, array_like=True):
    """The engine core's view of one request, in time.monotonic() seconds (CLOCK_MONOTONIC is
    system-wide on Linux, so the API process can subtract its own readings from these)."""

    arrival: float  # entered the core's queue (preprocessing done)
    first_scheduled: float | None
    first_token: float | None
    finished: float | None = None
    preemptions: int = 0
    # Speculative decoding, so far: verification steps with a draft, draft tokens, accepted ones.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0


class TokenOutput(msgspec.Struct, array_like=True):
    request_id: str
    new_token_ids: list[int]
    finished: bool = False
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_token_id: int | None = None  # the EOS / stop token that ended it (not shown as text)
    cached_tokens: int = 0
    logprobs: list[SampledLogprob] | None = None
    timing: RequestTiming | None = None  # on a request's first token and on its finish


# Per-step histogram bounds: seconds, and token / sequence counts.
STEP_SECONDS_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0)
STEP_TOKENS_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


def _step_seconds() -> Histogram:
    return Histogram.with_bounds(STEP_SECONDS_BUCKETS)


def _step_tokens() -> Histogram:
    return Histogram.with_bounds(STEP_TOKENS_BUCKETS)


ACCEPTANCE_LENGTH_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)


def _acceptance_lengths() -> Histogram:
    return Histogram.with_bounds(ACCEPTANCE_LENGTH_BUCKETS)


class CoreStats(msgspec.Struct, array_like=True):
    """The engine core's gauges and cumulative counters, sent whole with every flush: the API
    process exports the latest copy, so a lost or merged message never skews a counter."""

    pages_used: int = 0
    pages_total: int = 0
    pages_cached: int = 0
    running: int = 0
    waiting: int = 0
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens of admitted requests, prefix-cache hits included
    prefill_tokens: int = 0  # tokens run through prefill (recomputation after preemption included)
    generation_tokens: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens served from the prefix cache, at first admission
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    mm_cache_queries: int = 0  # media items looked up in the vision-encoder cache
    mm_cache_hits: int = 0
    preemptions: int = 0
    grammar_mask_s: float = 0.0  # cumulative host time building grammar masks (overlapped with forward)
    # Speculative decoding: verified sequences that carried a draft, draft tokens, accepted draft tokens.
    spec_drafts: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    # Linear-attention models' state slots (cache/state_pool.py): held (live, checkpoints,
    # snapshots), in all, snapshots kept, and prefix-cache hits resumed from a snapshot.
    state_slots_used: int = 0
    state_slots_total: int = 0
    state_snapshots: int = 0
    state_snapshot_hits: int = 0
    # Per step: where the time went, and what the batch held.
    step_schedule_s: Histogram = msgspec.field(default_factory=_step_seconds)
    step_forward_s: Histogram = msgspec.field(default_factory=_step_seconds)
    step_update_s: Histogram = msgspec.field(default_factory=_step_seconds)
    step_batch_size: Histogram = msgspec.field(default_factory=_step_tokens)
    step_prefill_tokens: Histogram = msgspec.field(default_factory=_step_tokens)
    step_cached_tokens: Histogram = msgspec.field(default_factory=_step_tokens)
    step_decode_tokens: Histogram = msgspec.field(default_factory=_step_tokens)
    step_spec_propose_s: Histogram = msgspec.field(default_factory=_step_seconds)
    # Tokens one verification step emitted for one sequence (accepted drafts + 1).
    spec_acceptance_length: Histogram = msgspec.field(default_factory=_acceptance_lengths)


class RequestError(Message):
    """A request that cannot run; `status` is the HTTP status the API answers with."""

    request_id: str
    status: int
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class EngineOutputs(Message):
    """One step's results (or, when idle, just fresh stats after aborts)."""

    added: list[DetokParams] = []
    outputs: list[TokenOutput] = []
    errors: list[RequestError] = []
    stats: CoreStats | None = None
    sent: float = 0.0  # time.monotonic() when the core sent it (a stop string's finish time)


# ---- detokenizer / workers -> api ------------------------------------------------------------------


class TopLogprob(msgspec.Struct, array_like=True):
    token: str
    logprob: float
    bytes: list[int]


class LogprobEntry(msgspec.Struct, array_like=True):
    token: str
    logprob: float
    bytes: list[int]
    top: list[TopLogprob]


class Delta(msgspec.Struct, array_like=True):
    request_id: str
    text: str
    finished: bool
    finish_reason: str | None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int  # so far, including tokens whose text is still held back
    logprobs: list[LogprobEntry] | None = None
    token_ids: list[int] = []  # the tokens counted in completion_tokens since the last delta
    timing: RequestTiming | None = None  # the core's timestamps, on the finishing delta


class ApiOutputs(Message):
    deltas: list[Delta] = []
    errors: list[RequestError] = []
    stats: CoreStats | None = None


class WorkerReady(Message):
    worker: int
    pid: int


class MediaTiming(msgspec.Struct, array_like=True):
    kind: str  # "image_decode" | "video_extraction" | "pdf_render" | "image_processor"
    seconds: float


class PreprocessDone(Message):
    """A worker finished a prompt (sent before its engine requests leave for the core)."""

    worker: int
    request_id: str = ""
    first_index: int = 0
    n: int = 0
    seconds: float = 0.0  # the whole prompt: template, tokenization, media
    done_at: float = 0.0  # time.monotonic() when it finished
    media: list[MediaTiming] = []
    media_hashes: list[str] = []  # content hashes (hex) of the prompt's images and videos
    prompt_token_ids: list[int] | None = None  # when the request asked (want_token_ids)
    purpose: str = "generate"  # echoed: only a generation's preprocessing reaches the request metrics


class TokenizeResult(Message):
    """A worker's answer to a tokenize / detokenize job (sent after its PreprocessDone)."""

    request_id: str  # the engine request id, f"{request_id}-0"
    token_ids: list[int] = []  # tokenize: the prompt's ids, media placeholders included
    token_strs: list[str] | None = None  # tokenize with return_token_strs: convert_ids_to_tokens
    text: str | None = None  # detokenize: the ids' text, special tokens included (as vLLM answers)


class ProfileDone(Message):
    """The profiler of one process started, or stopped with its trace written to `path`
    (core -> detokenizer -> api; a worker -> api)."""

    started: bool
    path: str | None = None
    error: str | None = None
    process: str = "engine-core"


CoreInbound = EngineRequest | Abort | ProfileControl
DetokInbound = CoreReady | EngineOutputs | ProfileDone
ApiInbound = CoreReady | ApiOutputs | WorkerReady | PreprocessDone | TokenizeResult | RequestError | ProfileDone
WorkerInbound = PreprocessRequest | ProfileControl


# ---- codec -----------------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()


def encode(message: msgspec.Struct, frames: list[Any] | None = None) -> list[Any]:
    """The multipart message: the msgpack header then the raw frames."""
    return [_encoder.encode(message), *(frames or ())]


class Decoder:
    """Decodes the header frame of one socket's messages into its union of types."""

    def __init__(self, kind: Any) -> None:
        self._decoder = msgspec.msgpack.Decoder(kind)

    def decode(self, parts: list[Any]) -> tuple[Any, list[Any]]:
        head = parts[0]
        buffer = head.buffer if hasattr(head, "buffer") else head
        return self._decoder.decode(buffer), parts[1:]


# ---- where the sockets live ------------------------------------------------------------------------


@dataclass(frozen=True)
class IpcPaths:
    """The socket addresses of one server run, all inside one private temp directory."""

    root: Path

    def _addr(self, name: str) -> str:
        return f"ipc://{self.root / name}"

    @property
    def core(self) -> str:
        return self._addr("core.sock")

    @property
    def detokenizer(self) -> str:
        return self._addr("detok.sock")

    @property
    def api(self) -> str:
        return self._addr("api.sock")

    def worker(self, index: int) -> str:
        return self._addr(f"worker{index}.sock")
