"""Shared pieces of the per-family parity matrices (Qwen-VL, SmolVLM, Gemma 3) and their checkpoint-name
checks: the conversation shapes every family runs, Transformers' reference model and greedy tokens, the
exact-numerics engine, and the meta-device load of a released checkpoint's names."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tests.conftest import hf_greedy, make_image, user
from vlm_engine import Engine, SamplingParams


def base_conversations(second_image: tuple[int, int] = (37, 83)) -> list[list[dict[str, Any]]]:
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


def wide_image() -> list[dict[str, Any]]:
    return user(make_image(230, 57, 5), "A wide one.")


def load_hf_model(path: Path) -> tuple[Any, Any]:
    """Transformers' fp32 model and processor of a local checkpoint."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(str(path))


def hf_references(hf_model: tuple[Any, Any], conversations: list[Any], max_tokens: int) -> list[list[int]]:
    return [hf_greedy(hf_model, c, max_tokens) for c in conversations]


def exact_engine(path: Path) -> Engine:
    return Engine(str(path), dtype="float32", kv_cache_tokens=8192, numerics="exact")


STRUCTURED_SCHEMA = {
    "type": "object",
    "properties": {"title": {"type": "string", "maxLength": 12}, "year": {"type": "integer"}},
    "required": ["title", "year"],
    "additionalProperties": False,
}


def meta_model(config: Any) -> Any:
    """Our model for `config`, built on the meta device."""
    from vlm_engine.models import registry

    with torch.device("meta"):
        return registry.model_class(config)(config)


def uncached_engine(path: Path) -> Engine:
    """The exact engine with the prefix cache off: what a cached run must equal."""
    return Engine(str(path), dtype="float32", kv_cache_tokens=2048, numerics="exact", enable_prefix_cache=False)


def fast_agreement(path: Path, engine: Engine, convs: list[Any], max_tokens: int) -> list[int]:
    """Per conversation, how many greedy tokens fast fp32 numerics agree on with `engine` (exact)."""
    from tests.test_fast_numerics import compare_greedy_logprobs

    fast = Engine(str(path), dtype="float32", kv_cache_tokens=2048, numerics="fast")
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, logprobs=5)
    return [compare_greedy_logprobs(f, e) for f, e in zip(fast.chat(convs, params), engine.chat(convs, params))]
