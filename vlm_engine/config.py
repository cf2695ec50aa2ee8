"""Engine configuration: a tree of frozen sections (model, cache, scheduler, speculative, media).

Every option is one field, written once: its default and its help text (`metadata["help"]`) sit on
the field, and the rest is derived from them: `vlm-engine serve`'s flags (vlm_engine.cli), the flat
keyword arguments `Engine(...)` takes (`from_flat`), and the server's `ServerConfig`, which holds an
`EngineConfig`. Option names are unique across the tree (the server's sections included), so a flat
name says which section it belongs to.

Torch-free: the API process imports it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass
from typing import Any, Self, TypeVar

DEFAULT_MODEL = "placard-default"  # the embedded default that sees images (vlm_engine/models/placard/)
DTYPES = ("auto", "float32", "bfloat16", "float16")
NUMERICS = ("fast", "exact")
QUANTIZATIONS = ("int8", "int4")  # weight-only schemes of vlm_engine.models.quantized

T = TypeVar("T")


# ---- the field helpers every section uses ----------------------------------------------------


def doc(help: str, **cli: Any) -> dict[str, Any]:
    """A field's metadata: its help text, and what tunes its generated flag: `parse` (text -> value,
    as argparse's `type`), `choices` (a tuple, or a callable that gives them, for choices whose
    module is heavy to import), `metavar`, `env` (an environment variable the flag defaults to).
    Sections are `field(default_factory=TheSection)`."""
    return {"help": help, **cli}


def section_class(f: Field[Any]) -> type | None:
    """The section class a field holds, or None for an option."""
    factory = f.default_factory
    return factory if factory is not MISSING and is_dataclass(factory) else None  # type: ignore[return-value]


def leaf_fields(cls: type, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], type, Field[Any]]]:
    """Every option of a config tree, depth first: (the section path, the section class, the field)."""
    for f in fields(cls):
        sub = section_class(f)
        if sub is not None:
            yield from leaf_fields(sub, (*path, f.name))
        else:
            yield path, cls, f


class FlatOptions:
    """Flat access to a config tree: `from_flat(page_size=32, speculative="ngram")` routes each name
    to its section (an unknown name is a TypeError, as for any keyword argument); `flat()` is the
    reverse, every option by name."""

    @classmethod
    def from_flat(cls, **values: Any) -> Self:
        remaining = dict(values)
        config = _build(cls, remaining)
        if remaining:
            raise TypeError(f"{cls.__name__} has no option {', '.join(map(repr, sorted(remaining)))}")
        return config

    def flat(self) -> dict[str, Any]:
        values: dict[str, Any] = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            values.update(FlatOptions.flat(value) if section_class(f) is not None else {f.name: value})
        return values


def _build(cls: type[T], remaining: dict[str, Any]) -> T:
    kwargs = {}
    for f in fields(cls):  # type: ignore[arg-type]
        sub = section_class(f)
        if sub is not None:
            kwargs[f.name] = _build(sub, remaining)
        elif f.name in remaining:
            kwargs[f.name] = remaining.pop(f.name)
    return cls(**kwargs)


# ---- text -> value parsers the flags use (argparse shows their messages) ---------------------


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {value}")
    return value


def speculative_method(text: str) -> str:
    if text == "ngram" or (text.startswith("draft:") and len(text) > len("draft:")):
        return text
    raise argparse.ArgumentTypeError(f"must be 'ngram' or 'draft:PATH', got {text!r}")


def comma_list(text: str) -> tuple[str, ...] | None:
    """`a.com, b.org` -> ("a.com", "b.org"); nothing listed -> None."""
    return tuple(item.strip() for item in text.split(",") if item.strip()) or None


def text_or_none(text: str) -> str | None:
    return text or None


@dataclass(frozen=True)
class MediaPerPrompt:
    """How many media parts of each modality one prompt may hold."""

    image: int = 8
    video: int = 2

    def __post_init__(self) -> None:
        if self.image < 0 or self.video < 0:
            raise ValueError("limit_mm_per_prompt must be >= 0 for every modality")

    def __str__(self) -> str:
        return f"image={self.image},video={self.video}"


def mm_limit(text: str) -> MediaPerPrompt:
    """`8` (images), `image=8,video=2` or the vLLM JSON form `{"image": 8, "video": 2}`; a modality
    left out keeps its default."""
    text = text.strip()
    if text.startswith("{"):
        import json

        limits = {str(k): int(v) for k, v in json.loads(text).items()}
    elif "=" in text:
        limits = {}
        for item in text.split(","):
            key, _, value = item.partition("=")
            limits[key.strip()] = int(value)
    else:
        limits = {"image": int(text)}
    unknown = set(limits) - {"image", "video"}
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown modality {min(unknown)!r}; use image and video")
    return MediaPerPrompt(**limits)


# ---- the engine's sections ---------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """The model: which one, in what dtype, on which device, with which kernels."""

    model: str = field(
        default=DEFAULT_MODEL, metadata=doc(f"local directory, .gguf file, hub id, or the embedded {DEFAULT_MODEL!r}")
    )
    served_model_name: str | None = field(
        default=None, metadata=doc("the model id clients use (default: the model argument)", metavar="NAME")
    )
    dtype: str = field(
        default="auto",
        metadata=doc("weights and activations; auto: the checkpoint's, unless the device is bad at it", choices=DTYPES),
    )
    device: str = field(default="auto", metadata=doc("auto (CUDA when present), cpu or cuda"))
    max_model_len: int | None = field(
        default=None,
        metadata=doc("longest prompt + output (default: the model's limit, capped by the KV pool)", parse=positive_int),
    )
    numerics: str = field(
        default="fast",
        metadata=doc(
            "fast: the CPU kernels fastest here (oneDNN-packed linears, fused C++ norm/rotary/SiLU), equal to "
            "Transformers within float tolerance; exact: Transformers' own ops, token-for-token parity",
            choices=NUMERICS,
        ),
    )
    quantization: str | None = field(
        default=None,
        metadata=doc(
            "weight-only int8/int4 decoder linears on CPU (llama.cpp's Q8_0/Q4_1 schemes; a Q4_1 GGUF keeps its codes)",
            choices=QUANTIZATIONS,
        ),
    )
    prepack_weights: bool = field(
        default=True, metadata=doc("fast numerics on CPU: linears in oneDNN's blocked layout (models.prepack)")
    )
    fused_cpu_ops: bool = field(
        default=True, metadata=doc("fast numerics on CPU: C++ norm/rotary/SiLU ops (models.fused_ops)")
    )
    attention_backend: str = field(
        default="auto", metadata=doc("the paged-attention kernels (vlm_engine.attention.backends)", metavar="NAME")
    )

    def __post_init__(self) -> None:
        if self.numerics not in NUMERICS:
            raise ValueError(f"numerics must be one of {NUMERICS}, got {self.numerics!r}")
        if self.quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        if self.quantization and self.dtype not in ("auto", "float32"):
            raise ValueError(f"quantization keeps float32 activations; dtype {self.dtype!r} cannot be combined with it")


@dataclass(frozen=True)
class CacheConfig:
    """The KV page pool, the prefix cache and the vision-encoder cache."""

    page_size: int = field(
        default=16, metadata=doc("tokens per KV page; also the prefix-cache granularity", parse=positive_int)
    )
    kv_cache_tokens: int | None = field(
        default=None,
        metadata=doc(
            "KV pool size in tokens (default: from free memory); sliding-window layers get a pool sized "
            "for their windows",
            parse=positive_int,
        ),
    )
    enable_prefix_cache: bool = field(default=True, metadata=doc("reuse the KV pages of a prompt's cached prefix"))
    disable_sliding_window: bool = field(
        default=False,
        metadata=doc(
            "sliding-window layers attend to the whole context, their KV kept in full (for comparisons: "
            "outputs then differ from the model's)"
        ),
    )
    encoder_cache_bytes: int = field(
        default=256 * 1024 * 1024, metadata=doc("vision-encoder outputs kept by content hash")
    )
    cpu_kv_cache_fraction: float = field(
        default=0.25, metadata=doc("on CPU without kv_cache_tokens: the share of MemAvailable for KV")
    )
    cpu_kv_cache_max_bytes: int = field(
        default=4 * 1024**3, metadata=doc("on CPU without kv_cache_tokens: the most bytes for KV")
    )
    gpu_memory_utilization: float = field(
        default=0.9, metadata=doc("on CUDA: the share of GPU memory the engine may fill")
    )

    def __post_init__(self) -> None:
        if self.page_size < 1:
            raise ValueError("page_size must be >= 1")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ValueError("kv_cache_tokens must hold at least one page")


@dataclass(frozen=True)
class SchedulingConfig:
    """How much one step may batch."""

    max_num_seqs: int = field(default=64, metadata=doc("most requests in one running batch", parse=positive_int))
    max_num_batched_tokens: int = field(
        default=2048, metadata=doc("token budget of one step (prefill chunks + decodes)", parse=positive_int)
    )
    enable_chunked_prefill: bool = field(default=True, metadata=doc("split a long prompt's prefill over several steps"))

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError("max_num_seqs must be >= 1")
        if self.max_num_batched_tokens < 1:
            raise ValueError("max_num_batched_tokens must be >= 1")


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (vlm_engine.speculative)."""

    speculative: str | None = field(
        default=None,
        metadata=doc(
            "speculative decoding: 'ngram' (prompt lookup) or 'draft:PATH' (a smaller model, same vocabulary)",
            parse=speculative_method,
            metavar="METHOD",
        ),
    )
    num_speculative_tokens: int = field(default=4, metadata=doc("draft tokens per step", parse=positive_int))
    speculative_ngram_min: int = field(default=1, metadata=doc("shortest n-gram matched", parse=positive_int))
    speculative_ngram_max: int = field(default=4, metadata=doc("longest n-gram matched", parse=positive_int))
    speculative_disable_batch_size: int = field(
        default=8,
        metadata=doc(
            "steps that start with this many running requests do not speculate (the batch is compute-bound)",
            parse=positive_int,
        ),
    )
    speculative_draft_quantization: str | None = field(
        default=None,
        metadata=doc(
            "weight-only int8/int4 linears for the draft model (draft:PATH with the target's own path: a quantized "
            "self-draft)",
            choices=QUANTIZATIONS,
        ),
    )

    def __post_init__(self) -> None:
        if self.speculative is not None and self.speculative != "ngram" and not self.speculative.startswith("draft:"):
            raise ValueError(f"speculative must be 'ngram' or 'draft:PATH', got {self.speculative!r}")
        if self.speculative_draft_quantization not in (None, *QUANTIZATIONS):
            raise ValueError(f"speculative_draft_quantization must be one of {QUANTIZATIONS} or None")
        if self.num_speculative_tokens < 1:
            raise ValueError("num_speculative_tokens must be >= 1")

    @property
    def draft_path(self) -> str | None:
        """The draft model of 'draft:PATH'; None for n-gram lookup or no speculation."""
        if self.speculative is None or not self.speculative.startswith("draft:"):
            return None
        return self.speculative.removeprefix("draft:")


@dataclass(frozen=True)
class MediaConfig:
    """Images and videos the prompts name: what may be fetched, how much, how videos are sampled."""

    limit_mm_per_prompt: MediaPerPrompt = field(
        default=MediaPerPrompt(),
        metadata=doc(
            'media per prompt: 8 (images), image=8,video=2 or \'{"image": 8, "video": 2}\'',
            parse=mm_limit,
            metavar="LIMITS",
        ),
    )
    allowed_local_media_path: str | None = field(
        default=None,
        metadata=doc("serve local media files from under this directory (default: no local paths)", metavar="DIR"),
    )
    max_image_bytes: int = field(
        default=20 * 1024 * 1024, metadata=doc("encoded size of one image", parse=positive_int)
    )
    max_video_bytes: int = field(
        default=64 * 1024 * 1024, metadata=doc("encoded size of one video", parse=positive_int)
    )
    max_file_bytes: int = field(
        default=32 * 1024 * 1024, metadata=doc("encoded size of one file part (a PDF)", parse=positive_int)
    )
    max_video_seconds: float = field(default=600.0, metadata=doc("longest video", parse=positive_float))
    max_video_pixels: int = field(
        default=256 * 1280 * 720,
        metadata=doc("decoded pixels per video (sampled frames x width x height)", parse=positive_int),
    )
    video_fps: float = field(
        default=2.0,
        metadata=doc(
            "frames sampled per second of video (a part or mm_processor_kwargs may override)", parse=positive_float
        ),
    )
    video_max_frames: int = field(default=32, metadata=doc("most frames sampled per video", parse=positive_int))
    video_frame_cache_mb: int = field(
        default=512, metadata=doc("MiB of decoded frames each preprocess worker keeps for repeats (0: none)")
    )
    video_device: str = field(
        default="auto",
        metadata=doc(
            "where frames are resized/normalized (decoding is always PyAV on the CPU)", choices=("auto", "cpu", "cuda")
        ),
    )
    media_fetch_timeout_s: float = field(
        default=5.0, metadata=doc("seconds for an image URL's whole download (vLLM's default)")
    )
    video_fetch_timeout_s: float = field(default=30.0, metadata=doc("seconds for a video URL's whole download"))
    max_redirects: int = field(default=3, metadata=doc("redirects a media URL may take"))
    allow_private_media_urls: bool = field(
        default=False,
        metadata=doc(
            "let media URLs reach loopback, private and link-local addresses (intranets, tests; refused: SSRF)"
        ),
    )
    allowed_media_domains: tuple[str, ...] | None = field(
        default=None,
        metadata=doc(
            "comma-separated hosts media may be fetched from (a domain admits its subdomains; default: any public one)",
            parse=comma_list,
            metavar="HOSTS",
        ),
    )
    media_time_budget_s: float = field(
        default=60.0,
        metadata=doc("seconds one request's media may take to fetch and decode, all parts together (0: no budget)"),
    )
    max_concurrent_media_fetches: int = field(
        default=64,
        metadata=doc(
            "media URL downloads in flight at once in the API process, over all requests (more wait their turn)"
        ),
    )

    def __post_init__(self) -> None:
        if self.media_time_budget_s < 0 or self.max_concurrent_media_fetches < 1:
            raise ValueError("media_time_budget_s must be >= 0 and max_concurrent_media_fetches >= 1")
        if not self.video_fps > 0 or self.video_max_frames < 1:
            raise ValueError("video_fps must be positive and video_max_frames at least 1")

    @property
    def video_frame_cache_bytes(self) -> int:
        return max(0, self.video_frame_cache_mb) * 2**20

    def fetch_limits(self) -> Any:
        """preprocess.media.MediaLimits: what a prompt's media URLs and paths may reach and weigh."""
        from preprocess.media import MediaLimits

        return MediaLimits(
            max_image_bytes=self.max_image_bytes,
            max_video_bytes=self.max_video_bytes,
            max_file_bytes=self.max_file_bytes,
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


@dataclass(frozen=True)
class EngineConfig(FlatOptions):
    """Everything the engine is built from; `Engine(model, **flat)` is `EngineConfig.from_flat`."""

    model: ModelConfig = field(default_factory=ModelConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulingConfig = field(default_factory=SchedulingConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    media: MediaConfig = field(default_factory=MediaConfig)


def resolve_choices(choices: tuple[str, ...] | Callable[[], Any] | None) -> list[str] | None:
    """A field's `choices` metadata as a list (a callable is called: its module loads only now)."""
    if choices is None:
        return None
    return list(choices() if callable(choices) else choices)
