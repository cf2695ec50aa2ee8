"""Engine configuration: a tree of frozen sections (model, cache, scheduler, speculative, media).

Every option is one field, written once: its default and its help text (`metadata["help"]`) sit on
the field, and the rest is derived from them: `vlm-engine serve`'s flags (vlm_engine.cli), the flat
keyword arguments `Engine(...)` takes (`from_flat`), and the server's `ServerConfig`, which holds an
`EngineConfig`. Option names are unique across the tree (the server's sections included), so a flat
name says which section it belongs to. Preprocessing reads `MediaConfig` itself (its limits, its
video sampling): there is no second record of those defaults.

Each option's rule (`check`, `choices`) is written once, on its field: a section checks every field
when it is built (`Section`), and a flag checks its value as it parses, with the same text.

Torch-free: the API process imports it.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator
from dataclasses import MISSING, Field, dataclass, field, fields, is_dataclass, replace
from typing import Any, Self, TypeVar

DEFAULT_MODEL = "placard-default"  # the embedded default that sees images (vlm_engine/models/families/placard/)
DTYPES = ("auto", "float32", "bfloat16", "float16")
NUMERICS = ("fast", "exact")
QUANTIZATIONS = ("int8", "int4")  # weight-only schemes of vlm_engine.models.quantized
WEIGHT_LAYOUTS = ("one", "two")  # how many layouts a packed bf16 linear keeps (vlm_engine.models.prepack)

T = TypeVar("T")


# ---- the field helpers every section uses ----------------------------------------------------


def doc(help: str, **cli: Any) -> dict[str, Any]:
    """A field's metadata: its help text, its rule (`check`: a value -> what is wrong with it, or
    None; `choices`: a tuple, or a callable that gives them, for choices whose module is heavy to
    import), and what tunes its generated flag: `parse` (text -> value, as argparse's `type`; a
    conversion, not a check), `metavar`, `env` (an environment variable the flag defaults to), `flag`
    (the flag's name where it is not derived from the field's; no dashes: a positional argument),
    `repeat` (the flag may be given several times; the field holds the list).
    Sections are `field(default_factory=TheSection)`."""
    return {"help": help, **cli}


Check = Callable[[Any], "str | None"]


def at_least(minimum: float) -> Check:
    return lambda value: None if value >= minimum else f"must be >= {minimum}, got {value}"


def above(minimum: float) -> Check:
    return lambda value: None if value > minimum else f"must be > {minimum}, got {value}"


def option_problem(f: Field[Any], value: Any) -> str | None:
    """What is wrong with `value` for option `f` by its `check` (None is the unset value of an
    optional option). `choices` are argparse's to check on the command line."""
    check = f.metadata.get("check")
    return None if check is None or value is None else check(value)


class Section:
    """A config section: building one checks every option's rule (`check`, then `choices`), so
    `Engine(max_num_seqs=0)` fails with the text `--max-num-seqs 0` gives. Sections with rules across
    options extend `__post_init__`."""

    def __post_init__(self) -> None:
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            problem = option_problem(f, value)
            choices = resolve_choices(f.metadata.get("choices"))
            if problem is None and choices is not None and value is not None and value not in choices:
                problem = f"must be one of {', '.join(choices)}, got {value!r}"
            if problem is not None:
                raise ValueError(f"{f.name} {problem}")


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


# ---- text -> value conversions some flags use (argparse shows their messages) ----------------


def speculative_method(value: str) -> str | None:
    if value == "ngram" or (value.startswith("draft:") and len(value) > len("draft:")):
        return None
    return f"must be 'ngram' or 'draft:PATH', got {value!r}"


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
class ModelConfig(Section):
    """The model: which one, in what dtype, on which device, with which kernels."""

    model: str = field(
        default=DEFAULT_MODEL, metadata=doc(f"local directory, .gguf file, hub id, or the embedded {DEFAULT_MODEL!r}")
    )
    mmproj: str | None = field(
        default=None,
        metadata=doc(
            "with a text .gguf model: llama.cpp's vision GGUF of the same model (a directory holding both finds "
            "it by itself)",
            metavar="FILE",
        ),
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
        metadata=doc("longest prompt + output (default: the model's limit, capped by the KV pool)", check=at_least(1)),
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
    quantize_vision: bool = field(
        default=False,
        metadata=doc("with quantization: the vision encoder's linears too, 8 bits (else they keep the model's dtype)"),
    )
    prepack_weights: bool = field(
        default=True, metadata=doc("fast numerics on CPU: linears in oneDNN's blocked layout (models.prepack)")
    )
    fused_cpu_ops: bool = field(
        default=True, metadata=doc("fast numerics on CPU: C++ norm/rotary/SiLU ops (models.fused_ops)")
    )
    weight_layouts: str = field(
        default="one",
        metadata=doc(
            "fast numerics on CPU: a packed bf16 linear's weight held once, in the layout of the decode "
            "kernels (one), or also in oneDNN's for prefill-sized products (two: twice the memory)",
            choices=WEIGHT_LAYOUTS,
        ),
    )
    attention_backend: str = field(
        default="auto", metadata=doc("the paged-attention kernels (vlm_engine.attention.backends)", metavar="NAME")
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.quantization and self.dtype == "float16":
            raise ValueError("quantized linears take bfloat16 or float32 activations; dtype 'float16' is neither")
        if self.quantize_vision and not self.quantization:
            raise ValueError("quantize_vision quantizes the vision encoder along with the decoder: give quantization")


@dataclass(frozen=True)
class CacheConfig(Section):
    """The KV page pool, the prefix cache and the vision-encoder cache."""

    page_size: int = field(
        default=16, metadata=doc("tokens per KV page; also the prefix-cache granularity", check=at_least(1))
    )
    kv_cache_tokens: int | None = field(
        default=None,
        metadata=doc(
            "KV pool size in tokens (default: from free memory); sliding-window layers get a pool sized "
            "for their windows",
            check=at_least(1),
        ),
    )
    enable_prefix_cache: bool = field(default=True, metadata=doc("reuse the KV pages of a prompt's cached prefix"))
    state_snapshots: int = field(
        default=16,
        metadata=doc(
            "models with linear-attention layers: prefix-cache snapshots of their per-sequence state kept "
            "(each as large as one request's state; a prefix hit resumes only where one was kept; 0: no hits)",
            check=at_least(0),
        ),
    )
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
        super().__post_init__()
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.page_size:
            raise ValueError("kv_cache_tokens must hold at least one page")


@dataclass(frozen=True)
class SchedulingConfig(Section):
    """How much one step may batch."""

    max_num_seqs: int = field(default=64, metadata=doc("most requests in one running batch", check=at_least(1)))
    max_num_batched_tokens: int = field(
        default=2048, metadata=doc("token budget of one step (prefill chunks + decodes)", check=at_least(1))
    )
    enable_chunked_prefill: bool = field(default=True, metadata=doc("split a long prompt's prefill over several steps"))


@dataclass(frozen=True)
class SpeculativeConfig(Section):
    """Speculative decoding (vlm_engine.speculative)."""

    speculative: str | None = field(
        default=None,
        metadata=doc(
            "speculative decoding: 'ngram' (prompt lookup) or 'draft:PATH' (a smaller model, same vocabulary)",
            check=speculative_method,
            metavar="METHOD",
        ),
    )
    num_speculative_tokens: int = field(default=4, metadata=doc("draft tokens per step", check=at_least(1)))
    speculative_ngram_min: int = field(default=1, metadata=doc("shortest n-gram matched", check=at_least(1)))
    speculative_ngram_max: int = field(default=4, metadata=doc("longest n-gram matched", check=at_least(1)))
    speculative_disable_batch_size: int = field(
        default=8,
        metadata=doc(
            "steps that start with this many running requests do not speculate (the batch is compute-bound)",
            check=at_least(1),
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

    @property
    def draft_path(self) -> str | None:
        """The draft model of 'draft:PATH'; None for n-gram lookup or no speculation."""
        if self.speculative is None or not self.speculative.startswith("draft:"):
            return None
        return self.speculative.removeprefix("draft:")


@dataclass(frozen=True)
class MediaConfig(Section):
    """Images, videos and files the prompts name: what may be fetched, how much, how videos are
    sampled. Preprocessing reads it as it is (preprocess.media, .video, .prompt); a request's own
    video sampling (`fps`, `max_frames`) is this config with `video_fps` / `video_max_frames` replaced
    (`sampled_at`)."""

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
        metadata=doc(
            "serve local media files from under this directory, symlinks and '..' resolved (default: no local paths)",
            # realpath("") is the working directory: an empty value is a mistake, not a request to expose it.
            check=lambda path: None if path else "must be a directory, got ''",
            metavar="DIR",
        ),
    )
    max_image_bytes: int = field(
        default=20 * 1024 * 1024, metadata=doc("encoded size of one image", check=at_least(1))
    )
    max_image_pixels: int = field(
        default=40_000_000,
        metadata=doc("pixels of one image (width x height), read from its header before decoding", check=at_least(1)),
    )
    max_video_bytes: int = field(
        default=64 * 1024 * 1024, metadata=doc("encoded size of one video", check=at_least(1))
    )
    max_file_bytes: int = field(
        default=32 * 1024 * 1024, metadata=doc("encoded size of one file part (a PDF)", check=at_least(1))
    )
    max_video_seconds: float = field(default=600.0, metadata=doc("longest video", check=above(0)))
    max_video_pixels: int = field(
        default=256 * 1280 * 720,
        metadata=doc("decoded pixels per video (sampled frames x width x height)", check=at_least(1)),
    )
    max_video_frame_pixels: int = field(
        default=4096 * 2160, metadata=doc("pixels of one video frame (width x height)", check=at_least(1))
    )
    max_video_frames: int = field(
        default=256,
        metadata=doc("most frames a request may sample from one video (its fps and max_frames)", check=at_least(1)),
    )
    video_fps: float = field(
        default=2.0,
        metadata=doc("frames sampled per second of video (a part or mm_processor_kwargs may override)", check=above(0)),
    )
    video_max_frames: int = field(default=32, metadata=doc("most frames sampled per video", check=at_least(1)))
    video_frame_cache_mb: int = field(
        default=512, metadata=doc("MiB of decoded frames each preprocess worker keeps for repeats (0: none)")
    )
    video_device: str = field(
        default="auto",
        metadata=doc(
            "where frames are resized/normalized (decoding is always PyAV on the CPU)", choices=("auto", "cpu", "cuda")
        ),
    )
    # A download's time limit is per network operation and for the whole download (vLLM's defaults).
    media_fetch_timeout_s: float = field(
        default=5.0, metadata=doc("seconds for an image URL's whole download (vLLM's default)", check=above(0))
    )
    video_fetch_timeout_s: float = field(
        default=30.0, metadata=doc("seconds for a video or file URL's whole download", check=above(0))
    )
    max_redirects: int = field(default=3, metadata=doc("redirects a media URL may take", check=at_least(0)))
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
        metadata=doc(
            "seconds one request's media may take to fetch and decode, all parts together (0: no budget)",
            check=at_least(0),
        ),
    )
    max_concurrent_media_fetches: int = field(
        default=64,
        metadata=doc(
            "media URL downloads in flight at once in the API process, over all requests (more wait their turn)",
            check=at_least(1),
        ),
    )

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.video_max_frames > self.max_video_frames:
            raise ValueError(
                f"video_max_frames {self.video_max_frames} is above max_video_frames {self.max_video_frames}"
            )
        if self.allowed_media_domains is not None:  # hosts compare lowercased, without the root's dot
            domains = tuple(d.strip().lower().rstrip(".") for d in self.allowed_media_domains if d.strip())
            object.__setattr__(self, "allowed_media_domains", domains)

    @property
    def video_frame_cache_bytes(self) -> int:
        return max(0, self.video_frame_cache_mb) * 2**20

    def max_bytes(self, kind: str) -> int:
        """The encoded-size cap of an "image", "video" or "file" part."""
        return {"video": self.max_video_bytes, "file": self.max_file_bytes}.get(kind, self.max_image_bytes)

    def timeout_s(self, kind: str) -> float:
        """The download time limit of an "image", "video" or "file" URL (a file can be as large as a video)."""
        return self.video_fetch_timeout_s if kind in ("video", "file") else self.media_fetch_timeout_s

    def sampled_at(self, fps: float, max_frames: int) -> MediaConfig:
        """This config with a request's own video sampling (already checked against max_video_frames)."""
        return replace(self, video_fps=fps, video_max_frames=max_frames)


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
