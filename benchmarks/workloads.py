"""The three workloads that shape the engine (DESIGN.md, "Workloads that shape the policy"), as
deterministic OpenAI chat-completion payloads.

- chatbot:  a long shared system prompt (default 2,000 tokens), usually the same image, a short
            question, short outputs (32..200 tokens); latency-sensitive.
- agent:    a long shared prefix (tool docs + history, default 3,000 tokens), a short task, long
            outputs (default 512 tokens); latency-tolerant.
- data:     every request a different image (or short video), a fixed extraction instruction,
            short structured JSON output (default 32 tokens); throughput-bound.

Everything is a pure function of (workload spec, request index, seed), so two servers get
byte-identical requests. Nothing here talks to a server.
"""

from __future__ import annotations

import base64
import io
import random
from dataclasses import asdict, dataclass, field, replace
from functools import lru_cache
from typing import Any, Protocol

WORKLOAD_NAMES = ("chatbot", "agent", "data", "textchat")

# Server flavours differ in which non-standard fields they accept (PEERS.md: `transformers serve`
# answers 422 to unknown fields such as `ignore_eos`).
FLAVORS = ("vlm-engine", "vllm", "sglang", "llamacpp", "transformers", "openai")


class Tokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = ...) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    shared_prefix_tokens: int  # system prompt shared by every request (prefix-cache food)
    user_tokens: int  # per-request text after the shared prefix
    output_tokens: tuple[int, int]  # inclusive range; each request draws its length from its seed
    image: str  # "none" | "shared" (same image with probability shared_image_prob) | "unique"
    shared_image_prob: float = 0.0
    image_size: tuple[int, int] = (320, 240)
    video_frames: int = 0  # > 0: data processor sends a short clip instead of an image
    json_output: bool = False

    @property
    def uses_media(self) -> bool:
        return self.image != "none" or self.video_frames > 0


DEFAULT_SPECS: dict[str, WorkloadSpec] = {
    "chatbot": WorkloadSpec("chatbot", 2000, 32, (32, 200), "shared", shared_image_prob=0.8),
    "agent": WorkloadSpec("agent", 3000, 64, (512, 512), "none"),
    "data": WorkloadSpec("data", 0, 48, (32, 32), "unique", json_output=True),
    # Plain streaming chat, fixed 64 output tokens: decode speed at a given concurrency.
    "textchat": WorkloadSpec("textchat", 0, 32, (64, 64), "none"),
}


def workload_spec(name: str, **overrides: Any) -> WorkloadSpec:
    """The default spec of `name` with the non-None overrides applied (CLI flags map 1:1)."""
    if name not in DEFAULT_SPECS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOAD_NAMES)}")
    return replace(DEFAULT_SPECS[name], **{k: v for k, v in overrides.items() if v is not None})


def text_only(spec: WorkloadSpec) -> WorkloadSpec:
    """The same workload for a text-only model: no media, same token shapes."""
    return replace(spec, image="none", shared_image_prob=0.0, video_frames=0)


# ---- deterministic text ---------------------------------------------------------------------------

_WORDS = (  # noqa: SIM905 - a word list reads better as text
    "the a system request image model token cache server batch user answer question report "
    "table value field record invoice receipt date total amount customer product order item "
    "price quantity address city country street name email phone status shipped pending "
    "describe extract summarize classify count list check verify compare explain write read "
    "red blue green large small bright dark left right top bottom center near far inside "
    "quickly carefully always never often usually because although while before after "
    "document page line paragraph chart graph photo camera scene object person car tree "
    "building road sign label text number code function tool call result error retry step"
).split()


def english_text(num_words: int, seed: int) -> str:
    """English-ish sentences: varied enough that BPE tokenizers produce ~1.2-1.5 tokens per word."""
    rng = random.Random(seed)
    sentences, count = [], 0
    while count < num_words:
        n = rng.randint(6, 16)
        words = [rng.choice(_WORDS) for _ in range(n)]
        words[0] = words[0].capitalize()
        if rng.random() < 0.2:
            words.insert(rng.randint(1, n - 1), str(rng.randint(1, 9999)))
        sentences.append(" ".join(words) + rng.choice("..?!"))
        count += len(words)
    return " ".join(sentences)


def text_of_tokens(num_tokens: int, seed: int, tokenizer: Tokenizer | None) -> str:
    """Deterministic text of about `num_tokens` tokens under `tokenizer` (exact up to the
    re-tokenisation of the cut). Without a tokenizer: ~4 characters per token, calibrated later
    from the server's `usage.prompt_tokens`."""
    if num_tokens <= 0:
        return ""
    if tokenizer is None:
        text = english_text(num_tokens, seed)
        return text[: 4 * num_tokens].rsplit(" ", 1)[0]
    text = english_text(num_tokens, seed)  # >= 1 token per word, so long enough
    ids = tokenizer.encode(text, add_special_tokens=False)
    while len(ids) < num_tokens:
        text += " " + english_text(num_tokens, seed + len(ids) + 1)
        ids = tokenizer.encode(text, add_special_tokens=False)
    return tokenizer.decode(ids[:num_tokens])


# ---- deterministic media ----------------------------------------------------------------------------


@lru_cache(maxsize=64)
def image_jpeg(seed: int, width: int = 320, height: int = 240) -> bytes:
    """A seeded picture (noise background + shapes) as JPEG bytes; different seed, different image."""
    import numpy as np
    from PIL import Image, ImageDraw

    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, size=(height // 8 + 1, width // 8 + 1, 3), dtype=np.uint8)
    img = Image.fromarray(pixels, "RGB").resize((width, height), Image.NEAREST)
    draw = ImageDraw.Draw(img)
    for _ in range(6):
        x0, y0 = int(rng.integers(0, width - 20)), int(rng.integers(0, height - 20))
        x1, y1 = x0 + int(rng.integers(10, width // 2)), y0 + int(rng.integers(10, height // 2))
        color = tuple(int(c) for c in rng.integers(0, 256, 3))
        (draw.ellipse if rng.random() < 0.5 else draw.rectangle)((x0, y0, x1, y1), fill=color)
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=90)
    return buf.getvalue()


@lru_cache(maxsize=8)
def video_mp4(seed: int, frames: int, width: int = 320, height: int = 240, fps: int = 2) -> bytes:
    """A short seeded H.264 clip (PyAV) — each frame one of `image_jpeg`'s pictures."""
    import av
    import numpy as np
    from PIL import Image

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height, stream.pix_fmt = width, height, "yuv420p"
        for i in range(frames):
            rgb = np.asarray(Image.open(io.BytesIO(image_jpeg(seed * 1000 + i, width, height))).convert("RGB"))
            for packet in stream.encode(av.VideoFrame.from_ndarray(rgb, format="rgb24")):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    return buf.getvalue()


def data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


# ---- requests ----------------------------------------------------------------------------------------


_MEDIA_SEED_BASE = {"chatbot": 100_000, "agent": 200_000, "data": 300_000}


@dataclass(frozen=True)
class BenchRequest:
    index: int
    payload: dict[str, Any]
    output_tokens: int  # requested (fixed when the server honours ignore_eos)
    media: str  # "none" | "image:<seed>" | "video:<seed>"


@dataclass
class RequestFactory:
    """Builds the i-th request of a workload; the shared prefix text is computed once."""

    spec: WorkloadSpec
    model: str | None
    flavor: str = "vlm-engine"
    seed: int = 0
    tokenizer: Tokenizer | None = None
    _prefix: str = field(default="", init=False, repr=False)

    def __post_init__(self) -> None:
        if self.flavor not in FLAVORS:
            raise ValueError(f"unknown flavor {self.flavor!r}; choose from {', '.join(FLAVORS)}")
        # Seeded by `seed` alone, so every server under test gets the same prefix text.
        self._prefix = text_of_tokens(self.spec.shared_prefix_tokens, 1_000 + self.seed, self.tokenizer)

    def build(self, index: int) -> BenchRequest:
        rng = random.Random(f"{self.spec.name}:{self.seed}:{index}")
        spec = self.spec
        lo, hi = spec.output_tokens
        out_tokens = rng.randint(lo, hi)
        user_text = self._user_text(index, rng)
        content: list[dict[str, Any]] = []
        media = self._media(index, rng)
        if media != "none":
            kind, _, seed = media.partition(":")
            w, h = spec.image_size
            if kind == "video":
                uri = data_uri(video_mp4(int(seed), spec.video_frames, w, h), "video/mp4")
                content.append({"type": "video_url", "video_url": {"url": uri}})
            else:
                content.append(
                    {"type": "image_url", "image_url": {"url": data_uri(image_jpeg(int(seed), w, h), "image/jpeg")}}
                )
        content.append({"type": "text", "text": user_text})
        messages: list[dict[str, Any]] = []
        if self._prefix:
            messages.append({"role": "system", "content": self._prefix})
        # Plain-string content for text-only requests: every server accepts it.
        messages.append({"role": "user", "content": content if media != "none" else user_text})
        return BenchRequest(index, chat_payload(messages, out_tokens, self.model, self.flavor), out_tokens, media)

    def _media(self, index: int, rng: random.Random) -> str:
        spec = self.spec
        # Per-workload seed ranges: a "unique" image never repeats one another workload sent to
        # the same server (that would be a spurious prefix/encoder-cache hit).
        unique = _MEDIA_SEED_BASE.get(spec.name, 900_000) + index
        if spec.video_frames > 0:
            return f"video:{unique}"
        if spec.image == "unique":
            return f"image:{unique}"
        if spec.image == "shared":
            return "image:1" if rng.random() < spec.shared_image_prob else f"image:{unique}"
        return "none"

    def _user_text(self, index: int, rng: random.Random) -> str:
        if self.spec.json_output:
            head = (
                "Extract the main objects from this input. Answer only with JSON of the form "
                '{"objects": [{"name": str, "color": str, "position": str}], "count": int}. '
            )
        elif self.spec.name == "agent":
            head = f"Task {index}: continue the plan above step by step and write the full result. "
        else:
            head = f"Question {index}: "
        tail = text_of_tokens(max(self.spec.user_tokens - 24, 4), 50_000 + self.seed * 7919 + index, self.tokenizer)
        return head + tail


def chat_payload(messages: list[dict[str, Any]], max_tokens: int, model: str | None, flavor: str) -> dict[str, Any]:
    """A streaming, greedy chat request; fixed output length wherever the server allows it."""
    payload: dict[str, Any] = {
        "messages": messages,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        # Exact token counts and prefix-cache hits arrive in the final usage chunk.
        "stream_options": {"include_usage": True},
    }
    if model is not None:
        payload["model"] = model
    payload.update(length_fields(flavor, max_tokens))
    return payload


def length_fields(flavor: str, max_tokens: int) -> dict[str, Any]:
    """Non-standard fields that pin the output length, per server flavour."""
    if flavor in ("vlm-engine", "vllm", "sglang", "llamacpp"):
        return {"ignore_eos": True}
    if flavor == "transformers":
        # `transformers serve` rejects unknown fields but takes a whole GenerationConfig as JSON;
        # min_new_tokens == max_new_tokens suppresses EOS like ignore_eos does.
        import json

        return {
            "generation_config": json.dumps(
                {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "do_sample": False}
            )
        }
    return {}


def sent_fields(flavor: str) -> list[str]:
    """Which request fields this flavour sends (recorded in every result JSON)."""
    base = ["model", "messages", "max_tokens", "temperature", "stream", "stream_options"]
    return base + sorted(length_fields(flavor, 1))


def spec_dict(spec: WorkloadSpec) -> dict[str, Any]:
    return asdict(spec)
