"""Gemma 3: greedy tokens from Engine equal Transformers' `generate` in exact fp32 on a tiny random
checkpoint built from the real config classes (testkit/gemma3_checkpoints.py: a 32-token
sliding window on 3 of 5 layers, 16 tokens an image): text; one image; two images of odd sizes;
multi-turn; prompts longer than the window with images on both sides of its edge; batched = alone;
prefix cache on = off; preempted = not; prefill chunks whose budget ends inside an image; pan-and-scan
crops. Plus fast numerics (fp32) against exact, and the bf16 fused path against bf16 exact."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import make_image, to_hf_messages, user
from tests.family_matrix import (
    base_conversations,
    exact_engine,
    fast_agreement,
    hf_references,
    load_hf_model,
    uncached_engine,
)
from tests.test_fast_numerics import greedy_agreement
from vlm_engine import Engine, SamplingParams
from testkit.gemma3_checkpoints import GEMMA3_PRESETS, cached_gemma3

MAX_TOKENS = 24
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
WINDOW = GEMMA3_PRESETS["tiny"]["text"]["sliding_window"]

LONG_TEXT = (
    "The old bridge crossed the river near the market, and every morning the farmers walked over it "
    "with their baskets of apples, bread and flowers while the children ran ahead to the school."
)
CONVERSATIONS = [
    *base_conversations(),
    # Longer than the window: the first image and the text after it fall out of the sliding layers'
    # window before the second image and the question, which sit inside it.
    user("Look:", make_image(80, 60, 5), LONG_TEXT, make_image(45, 90, 6), "And now, what changed?"),
    # An image right at the start, then a long text: the image leaves the window during the prompt.
    user(make_image(120, 40, 7), LONG_TEXT + " " + LONG_TEXT),
]
NAMES = ["text", "one-image", "two-odd-images", "multi-turn", "images-across-window", "image-then-long-text"]


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return cached_gemma3("tiny")


@pytest.fixture(scope="module")
def hf_model(checkpoint: Path) -> tuple[Any, Any]:
    return load_hf_model(checkpoint)


@pytest.fixture(scope="module")
def references(hf_model: tuple[Any, Any]) -> list[list[int]]:
    return hf_references(hf_model, CONVERSATIONS, MAX_TOKENS)


@pytest.fixture(scope="module")
def engine(checkpoint: Path) -> Engine:
    return exact_engine(checkpoint)


def test_the_model_has_windows_and_bidirectional_images(engine: Engine) -> None:
    model: Any = engine.model
    assert model.attention_windows == (WINDOW, WINDOW, 0, WINDOW, 0)
    assert model.bidirectional_media is True
    assert [layer.self_attn.window for layer in model.model.layers] == list(model.attention_windows)


def test_long_prompts_cross_the_window(engine: Engine) -> None:
    for conv in CONVERSATIONS[4:]:
        prompt = engine.process_messages(conv)
        first, last = prompt.media[0].span, prompt.media[-1].span
        assert len(prompt.token_ids) - first.end > WINDOW  # the first image leaves the window
        if len(prompt.media) > 1:
            assert len(prompt.token_ids) - last.end < WINDOW  # the last one is (at least partly) inside it


def test_prompt_equals_hf_processor(engine: Engine, hf_model: tuple[Any, Any]) -> None:
    _, processor = hf_model
    for conv in CONVERSATIONS:
        hf_messages, images = to_hf_messages(conv)
        text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
        inputs = processor(text=[text], images=images or None, return_tensors="pt")
        prompt = engine.process_messages(conv)
        assert prompt.token_ids == inputs["input_ids"][0].tolist()
        # one item per image, its span the image-token run (Transformers' bidirectional block)
        image_rows = [i for i, t in enumerate(inputs["token_type_ids"][0].tolist()) if t == 1]
        assert [i for m in prompt.media for i in range(m.span.offset, m.span.end)] == image_rows
        assert len(prompt.media) == len(images)


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)), ids=NAMES)
def test_alone_matches_hf(engine: Engine, references: list[list[int]], index: int) -> None:
    assert engine.chat([CONVERSATIONS[index]], GREEDY)[0].token_ids == references[index]


def test_batched_equals_alone(engine: Engine, references: list[list[int]]) -> None:
    assert [o.token_ids for o in engine.chat(CONVERSATIONS, GREEDY)] == references
    assert engine.pool.num_free == engine.pool.num_pages


def test_prefix_cache_on_equals_off(checkpoint: Path, engine: Engine, references: list[list[int]]) -> None:
    conv = CONVERSATIONS[4]  # longer than the window: the sliding layers' cached pages cross its edge
    first = engine.chat([conv], GREEDY)[0]
    again = engine.chat([conv], GREEDY)[0]
    assert again.cached_tokens > 0
    uncached = uncached_engine(checkpoint)
    off = uncached.chat([conv], GREEDY)[0]
    assert off.cached_tokens == 0
    assert first.token_ids == again.token_ids == off.token_ids == references[4]


def test_preempted_equals_not(checkpoint: Path, references: list[list[int]]) -> None:
    # A pool of about two prompts' worth, filled by 48-token chunks of several prompts, makes the batch preempt.
    engine = Engine(
        str(checkpoint), dtype="float32", kv_cache_tokens=256, max_num_batched_tokens=48, page_size=16, numerics="exact"
    )
    assert [o.token_ids for o in engine.chat(CONVERSATIONS, GREEDY)] == references
    assert engine.scheduler.num_preemptions > 0
    assert engine.pool.num_free == engine.pool.num_pages


def test_chunked_prefill_with_the_budget_inside_an_image(checkpoint: Path, references: list[list[int]]) -> None:
    """24-token chunks: the budget runs out inside image spans (16 tokens each, not at 24-token
    boundaries); the chunk ends before such an image, whose tokens attend to each other both ways."""
    engine = Engine(
        str(checkpoint), dtype="float32", kv_cache_tokens=4096, max_num_batched_tokens=24, page_size=16, numerics="exact"
    )
    prompts = [engine.process_messages(c) for c in CONVERSATIONS]
    assert any(m.span.offset // 24 != (m.span.end - 1) // 24 for p in prompts for m in p.media)
    for conv, want in zip(CONVERSATIONS, references):
        assert engine.chat([conv], GREEDY)[0].token_ids == want
    assert [o.token_ids for o in engine.chat(CONVERSATIONS, GREEDY)] == references


# ---- pan-and-scan --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pan_and_scan_checkpoint(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with the processor's pan-and-scan on (crops of at least 16 px)."""
    path = tmp_path_factory.mktemp("gemma3-pan-and-scan")
    for file in checkpoint.iterdir():
        if file.is_file():
            (path / file.name).symlink_to(file)
    config_file = path / "processor_config.json"
    config = json.loads(config_file.read_text())
    config["image_processor"].update(do_pan_and_scan=True, pan_and_scan_min_crop_size=16)
    config_file.unlink()  # a symlink into the cache: write a file of our own in its place
    config_file.write_text(json.dumps(config))
    return path


def test_pan_and_scan_crops_match_hf(pan_and_scan_checkpoint: Path, hf_model: tuple[Any, Any]) -> None:
    """The checkpoint's image processor config turns pan-and-scan on; Transformers' processor takes it
    as a call argument: each crop is an image-token run and a media item of its own."""
    from transformers import AutoProcessor

    model, _ = hf_model
    processor = AutoProcessor.from_pretrained(str(pan_and_scan_checkpoint))
    conv = user("Wide and tall:", make_image(150, 40, 8), make_image(30, 100, 9), "Describe both.")
    hf_messages, images = to_hf_messages(conv)
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(
        text=[text], images=images, return_tensors="pt", do_pan_and_scan=True, pan_and_scan_min_crop_size=16
    )
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    want = out[0, inputs["input_ids"].shape[1] :].tolist()
    engine = Engine(str(pan_and_scan_checkpoint), dtype="float32", kv_cache_tokens=4096, numerics="exact")
    prompt = engine.process_messages(conv)
    assert prompt.token_ids == inputs["input_ids"][0].tolist()
    assert len(prompt.media) == len(inputs["pixel_values"]) > len(images)  # crops: items of their own
    assert len({m.span.content_hash for m in prompt.media}) == len(prompt.media)
    assert engine.chat([conv], GREEDY)[0].token_ids == want


# ---- the engine's other numerics on this family --------------------------------------------------


def test_fast_numerics_agree_with_exact(checkpoint: Path, engine: Engine) -> None:
    agreed = fast_agreement(checkpoint, engine, [CONVERSATIONS[2], CONVERSATIONS[4]], MAX_TOKENS)
    assert min(agreed) >= MAX_TOKENS // 2, agreed


def test_bf16_fused_path_runs_gemma_layers(checkpoint: Path) -> None:
    """bf16 fast numerics (fused ops on, linears prepacked): Gemma's layers have no fused plan and run
    as their modules with the fused ops that are exact for them; greedy tokens agree with bf16 exact
    (Transformers' ops) for most of the run."""
    fast = Engine(str(checkpoint), dtype="bfloat16", kv_cache_tokens=2048, numerics="fast")
    exact = Engine(str(checkpoint), dtype="bfloat16", kv_cache_tokens=2048, numerics="exact")
    if fast.runner.fused_ops is None:
        pytest.skip("the fused-ops extension did not build here")
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    convs = CONVERSATIONS[:3]
    agreed = [greedy_agreement(f.token_ids, e.token_ids) for f, e in zip(fast.chat(convs, params), exact.chat(convs, params))]
    assert sum(agreed) >= len(convs) * MAX_TOKENS // 2, agreed
