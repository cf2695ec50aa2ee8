"""The one workload set (DEFAULT_SPECS) as deterministic OpenAI chat payloads: a pure function of (spec, request
index, seed), so every server under test gets byte-identical requests. benchmarks/README.md, "Workloads"."""

from __future__ import annotations

import base64
import io
import json
import math
import random
from dataclasses import dataclass, field, replace
from functools import lru_cache
from typing import Any

# Server flavours differ in which non-standard fields they accept (PEERS.md: `transformers serve`
# answers 422 to unknown fields such as `ignore_eos`).
FLAVORS = ("vlm-engine", "vllm", "llamacpp", "transformers", "openai")


@dataclass(frozen=True)
class WorkloadSpec:
    name: str
    shared_prefix_tokens: int  # system prompt shared by every request (prefix-cache food)
    user_tokens: int  # per-request text after the shared prefix (the synthetic-text workloads)
    output_tokens: tuple[int, int]  # inclusive range; each request draws its length from its seed
    image: str  # "none" | "shared" (same image with probability shared_image_prob) | "unique"
    shared_image_prob: float = 0.0
    image_size: tuple[int, int] = (320, 240)
    json_output: bool = False
    photo: bool = False  # photo-like pictures (gradients, blur, sensor noise) instead of flat shapes
    pin_length: bool = True  # send the flavour's length-pinning fields (ignore_eos / min_new_tokens)


DEFAULT_SPECS: dict[str, WorkloadSpec] = {
    "chatbot": WorkloadSpec("chatbot", 2000, 32, (32, 200), "shared", shared_image_prob=0.8),
    "agent": WorkloadSpec("agent", 3000, 64, (512, 512), "none"),
    "data": WorkloadSpec("data", 0, 48, (32, 32), "unique", json_output=True),
    "textchat": WorkloadSpec("textchat", 0, 32, (64, 64), "none"),
    "placard": WorkloadSpec("placard", 0, 0, (64, 64), "unique", image_size=(640, 480), photo=True, pin_length=False),
    "imagechat": WorkloadSpec("imagechat", 0, 0, (64, 64), "unique", image_size=(640, 480), photo=True),
    "extraction": WorkloadSpec("extraction", 0, 0, (128, 128), "none", pin_length=False),
    "chat": WorkloadSpec("chat", 0, 0, (128, 128), "none", pin_length=False),
}
WORKLOAD_NAMES = tuple(DEFAULT_SPECS)


def workload_spec(name: str, **overrides: Any) -> WorkloadSpec:
    """The default spec of `name` with the non-None overrides applied (CLI flags map 1:1)."""
    if name not in DEFAULT_SPECS:
        raise ValueError(f"unknown workload {name!r}; choose from {', '.join(WORKLOAD_NAMES)}")
    return replace(DEFAULT_SPECS[name], **{k: v for k, v in overrides.items() if v is not None})


def text_only(spec: WorkloadSpec) -> WorkloadSpec:
    """The same workload for a text-only model: no media, same token shapes."""
    return replace(spec, image="none", shared_image_prob=0.0)


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


def text_of_tokens(num_tokens: int, seed: int, tokenizer: Any) -> str:
    """Deterministic text of about `num_tokens` tokens under `tokenizer` (exact up to the
    re-tokenisation of the cut). Without a tokenizer: ~4 characters per token, calibrated later
    from the server's `usage.prompt_tokens`."""
    if num_tokens <= 0:
        return ""
    text = english_text(num_tokens, seed)  # >= 1 token per word, so long enough
    if tokenizer is None:
        return text[: 4 * num_tokens].rsplit(" ", 1)[0]
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


@lru_cache(maxsize=32)
def photo_jpeg(seed: int, width: int = 640, height: int = 480) -> bytes:
    """A photo-like picture as JPEG bytes (quality 85): a sky-to-ground gradient, low-frequency light,
    blurred shapes and per-pixel sensor noise, so it compresses like a photo (~60-100 KB at 640x480) and
    not like flat synthetic art. Different seed, different picture; same seed, same bytes."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(seed)
    y = np.linspace(0.0, 1.0, height)[:, None, None]
    x = np.linspace(0.0, 1.0, width)[None, :, None]
    top, bottom = rng.uniform(60, 230, 3), rng.uniform(20, 200, 3)
    horizon = rng.uniform(0.3, 0.7)
    sky = top + (bottom - top) * np.clip(y / horizon, 0, 1) * 0.5
    ground = bottom * (0.6 + 0.4 * (y - horizon) / (1 - horizon))
    img = np.where(y < horizon, sky, ground) + np.zeros((height, width, 3))
    for _ in range(6):  # soft light and shade
        fx, fy, phase = rng.uniform(0.5, 4.0), rng.uniform(0.5, 4.0), rng.uniform(0, 2 * np.pi)
        img += rng.uniform(5, 20) * np.sin(2 * np.pi * (fx * x + fy * y) + phase) * rng.uniform(0.5, 1.0, 3)
    pic = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")
    shapes = Image.new("RGBA", (width, height), (0, 0, 0, 0))
    draw = ImageDraw.Draw(shapes)
    for _ in range(int(rng.integers(5, 10))):
        cx, cy = rng.uniform(0, width), rng.uniform(height * 0.2, height)
        w, h = rng.uniform(20, width / 3), rng.uniform(20, height / 3)
        color = (*(int(c) for c in rng.integers(0, 256, 3)), int(rng.integers(160, 256)))
        box = (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)
        if rng.random() < 0.5:
            draw.ellipse(box, fill=color)
        else:
            pts = [(cx + w / 2 * math.cos(a), cy + h / 2 * math.sin(a)) for a in np.sort(rng.uniform(0, 6.3, 5))]
            draw.polygon(pts, fill=color)
    shapes = shapes.filter(ImageFilter.GaussianBlur(float(rng.uniform(1.0, 3.0))))
    pic.paste(shapes, (0, 0), shapes)
    arr = np.asarray(pic).astype(np.float64) + rng.normal(0.0, 5.0, (height, width, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB").save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def data_uri(data: bytes, mime: str) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


# ---- apps/placard and imagechat --------------------------------------------------------------------

# apps/placard/static/placard.js: PLACARD_SCHEMA and PROMPT, as the page sends them.
PLACARD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "date_or_period": {"type": "string", "maxLength": 40},
        "medium": {"type": "string", "maxLength": 40},
        "description": {"type": "string", "maxLength": 240},
    },
    "required": ["title", "date_or_period", "medium", "description"],
    "additionalProperties": False,
}
PLACARD_PROMPT = (
    "You are a museum curator. Write the placard for this picture as JSON: a title of a few words "
    "naming what it shows, a date or period, the medium, and a description of two sentences saying "
    "what the picture shows."
)
QUESTIONS = (
    "What is in this photo? Describe the scene in detail.",
    "Which objects can you see in this picture, and where are they?",
    "Describe the colors and the lighting of this photo.",
    "What is the main subject of this picture, and what is around it?",
)
PLACARD_RESPONSE_FORMAT = {
    "type": "json_schema",
    "json_schema": {"name": "placard", "strict": True, "schema": PLACARD_SCHEMA},
}


# ---- synthetic documents and prompts (extraction, chat) ------------------------------------------------

FIRST = ["Maria", "James", "Aiko", "Olusegun", "Priya", "Lars", "Sofia", "Mateo", "Hannah", "Wei", "Fatima", "Noah",
         "Ingrid", "Rafael", "Chloe", "Dmitri", "Amara", "Kenji", "Elena", "Tomasz"]  # fmt: skip
LAST = ["Kowalski", "Okafor", "Tanaka", "Lindqvist", "Moreau", "Haddad", "Fernandez", "Novak", "Schmidt", "Chen",
        "Patel", "Brennan", "Castillo", "Yamamoto", "Ivanova", "Mensah", "Larsen", "Duarte"]  # fmt: skip
STREETS = ["Birchwood Lane", "Harbor Street", "Maple Avenue", "Old Mill Road", "Quarry Drive", "Sunset Boulevard",
           "Elm Court", "Riverside Way", "Juniper Place", "Kings Road"]  # fmt: skip
CITIES = [("Springfield", "IL", "62704"), ("Portland", "OR", "97205"), ("Austin", "TX", "78701"),
          ("Madison", "WI", "53703"), ("Savannah", "GA", "31401"), ("Boulder", "CO", "80302"),
          ("Burlington", "VT", "05401"), ("Tucson", "AZ", "85701")]  # fmt: skip
ITEMS = [("Wireless keyboard", 49.99), ("USB-C hub", 34.50), ("27-inch monitor", 229.00), ("Desk lamp", 18.75),
         ("Ergonomic chair", 310.00), ("Laptop stand", 42.10), ("Noise-cancelling headset", 129.95),
         ("Webcam 1080p", 59.00), ("Cable organizer", 9.99), ("External SSD 1TB", 89.49)]  # fmt: skip
CARRIERS = ["FedEx", "UPS", "DHL Express", "USPS Priority", "Canada Post"]
DOMAINS = ["example.com", "mail.example.org", "corp.example.net"]
STATUSES = ["In transit", "Out for delivery", "Held at depot", "Delivered"]
PLANS = ["Basic", "Plus", "Business", "Enterprise"]


def _code(rng: random.Random, letters: int, digits: int) -> str:
    return (
        "".join(rng.choices("ABCDEFGHJKLMNPQRSTUVWXYZ", k=letters)) + "-" + "".join(rng.choices("0123456789", k=digits))
    )


def _person(rng: random.Random) -> dict[str, str]:
    first, last = rng.choice(FIRST), rng.choice(LAST)
    city, state, zip_code = rng.choice(CITIES)
    return {
        "name": f"{first} {last}",
        "address": f"{rng.randint(10, 9999)} {rng.choice(STREETS)}, {city}, {state} {zip_code}",
        "email": f"{first.lower()}.{last.lower()}@{rng.choice(DOMAINS)}",
        "phone": f"+1-{rng.randint(200, 989)}-{rng.randint(200, 989)}-{rng.randint(1000, 9999)}",
    }


def _date(rng: random.Random) -> str:
    return f"2026-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def document(index: int, seed: int = 0) -> tuple[str, list[tuple[str, str]], str]:
    """(kind, fields in order, a word that a few lines mention) of a deterministic synthetic document."""
    rng = random.Random(f"doc-{seed}-{index}")
    kind = rng.choice(("invoice", "customer record", "shipping notice"))
    p = _person(rng)
    if kind == "invoice":
        fields = [("Invoice", _code(rng, 3, 5)), ("Date", _date(rng)), ("Bill to", p["name"]),
                  ("Address", p["address"]), ("Email", p["email"])]  # fmt: skip
        total = 0.0
        for name, price in rng.sample(ITEMS, rng.randint(2, 3)):
            qty = rng.randint(1, 4)
            total += qty * price
            fields.append(("Item", f"{name} x{qty} @ {price:.2f}"))
        fields += [("Total", f"{total:.2f} USD"), ("Payment code", _code(rng, 2, 4))]
        return kind, fields, "Item"
    if kind == "customer record":
        fields = [("Customer ID", _code(rng, 2, 6)), ("Name", p["name"]), ("Email", p["email"]),
                  ("Phone", p["phone"]), ("Address", p["address"]), ("Plan", rng.choice(PLANS)),
                  ("Since", _date(rng)), ("Account manager", _person(rng)["name"]),
                  ("Balance", f"{rng.randint(0, 4000)}.{rng.randint(0, 99):02d} USD")]  # fmt: skip
        return kind, fields, "Name"
    sender = _person(rng)
    fields = [("Tracking", _code(rng, 4, 8)), ("Carrier", rng.choice(CARRIERS)), ("Shipped", _date(rng)),
              ("From", sender["name"]), ("From address", sender["address"]), ("To", p["name"]),
              ("To address", p["address"]), ("Weight", f"{rng.randint(1, 40)}.{rng.randint(0, 9)} kg"),
              ("Status", rng.choice(STATUSES))]  # fmt: skip
    return kind, fields, "address"


def extraction_prompt(index: int, seed: int = 0) -> tuple[str, str]:
    """(prompt, the document's text): three instructions whose answers copy spans of the document."""
    kind, fields, mention = document(index, seed)
    lines = "\n".join(f"{k}: {v}" for k, v in fields)
    task = index % 3
    # SmolLM2-135M refuses ~half of "Copy the following customer record/invoice exactly" (it answers
    # as a customer-service assistant) but copies when the document is called "text".
    if task == 0:
        return f"Copy the following text exactly:\n\n{lines}", lines
    if task == 1:
        return f"Copy the lines of the following text that mention {mention}, exactly as written:\n\n{lines}", lines
    # The fields arrive as one semicolon-separated line: the answer copies the values, not the layout.
    flat = "; ".join(f"{k} = {v}" for k, v in fields)
    return f"Rewrite each field of the following {kind} as `key: value` lines:\n\n{flat}", flat


SUBJECTS = ["a lighthouse keeper", "a retired astronaut", "a young baker", "a lost robot", "a village doctor",
            "a street musician", "an old cartographer", "a night-shift nurse"]  # fmt: skip
EVENTS = ["finds a message in a bottle", "misses the last train home", "inherits a strange key",
          "hears a song nobody else can hear", "meets a talking fox", "wakes up a hundred years later"]  # fmt: skip
THINGS = ["a refrigerator", "the immune system", "a suspension bridge", "photosynthesis", "a jet engine",
          "compound interest", "the water cycle", "a vaccine", "an electric guitar", "tides"]  # fmt: skip
AUDIENCES = ["a ten-year-old", "a curious adult", "a history student", "someone who has never seen one"]
ADVICE = ["starting to run in the mornings", "keeping houseplants alive", "preparing for a job interview",
          "learning a second language", "sleeping better", "planning a first vegetable garden",
          "saving money on groceries", "writing a wedding toast"]  # fmt: skip


def chat_prompt(index: int, seed: int = 0) -> str:
    rng = random.Random(f"chat-{seed}-{index}")
    kind = index % 3
    if kind == 0:
        return f"Write a short story about {rng.choice(SUBJECTS)} who {rng.choice(EVENTS)}."
    if kind == 1:
        return f"Explain how {rng.choice(THINGS)} works to {rng.choice(AUDIENCES)}."
    return f"Give me some practical advice on {rng.choice(ADVICE)}."


# ---- requests ----------------------------------------------------------------------------------------

# Per-workload image seed ranges: a "unique" image never repeats one another workload sent to the same
# server (a spurious prefix/encoder-cache hit). placard / imagechat keep the seeds their tables were made with.
_MEDIA_SEED_BASE = {"chatbot": 100_000, "agent": 200_000, "data": 300_000, "placard": 0, "imagechat": 500_000}
WARMUP_INDEX = 900_000  # warm-up requests use their own indices: no image repeats a measured one


@dataclass(frozen=True)
class BenchRequest:
    index: int
    payload: dict[str, Any]
    output_tokens: int  # requested (exact when the server honours the length-pinning fields)
    media: str  # "none" | "image:<seed>" | "photo:<seed>"
    source: str = ""  # extraction: the document text the answer should copy from


@dataclass
class RequestFactory:
    """Builds the i-th request of a workload; the shared prefix text is computed once."""

    spec: WorkloadSpec
    model: str | None
    flavor: str = "vlm-engine"
    seed: int = 0
    tokenizer: Any = None
    _prefix: str = field(default="", init=False, repr=False)

    def __post_init__(self) -> None:
        if self.flavor not in FLAVORS:
            raise ValueError(f"unknown flavor {self.flavor!r}; choose from {', '.join(FLAVORS)}")
        # Seeded by `seed` alone, so every server under test gets the same prefix text.
        self._prefix = text_of_tokens(self.spec.shared_prefix_tokens, 1_000 + self.seed, self.tokenizer)

    def build(self, index: int) -> BenchRequest:
        rng = random.Random(f"{self.spec.name}:{self.seed}:{index}")
        spec = self.spec
        out_tokens = rng.randint(*spec.output_tokens)
        user_text, source = self._user_text(index, rng)
        media = self._media(index, rng)
        content: list[dict[str, Any]] = []
        if media != "none":
            kind, _, seed = media.partition(":")
            jpeg = (photo_jpeg if kind == "photo" else image_jpeg)(int(seed), *spec.image_size)
            content.append({"type": "image_url", "image_url": {"url": data_uri(jpeg, "image/jpeg")}})
        content.append({"type": "text", "text": user_text})
        messages: list[dict[str, Any]] = []
        if self._prefix:
            messages.append({"role": "system", "content": self._prefix})
        # Plain-string content for text-only requests: every server accepts it.
        messages.append({"role": "user", "content": content if media != "none" else user_text})
        payload = chat_payload(messages, out_tokens, self.model, self.flavor if spec.pin_length else "openai")
        if spec.name == "placard":
            payload["response_format"] = PLACARD_RESPONSE_FORMAT
        return BenchRequest(index, payload, out_tokens, media, source)

    def _media(self, index: int, rng: random.Random) -> str:
        spec = self.spec
        unique = _MEDIA_SEED_BASE.get(spec.name, 900_000) + index
        kind = "photo" if spec.photo else "image"
        if spec.image == "unique":
            return f"{kind}:{unique}"
        if spec.image == "shared":
            return f"{kind}:1" if rng.random() < spec.shared_image_prob else f"{kind}:{unique}"
        return "none"

    def _user_text(self, index: int, rng: random.Random) -> tuple[str, str]:
        """(the user message's text, the document an answer should copy from)."""
        name = self.spec.name
        if name == "placard":
            return PLACARD_PROMPT, ""
        if name == "imagechat":
            return QUESTIONS[index % len(QUESTIONS)], ""
        if name == "extraction":
            return extraction_prompt(index, self.seed)
        if name == "chat":
            return chat_prompt(index, self.seed), ""
        if self.spec.json_output:
            head = (
                "Extract the main objects from this input. Answer only with JSON of the form "
                '{"objects": [{"name": str, "color": str, "position": str}], "count": int}. '
            )
        elif name == "agent":
            head = f"Task {index}: continue the plan above step by step and write the full result. "
        else:
            head = f"Question {index}: "
        tail = text_of_tokens(max(self.spec.user_tokens - 24, 4), 50_000 + self.seed * 7919 + index, self.tokenizer)
        return head + tail, ""


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
    if flavor in ("vlm-engine", "vllm", "llamacpp"):
        return {"ignore_eos": True}
    if flavor == "transformers":
        # `transformers serve` rejects unknown fields but takes a whole GenerationConfig as JSON;
        # min_new_tokens == max_new_tokens suppresses EOS like ignore_eos does.
        config = {"max_new_tokens": max_tokens, "min_new_tokens": max_tokens, "do_sample": False}
        return {"generation_config": json.dumps(config)}
    return {}


def sent_fields(flavor: str) -> list[str]:
    """Which request fields this flavour sends (recorded in every result JSON)."""
    base = ["model", "messages", "max_tokens", "temperature", "stream", "stream_options"]
    return base + sorted(length_fields(flavor, 1))
