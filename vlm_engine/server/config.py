"""Server configuration: one frozen record, built by the CLI and shipped to every child process."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from vlm_engine.config import DEFAULT_MODEL


@dataclass(frozen=True)
class ServerConfig:
    model: str = DEFAULT_MODEL
    served_model_name: str | None = None  # None: the model argument
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None
    preprocess_workers: int = 1

    # Engine (passed through to vlm_engine.Engine / EngineConfig).
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    kv_cache_tokens: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    enable_prefix_cache: bool = True
    attention_backend: str = "auto"
    numerics: str = "fast"  # EngineConfig.numerics: "fast" kernels, or Transformers' "exact" ops
    quantization: str | None = None  # EngineConfig.quantization: "int8" / "int4" weight-only linears
    speculative: str | None = None  # EngineConfig.speculative: "ngram" | "draft:PATH"
    num_speculative_tokens: int = 4
    speculative_ngram_max: int = 4
    speculative_disable_batch_size: int = 8
    speculative_draft_quantization: str | None = None

    # Admission and input limits.
    max_waiting_requests: int = 1024  # engine requests accepted but not yet running; more -> 503
    limit_mm_per_prompt: int = 8  # images
    limit_videos_per_prompt: int = 2
    allowed_local_media_path: str | None = None
    max_image_bytes: int = 20 * 1024 * 1024
    # Video: default sampling (a part or mm_processor_kwargs may override) and limits.
    video_fps: float = 2.0
    video_max_frames: int = 32
    max_video_bytes: int = 64 * 1024 * 1024
    max_video_seconds: float = 600.0
    max_video_pixels: int = 256 * 1280 * 720  # sampled frames x width x height, per video
    video_frame_cache_bytes: int = 512 * 1024 * 1024  # decoded frames kept per worker for repeats
    video_device: str = "auto"  # resize/normalize of frames: auto (CUDA when present) | cpu | cuda
    media_fetch_timeout_s: float = 5.0  # an image URL's whole download (vLLM's default)
    video_fetch_timeout_s: float = 30.0
    allow_private_media_urls: bool = False  # fetch from loopback/private/link-local addresses (intranets, tests)
    allowed_media_domains: tuple[str, ...] | None = None  # only these hosts (and subdomains); None: any public one
    max_redirects: int = 3
    # One request's media, fetch and decode together; past it the request is a 400 (0: no budget).
    media_time_budget_s: float = 60.0
    max_concurrent_media_fetches: int = 64  # URL downloads in flight in the API process
    # Backpressure: the Retry-After a 503 "overloaded" answer suggests, in seconds.
    retry_after_s: int = 1
    max_n: int = 16  # most choices (n x prompts) in one request
    max_request_bytes: int = 64 * 1024 * 1024  # JSON body cap (413 above it); images come base64-encoded
    tool_call_parser: str = "hermes"  # how tool_choice="auto" finds calls in text (server.tool_parsers)

    # Web: a static app hosted next to the API (server.apps), and the origins allowed by CORS
    # (empty: same origin only; ("*",) lets a page served anywhere call this server).
    app: str | None = None
    allowed_origins: tuple[str, ...] = ()

    # Observability (docs/ARCHITECTURE.md, "Observability").
    replica_id: str | None = None  # the `replica` label of every metric; None: hostname:port
    log_stats: bool = True  # metrics, per-step histograms and the status line (--disable-log-stats: off)
    log_stats_interval_s: float = 10.0  # the periodic status line; 0: never
    request_log: str | None = None  # a JSON-lines file: one line per finished request, token ids included
    profile_dir: str | None = None  # enables POST /start_profile and /stop_profile (torch profiler traces)

    # Process behaviour.
    shutdown_timeout_s: float = 5.0  # grace for in-flight requests on SIGTERM before they are aborted
    # API, preprocess and detokenizer yield the cores to the engine core. Measured (SmolLM2, 2 cores,
    # streaming, concurrency 64, bf16): nice 10 and 19 give the same tokens/s, but at 19 the API and
    # detokenizer get too little CPU while the core is saturated (ITL p50 ~190 ms vs ~110 ms, TTFT
    # ~2.2 s vs ~1.5 s); nice 0 costs ~8% tokens/s at concurrency 16.
    side_process_nice: int = 10
    warmup: bool = True
    log_level: str = "info"

    def __post_init__(self) -> None:
        if self.preprocess_workers < 1:
            raise ValueError("preprocess_workers must be >= 1")
        if self.max_waiting_requests < 0:
            raise ValueError("max_waiting_requests must be >= 0")
        if self.limit_mm_per_prompt < 0 or self.limit_videos_per_prompt < 0:
            raise ValueError("limit_mm_per_prompt must be >= 0 for every modality")
        if self.log_stats_interval_s < 0:
            raise ValueError("log_stats_interval_s must be >= 0")
        if self.media_time_budget_s < 0 or self.max_concurrent_media_fetches < 1:
            raise ValueError("media_time_budget_s must be >= 0 and max_concurrent_media_fetches >= 1")
        if not self.video_fps > 0 or self.video_max_frames < 1:
            raise ValueError("video_fps must be positive and video_max_frames at least 1")
        from vlm_engine.server.apps import APPS
        from vlm_engine.server.tool_parsers import TOOL_PARSERS

        if self.app is not None and self.app not in APPS:
            raise ValueError(f"app must be one of {sorted(APPS)}")

        if self.tool_call_parser not in TOOL_PARSERS:
            raise ValueError(f"tool_call_parser must be one of {sorted(TOOL_PARSERS)}")

    @property
    def model_name(self) -> str:
        return self.served_model_name or self.model

    @property
    def replica(self) -> str:
        import socket

        return self.replica_id or f"{socket.gethostname()}:{self.port}"

    def engine_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {
            "dtype": self.dtype,
            "device": self.device,
            "max_num_seqs": self.max_num_seqs,
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "kv_cache_tokens": self.kv_cache_tokens,
            "enable_prefix_cache": self.enable_prefix_cache,
            "attention_backend": self.attention_backend,
            "numerics": self.numerics,
            "quantization": self.quantization,
            "speculative": self.speculative,
            "num_speculative_tokens": self.num_speculative_tokens,
            "speculative_ngram_max": self.speculative_ngram_max,
            "speculative_disable_batch_size": self.speculative_disable_batch_size,
            "speculative_draft_quantization": self.speculative_draft_quantization,
        }
        if self.max_model_len is not None:
            kwargs["max_model_len"] = self.max_model_len
        return kwargs

    def media_limits(self) -> Any:
        from preprocess.media import MediaLimits

        return MediaLimits(
            max_image_bytes=self.max_image_bytes,
            max_video_bytes=self.max_video_bytes,
            fetch_timeout_s=self.media_fetch_timeout_s,
            video_fetch_timeout_s=self.video_fetch_timeout_s,
            max_redirects=self.max_redirects,
            allowed_local_media_path=self.allowed_local_media_path,
            allow_private_urls=self.allow_private_media_urls,
            allowed_domains=self.allowed_media_domains,
        )

    def video_limits(self) -> Any:
        from preprocess.video import VideoLimits

        return VideoLimits(
            max_video_bytes=self.max_video_bytes,
            max_duration_s=self.max_video_seconds,
            max_decoded_pixels=self.max_video_pixels,
        )

    def video_sampling(self) -> Any:
        from preprocess.video import VideoSampling

        return VideoSampling(fps=self.video_fps, max_frames=self.video_max_frames)
