"""Engine configuration: one frozen record shared by scheduler, cache and runner."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

DEFAULT_MODEL = "placard-default"  # the embedded default that sees images (vlm_engine/models/placard/)
NUMERICS = ("fast", "exact")
QUANTIZATIONS = ("int8", "int4")  # weight-only schemes of vlm_engine.models.quantized


@dataclass(frozen=True)
class EngineConfig:
    model: str
    dtype: str = "auto"  # "auto" | "float32" | "bfloat16" | "float16"
    device: str = "auto"  # "auto" | "cpu" | "cuda"
    max_num_seqs: int = 64  # most requests in one running batch
    max_num_batched_tokens: int = 2048  # token budget of one step (prefill chunks + decodes)
    kv_cache_tokens: int | None = None  # None: size the pool from free memory
    page_size: int = 16  # tokens per KV page; also the prefix-cache granularity
    enable_prefix_cache: bool = True
    enable_chunked_prefill: bool = True
    max_model_len: int | None = None  # None: the model's limit, capped by the KV pool
    attention_backend: str = "auto"  # see vlm_engine.attention.backends
    # "fast": the CPU kernels fastest here (oneDNN-packed linears, fused C++ norm/rotary/SiLU), equal
    # to Transformers within float tolerance; "exact": Transformers' own ops, token-for-token parity.
    numerics: str = "fast"
    # Weight-only "int8" / "int4" decoder linears on CPU (vlm_engine.models.quantized); None: off.
    quantization: str | None = None
    prepack_weights: bool = True  # fast numerics on CPU: linears in oneDNN's blocked layout (models.prepack)
    fused_cpu_ops: bool = True  # fast numerics on CPU: C++ norm/rotary/SiLU ops (models.fused_ops)
    encoder_cache_bytes: int = 256 * 1024 * 1024  # vision-encoder outputs kept by content hash
    cpu_kv_cache_fraction: float = 0.25  # of MemAvailable, when kv_cache_tokens is None on CPU
    cpu_kv_cache_max_bytes: int = 4 * 1024**3
    gpu_memory_utilization: float = 0.9
    # Speculative decoding (vlm_engine.speculative): None (off), "ngram" (prompt lookup) or
    # "draft:PATH" (a smaller model with the same vocabulary); up to num_speculative_tokens a step.
    speculative: str | None = None
    num_speculative_tokens: int = 4
    speculative_ngram_min: int = 1
    speculative_ngram_max: int = 4
    speculative_disable_batch_size: int = 8  # steps starting with this many running requests do not speculate
    speculative_draft_quantization: str | None = None  # "int8" / "int4": the draft model's weight-only linears
    # preprocess.media.MediaLimits for images and videos the prompts name (URLs, local paths); None:
    # the secure defaults (public http(s) URLs only, no local paths).
    media_limits: Any = None

    def __post_init__(self) -> None:
        if self.numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {self.numerics!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        if self.quantization and self.dtype not in ("auto", "float32"):
            raise ValueError(f"quantization keeps float32 activations; dtype {self.dtype!r} cannot be combined with it")
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.speculative is not None and self.speculative != "ngram" and not self.speculative.startswith("draft:"):
            raise ValueError(f"speculative must be 'ngram' or 'draft:PATH', got {self.speculative!r}")
        if self.speculative_draft_quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"speculative_draft_quantization must be one of {QUANTIZATIONS} or None")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ValueError("kv_cache_tokens must hold at least one page")
