"""The family matrix's table: one row per tiny checkpoint of a model family, read by
tests/test_family_matrix.py (exactness against Transformers, the protocol, the released checkpoints' names
on the meta device, fast numerics against exact). A new family joins with one row here and its builder in
testkit/; what only it does stays in a test file of its own, which reuses the engines cached here.

The engines, Transformers' models and its greedy references are built once a session (`functools.cache`):
the matrix and a family's own tests share them, so no checkpoint is loaded twice for the same thing."""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from testkit.checkpoints import cached_qwen2_vl
from testkit.gemma3_checkpoints import GEMMA3_PRESETS, cached_gemma3
from testkit.gemma4_checkpoints import cached_gemma4_vlm
from testkit.mistral3_checkpoints import cached_mistral3
from testkit.paddleocr_vl_checkpoints import cached_paddleocr_vl
from testkit.qwen3_5_checkpoints import cached_qwen3_5
from testkit.qwen_vl_checkpoints import cached_qwen2_5_vl, cached_qwen3_vl
from testkit.smolvlm_checkpoints import cached_smolvlm
from tests.conftest import hf_greedy, make_image, user
from tests.released_configs import (
    GEMMA3_RELEASES,
    GEMMA4_RELEASES,
    IDEFICS3_RELEASES,
    LIGHTONOCR_RELEASES,
    MISTRAL3_RELEASES,
    PADDLEOCR_VL_RELEASES,
    QWEN2_5_VL_RELEASES,
    QWEN3_5_MOE_RELEASES,
    QWEN3_5_RELEASES,
    QWEN3_VL_MOE_RELEASES,
    QWEN3_VL_RELEASES,
    SMOLVLM_RELEASES,
    Release,
)
from vlm_engine import Engine, SamplingParams

Conversation = list[dict[str, Any]]


def base_conversations(second_image: tuple[int, int] = (37, 83)) -> list[Conversation]:
    """text; one image; two images of odd sizes (the second `second_image`); multi-turn."""
    return [
        [{"role": "user", "content": "Tell me a story about a red fox."}],
        user(make_image(64, 48, 1), "What is in this picture?"),
        user("Compare these:", make_image(97, 41, 2), make_image(*second_image, 3), "Which is taller?"),
        [
            {"role": "system", "content": "You answer briefly."},
            {
                "role": "user",
                "content": [{"type": "image", "image": make_image(50, 70, 4)}, {"type": "text", "text": "Hi"}],
            },
            {"role": "assistant", "content": "A picture of blocks."},
            {"role": "user", "content": "Which colors?"},
        ],
    ]


BASE_NAMES = ("text", "one-image", "two-odd-images", "multi-turn")
WIDE_IMAGE = user(make_image(230, 57, 5), "A wide one.")

# Qwen2-VL's set (the first family): eight requests, the batch of eight, two equal-sized images.
QWEN2_VL_CONVERSATIONS = [
    [{"role": "user", "content": "Tell me a story about a red fox."}],
    user(make_image(64, 48, 1), "What is in this picture?"),
    user("Compare these:", make_image(96, 40, 2), make_image(36, 84, 3), "Which is taller?"),
    [
        {"role": "system", "content": "You answer briefly."},
        {"role": "user", "content": "Name three colors."},
        {"role": "assistant", "content": "Red, green, blue."},
        {"role": "user", "content": "Two more?"},
    ],
    user(make_image(120, 120, 4), "Describe it in detail."),
    user("Just text inside a parts list."),
    user(make_image(224, 56, 5), "A wide one."),
    user(make_image(50, 50, 6), "And", make_image(50, 50, 7), "two equal sizes, different content."),
]
QWEN2_VL_FAST = [
    user(make_image(64, 48, 1), "What is in the picture?"),
    [{"role": "user", "content": "Tell me a story about a dragon."}],
]

GEMMA3_LONG_TEXT = (
    "The old bridge crossed the river near the market, and every morning the farmers walked over it "
    "with their baskets of apples, bread and flowers while the children ran ahead to the school."
)
GEMMA3_WINDOW = GEMMA3_PRESETS["tiny"]["text"]["sliding_window"]
GEMMA3_CONVERSATIONS = [
    *base_conversations(),
    # Longer than the window: the first image and the text after it fall out of the sliding layers'
    # window before the second image and the question, which sit inside it.
    user("Look:", make_image(80, 60, 5), GEMMA3_LONG_TEXT, make_image(45, 90, 6), "And now, what changed?"),
    # An image right at the start, then a long text: the image leaves the window during the prompt.
    user(make_image(120, 40, 7), GEMMA3_LONG_TEXT + " " + GEMMA3_LONG_TEXT),
]


@dataclass(frozen=True, eq=False)
class Family:
    """One tiny checkpoint of a family and what the matrix runs on it."""

    name: str  # the test id
    checkpoint: Callable[[], Path]  # builds it once (testkit caches it by name)
    architectures: tuple[str, ...]  # the registry.ARCHITECTURES keys this row stands for
    conversations: Sequence[Conversation]  # each: our prompt ids and greedy tokens = Transformers'
    names: Sequence[str]  # their test ids
    position_axes: int  # the model's rotary axes (3: M-RoPE)
    videos: bool  # its processor takes videos
    max_tokens: int = 20
    alone: Sequence[int] | None = None  # the conversations also run alone (None: all)
    kv_cache_tokens: int = 8192  # the exact engine's pool
    prefix_conversation: int = 2  # run twice with the prefix cache, and once without
    full_prefix_reuse: bool = True  # all but the last page reused (sliding windows reuse less)
    # A pool and a chunk budget that make the whole set preempt and split media runs.
    preempted: dict[str, int] = field(default_factory=dict)
    # Another engine on the same checkpoint: prefix cache off, a preempting pool, fast numerics.
    extra_engines: bool = True
    fast_conversations: Sequence[Conversation] = ()  # fast numerics against exact (default: 2 and 3)
    # The released checkpoints whose every tensor must load by name on the meta device.
    releases: dict[str, Release] = field(default_factory=dict)
    # Every released tensor name starts with one of these, and each is used (a tied head is not stored).
    release_prefixes: tuple[str, ...] = ()
    leftover: tuple[str, str, tuple[int, ...], str] | None = None  # release, extra tensor, shape, reported as
    wrong_shape: tuple[str, str] | None = None  # release, name suffix of the tensor to widen ("": the last)

    @property
    def path(self) -> Path:
        return self.checkpoint()

    @property
    def fast(self) -> Sequence[Conversation]:
        return self.fast_conversations or [self.conversations[2], self.conversations[3]]

    @property
    def greedy(self) -> SamplingParams:
        return SamplingParams(max_tokens=self.max_tokens, temperature=0.0)


QWEN_VL_PREEMPTED = {"kv_cache_tokens": 200, "max_num_batched_tokens": 48, "page_size": 8}

FAMILIES: tuple[Family, ...] = (
    Family(
        "qwen2-vl", lambda: cached_qwen2_vl("tiny"), ("Qwen2VLForConditionalGeneration",),
        QWEN2_VL_CONVERSATIONS,
        ("text", "one-image", "two-images", "two-more", "big-image", "text-in-parts", "wide-image", "two-equal-sizes"),
        position_axes=3, videos=True, max_tokens=24, alone=(0, 1, 2), kv_cache_tokens=4096, prefix_conversation=4,
        # 48-token chunks through the images, a pool of the longest prompt (200) + its tokens + a page
        preempted={"kv_cache_tokens": 200 + 24 + 16, "max_num_batched_tokens": 48, "page_size": 8},
        fast_conversations=QWEN2_VL_FAST,
    ),
    Family(
        "qwen2.5-vl", lambda: cached_qwen2_5_vl("tiny"), ("Qwen2_5_VLForConditionalGeneration",),
        [*base_conversations(), WIDE_IMAGE], (*BASE_NAMES, "wide-image"), position_axes=3, videos=True,
        # 48-token chunks split every image's placeholder run (up to 64 tokens); a pool of two prompts'
        # worth makes the batch preempt.
        preempted=QWEN_VL_PREEMPTED,
        releases=QWEN2_5_VL_RELEASES,
        leftover=("Qwen2.5-VL-3B-Instruct", "visual.blocks.99.attn.qkv.weight", (3,), "visual.blocks.99.attn.qkv.weight"),
    ),
    Family(
        "qwen3-vl", lambda: cached_qwen3_vl("tiny"), ("Qwen3VLForConditionalGeneration",),
        [*base_conversations(), WIDE_IMAGE], (*BASE_NAMES, "wide-image"), position_axes=3, videos=True,
        preempted=QWEN_VL_PREEMPTED, releases=QWEN3_VL_RELEASES,
        wrong_shape=("Qwen3-VL-2B-Instruct", ""),
    ),
    Family(
        "qwen3-vl-moe", lambda: cached_qwen3_vl("tiny-moe"), ("Qwen3VLMoeForConditionalGeneration",),
        [*base_conversations(), WIDE_IMAGE], (*BASE_NAMES, "wide-image"), position_axes=3, videos=True,
        preempted=QWEN_VL_PREEMPTED, releases=QWEN3_VL_MOE_RELEASES,
    ),
    # Hybrid stacks: Gated DeltaNet layers keep state slots beside the attention layers' paged KV.
    Family(
        "qwen3.5", lambda: cached_qwen3_5("tiny"), ("Qwen3_5ForConditionalGeneration",),
        [*base_conversations(), WIDE_IMAGE], (*BASE_NAMES, "wide-image"), position_axes=3, videos=True,
        preempted=QWEN_VL_PREEMPTED, releases=QWEN3_5_RELEASES,
    ),
    Family(
        "qwen3.5-moe", lambda: cached_qwen3_5("tiny-moe"), ("Qwen3_5MoeForConditionalGeneration",),
        [*base_conversations(), WIDE_IMAGE], (*BASE_NAMES, "wide-image"), position_axes=3, videos=True,
        preempted=QWEN_VL_PREEMPTED, releases=QWEN3_5_MOE_RELEASES,
    ),
    Family(
        "smolvlm", lambda: cached_smolvlm("tiny"), ("SmolVLMForConditionalGeneration",),
        # two odd images: 97x41 -> 3 x 2 tiles + the global image, 30x90 -> 1 x 3 + the global image
        [*base_conversations(second_image=(30, 90)), WIDE_IMAGE], (*BASE_NAMES, "wide-image"),
        position_axes=1, videos=True,
        # 40-token chunks end inside tiles' 16-token runs; a pool of about one long prompt makes the batch preempt.
        preempted={"kv_cache_tokens": 320, "max_num_batched_tokens": 40, "page_size": 8},
        releases=SMOLVLM_RELEASES,
        release_prefixes=("model.text_model.", "model.vision_model.", "model.connector.", "lm_head."),
        leftover=("SmolVLM2-256M-Video-Instruct", "model.vision_model.head.probe", (1, 1, 768), "vision_model.head.probe"),
        wrong_shape=("SmolVLM2-500M-Video-Instruct", "modality_projection.proj.weight"),
    ),
    # SmolVLM v1's architecture and processor (images only), served by the same family: its exactness on
    # the first three conversations (no engine of its own beyond the exact one).
    Family(
        "idefics3", lambda: cached_smolvlm("tiny-idefics3"), ("Idefics3ForConditionalGeneration",),
        base_conversations(second_image=(30, 90))[:3], BASE_NAMES[:3], position_axes=1, videos=False,
        kv_cache_tokens=4096, extra_engines=False, releases=IDEFICS3_RELEASES,
        release_prefixes=("model.text_model.", "model.vision_model.", "model.connector.", "lm_head."),
    ),
    Family(
        "gemma3", lambda: cached_gemma3("tiny"), ("Gemma3ForConditionalGeneration",),
        GEMMA3_CONVERSATIONS, (*BASE_NAMES, "images-across-window", "image-then-long-text"),
        position_axes=1, videos=False, max_tokens=24,
        prefix_conversation=4,  # longer than the window: the sliding layers' cached pages cross its edge
        full_prefix_reuse=False,
        # A pool of about two prompts' worth, filled by 48-token chunks of several prompts, makes the batch preempt.
        preempted={"kv_cache_tokens": 256, "max_num_batched_tokens": 48, "page_size": 16},
        fast_conversations=[GEMMA3_CONVERSATIONS[2], GEMMA3_CONVERSATIONS[4]],
        releases=GEMMA3_RELEASES,
        release_prefixes=("language_model.model.", "vision_tower.vision_model.", "multi_modal_projector."),
        # the pooling head Gemma 3 does not use
        leftover=("gemma-3-4b-it", "vision_tower.vision_model.head.attention.in_proj_weight", (3,),
                  "vision_tower.head.attention.in_proj_weight"),
    ),
    # NaViT encoder at native resolution (one attention segment per image) and ERNIE-4.5 with M-RoPE.
    Family(
        "paddleocr-vl", lambda: cached_paddleocr_vl("tiny"), ("PaddleOCRVLForConditionalGeneration",),
        [*base_conversations(), WIDE_IMAGE], (*BASE_NAMES, "wide-image"), position_axes=3, videos=False,
        # 48-token chunks split the images' placeholder runs (up to 64 tokens); a pool of about two prompts
        preempted=QWEN_VL_PREEMPTED,
        releases=PADDLEOCR_VL_RELEASES,
        release_prefixes=("model.", "visual.vision_model.", "mlp_AR.", "lm_head."),
        # the encoder's packing table, which Transformers ignores on load too
        leftover=("PaddleOCR-VL", "visual.vision_model.embeddings.packing_position_embedding.weight", (32768, 1152),
                  "visual.vision_model.embeddings.packing_position_embedding.weight"),
        wrong_shape=("PaddleOCR-VL", "mlp_AR.linear_1.weight"),
    ),
    # Pixtral at native resolution: two odd images go through one tower pass, kept apart; an image's span is
    # its whole [IMG] / [IMG_BREAK] / [IMG_END] block.
    Family(
        "mistral3", lambda: cached_mistral3("tiny"), ("Mistral3ForConditionalGeneration",),
        [*base_conversations(), WIDE_IMAGE], (*BASE_NAMES, "wide-image"), position_axes=1, videos=False,
        # 24-token chunks end inside images' runs (up to 48 tokens); a pool of about two prompts makes the batch preempt.
        preempted={"kv_cache_tokens": 160, "max_num_batched_tokens": 24, "page_size": 8},
        releases=MISTRAL3_RELEASES,
        release_prefixes=("language_model.model.", "language_model.lm_head.", "vision_tower.", "multi_modal_projector."),
        leftover=("Mistral-Small-3.1-24B-Instruct-2503", "vision_tower.transformer.layers.24.ffn_norm.weight", (1024,),
                  "vision_tower.transformer.layers.24.ffn_norm.weight"),
        wrong_shape=("Mistral-Small-3.1-24B-Instruct-2503", "patch_merger.merging_layer.weight"),
    ),
    Family(
        "lightonocr", lambda: cached_mistral3("tiny-lightonocr"), ("LightOnOcrForConditionalGeneration",),
        [*base_conversations(), WIDE_IMAGE], (*BASE_NAMES, "wide-image"), position_axes=1, videos=False,
        preempted={"kv_cache_tokens": 160, "max_num_batched_tokens": 24, "page_size": 8},
        releases=LIGHTONOCR_RELEASES,
        release_prefixes=("model.language_model.", "model.vision_encoder.", "model.vision_projection."),
    ),
    # Gemma 4 (testkit/gemma4_checkpoints.py): 60-70 soft tokens an image against a 16-token window, the
    # last 3 of 6 layers KV-shared; the two long conversations carry images across the window.
    Family(
        "gemma4", lambda: cached_gemma4_vlm("tiny"), ("Gemma4ForConditionalGeneration",),
        GEMMA3_CONVERSATIONS, (*BASE_NAMES, "images-across-window", "image-then-long-text"),
        position_axes=1, videos=False, max_tokens=20, prefix_conversation=4, full_prefix_reuse=False,
        # 96-token chunks (an image's span, atomic, fits one), a pool of about two prompts' worth
        preempted={"kv_cache_tokens": 400, "max_num_batched_tokens": 96, "page_size": 16},
        fast_conversations=[GEMMA3_CONVERSATIONS[2], GEMMA3_CONVERSATIONS[4]],
        releases=GEMMA4_RELEASES,
        release_prefixes=("model.language_model.", "model.vision_tower.", "model.embed_vision."),
    ),
)  # fmt: skip

# The architectures no row stands for, and where each is checked: text models, whose prompts have no media.
TEXT_ARCHITECTURES = {
    "LlamaForCausalLM": "SmolLM2 (tests/test_smollm2_parity.py), drafts (testkit/drafts.py)",
    "MistralForCausalLM": "the Llama family's code (a Llama config)",
    "Qwen2ForCausalLM": "testkit/scripted.py (tests/test_tool_calls.py)",
    "Gemma3ForCausalLM": "gemma-3-1b-it's names (tests/test_gemma3_family.py)",
    "Gemma4ForCausalLM": "tests/test_gemma4_family.py (tiny checkpoints; gemma-4-E2B / E4B text names)",
    "Qwen3NextForCausalLM": "tests/test_qwen3_5_family.py (a tiny checkpoint; Qwen3-Next-80B-A3B's names)",
    "PlacardForConditionalGeneration": "the default model (tests/test_placard_model.py)",
}


def family(name: str) -> Family:
    return next(f for f in FAMILIES if f.name == name)


# ---- built once a session ----------------------------------------------------------------------------


@functools.cache
def exact_engine(row: Family) -> Engine:
    return Engine(str(row.path), dtype="float32", kv_cache_tokens=row.kv_cache_tokens, numerics="exact")


@functools.cache
def fast_engine(row: Family) -> Engine:
    return Engine(str(row.path), dtype="float32", kv_cache_tokens=2048, numerics="fast")


def uncached_engine(row: Family) -> Engine:
    """The exact engine with the prefix cache off: what a cached run must equal."""
    return Engine(str(row.path), dtype="float32", kv_cache_tokens=2048, numerics="exact", enable_prefix_cache=False)


@functools.cache
def hf_model(row: Family) -> tuple[Any, Any]:
    """Transformers' fp32 model and processor of the checkpoint."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(str(row.path), dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(str(row.path))


@functools.cache
def references(row: Family) -> tuple[list[int], ...]:
    """Transformers' greedy tokens for each conversation."""
    return tuple(hf_greedy(hf_model(row), c, row.max_tokens) for c in row.conversations)


def meta_model(config: Any) -> Any:
    """Our model for `config`, built on the meta device."""
    from vlm_engine.models import registry

    with torch.device("meta"):
        return registry.model_class(config)(config)


STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 12}, "year": {"type": "integer"}},
    "required": ["title", "year"],
    "additionalProperties": False,
}
