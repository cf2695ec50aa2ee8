"""SmolVLM2: greedy tokens from Engine equal Transformers' `generate` in exact fp32 on a tiny random
checkpoint built from the real config and processor classes (text; one image; two images of odd sizes
that tile differently; multi-turn; a wide image; video; batched = alone; prefix cache on = off;
preempted and chunked through the tiles = not), the processor's prompt ids equal ours, and an image
with a video in one prompt (which Transformers' processor cannot give pixels for: one `pixel_values`)
equals Transformers' model fed every tile and frame in prompt order."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import hf_greedy, make_image, to_hf_messages, user
from tests.family_matrix import (
    STRUCTURED_SCHEMA,
    base_conversations,
    exact_engine,
    fast_agreement,
    hf_references,
    load_hf_model,
    uncached_engine,
    wide_image,
)
from vlm_engine import Engine, SamplingParams
from testkit.smolvlm_checkpoints import cached_smolvlm
from testkit.videos import make_clip

MAX_TOKENS = 20
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
FPS = 2.0
TILE_TOKENS = 16  # the tiny preset: 64-px tiles, 8-px patches, pixel shuffle by 2

# text; one image; two odd images: 97x41 -> 3 x 2 tiles + the global image, 30x90 -> 1 x 3 + the global
# image; multi-turn; a wide image
CONVERSATIONS = [*base_conversations(second_image=(30, 90)), wide_image()]
NAMES = ["text", "one-image", "two-odd-images", "multi-turn", "wide-image"]


@pytest.fixture(scope="module")
def path() -> Path:
    return cached_smolvlm("tiny")


@pytest.fixture(scope="module")
def hf_model(path: Path) -> tuple[Any, Any]:
    return load_hf_model(path)


@pytest.fixture(scope="module")
def references(hf_model: tuple[Any, Any]) -> list[list[int]]:
    return hf_references(hf_model, CONVERSATIONS, MAX_TOKENS)


@pytest.fixture(scope="module")
def engine(path: Path) -> Engine:
    return exact_engine(path)


def test_prompt_equals_hf_processor(engine: Engine, hf_model: tuple[Any, Any]) -> None:
    _, processor = hf_model
    for conv in CONVERSATIONS:
        hf_messages, images = to_hf_messages(conv)
        text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
        ids = processor(text=[text], images=images or None, return_tensors="pt")["input_ids"][0].tolist()
        assert engine.process_messages(conv).token_ids == ids


def test_one_item_per_tile(engine: Engine) -> None:
    """Each tile and each global image is one run of image tokens and one media item, with a hash of
    its own; the same picture gives the same tile hashes."""
    prompt = engine.process_messages(CONVERSATIONS[2])
    assert len(prompt.media) == (3 * 2 + 1) + (1 * 3 + 1)
    assert all(m.span.length == TILE_TOKENS and m.grid_thw == (1, 8, 8) for m in prompt.media)
    assert len({m.span.content_hash for m in prompt.media}) == len(prompt.media)
    again = engine.process_messages(user("Again:", make_image(97, 41, 2)))
    assert [m.span.content_hash for m in again.media] == [m.span.content_hash for m in prompt.media[:7]]


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)), ids=NAMES)
def test_alone_matches_hf(engine: Engine, references: list[list[int]], index: int) -> None:
    assert engine.chat([CONVERSATIONS[index]], GREEDY)[0].token_ids == references[index]


def test_batched_equals_alone(engine: Engine, references: list[list[int]]) -> None:
    assert [o.token_ids for o in engine.chat(CONVERSATIONS, GREEDY)] == references
    assert engine.pool.num_free == engine.pool.num_pages


def test_prefix_cache_on_equals_off(path: Path, engine: Engine, references: list[list[int]]) -> None:
    conv = CONVERSATIONS[2]
    first = engine.chat([conv], GREEDY)[0]
    again = engine.chat([conv], GREEDY)[0]
    assert again.cached_tokens >= again.prompt_tokens - engine.config.cache.page_size  # the tiles' KV reused
    uncached = uncached_engine(path)
    off = uncached.chat([conv], GREEDY)[0]
    assert off.cached_tokens == 0
    assert first.token_ids == again.token_ids == off.token_ids == references[2]


def test_preempted_and_chunked_through_tiles_equals_not(path: Path, references: list[list[int]]) -> None:
    # 40-token chunks end inside tiles' 16-token runs; a pool of about one long prompt makes the batch preempt.
    engine = Engine(
        str(path), dtype="float32", kv_cache_tokens=320, max_num_batched_tokens=40, page_size=8, numerics="exact"
    )
    assert [o.token_ids for o in engine.chat(CONVERSATIONS, GREEDY)] == references
    assert engine.scheduler.num_preemptions > 0
    assert engine.pool.num_free == engine.pool.num_pages


# ---- video ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clip() -> bytes:
    return make_clip(width=97, height=75, fps=7, seconds=3, pix_fmt="yuv444p", picture=make_image(200, 150, 8))


def hf_video_inputs(processor: Any, data: bytes, image: Any = None) -> tuple[Any, Any]:
    """Transformers end to end: its PyAV reader, its sampler choosing frames, its processor writing
    their timestamps (and the chat template it swaps in for videos)."""
    from transformers.video_utils import read_video_pyav

    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        f.write(data)
        f.flush()
        frames, metadata = read_video_pyav(
            f.name, lambda metadata, **_: processor.video_processor.sample_frames(metadata, fps=FPS)
        )
    conv = video_conv(b"", image)
    content = [{"type": p["type"]} if p["type"] != "text" else p for p in conv[0]["content"]]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True)
    inputs = processor(
        text=[text],
        images=[image] if image is not None else None,
        videos=[frames],
        video_metadata=[metadata],
        do_sample_frames=False,
        return_tensors="pt",
    )
    return inputs, frames


def video_conv(data: bytes, image: Any = None) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "video", "video": data}, {"type": "text", "text": "What happens?"}]
    if image is not None:
        content += [{"type": "image", "image": image}, {"type": "text", "text": "And here?"}]
    return [{"role": "user", "content": content}]


def _generate(model: Any, inputs: Any) -> list[int]:
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def test_video_matches_hf(engine: Engine, hf_model: tuple[Any, Any], clip: bytes) -> None:
    model, processor = hf_model
    inputs, frames = hf_video_inputs(processor, clip)
    prompt = engine.process_messages(video_conv(clip), mm_processor_kwargs={"fps": FPS})
    assert prompt.token_ids == inputs["input_ids"][0].tolist()
    assert len(prompt.media) == len(frames)
    assert engine.tokenizer.decode(prompt.token_ids).count("Frame from 00:0") == len(frames)
    ours = engine.chat([video_conv(clip)], GREEDY, mm_processor_kwargs={"fps": FPS})[0]
    assert ours.token_ids == _generate(model, inputs)


def test_image_and_video_match_hf_model(engine: Engine, hf_model: tuple[Any, Any], clip: bytes) -> None:
    """Transformers' processor writes the prompt of a video and an image but keeps only the video's pixels;
    its model, given the frames and then the image's tiles (prompt order), is the reference."""
    model, processor = hf_model
    image = make_image(61, 45, 9)
    inputs, _ = hf_video_inputs(processor, clip, image)
    tiles = processor.image_processor([[image]], return_tensors="pt")["pixel_values"]
    inputs["pixel_values"] = torch.cat([inputs["pixel_values"], tiles], dim=1)
    inputs.pop("pixel_attention_mask")
    conv = video_conv(clip, image)
    prompt = engine.process_messages(conv, mm_processor_kwargs={"fps": FPS})
    assert prompt.token_ids == inputs["input_ids"][0].tolist()
    assert prompt.media[0].kind == "video" and prompt.media[-1].kind == "image"
    ours = engine.chat([conv], GREEDY, mm_processor_kwargs={"fps": FPS})[0]
    assert ours.token_ids == _generate(model, inputs)


def test_max_frames_caps_the_video(engine: Engine) -> None:
    long_clip = make_clip(width=64, height=48, fps=10, seconds=20)
    prompt = engine.process_messages(video_conv(long_clip), mm_processor_kwargs={"fps": FPS, "max_frames": 8})
    assert len([m for m in prompt.media if m.kind == "video"]) == 8


# ---- the engine's other paths on this family -----------------------------------------------------


def test_fast_numerics_agree_with_exact(path: Path, engine: Engine) -> None:
    agreed = fast_agreement(path, engine, [CONVERSATIONS[2], CONVERSATIONS[3]], MAX_TOKENS)
    assert min(agreed) >= MAX_TOKENS // 2, agreed


def test_structured_output_with_an_image(engine: Engine) -> None:
    params = SamplingParams(max_tokens=80, temperature=0.0, json_schema=STRUCTURED_SCHEMA)
    out = engine.chat([CONVERSATIONS[1]], params)[0]
    assert out.finish_reason == "stop"
    assert set(json.loads(out.text)) == {"title", "year"}


# ---- Idefics3 (SmolVLM v1's architecture and processor) -------------------------------------------


def test_idefics3_matches_hf() -> None:
    """The same family serves Idefics3ForConditionalGeneration with Idefics3Processor (images only)."""
    path = cached_smolvlm("tiny-idefics3")
    hf = load_hf_model(path)
    assert type(hf[0]).__name__ == "Idefics3ForConditionalGeneration"
    engine = Engine(str(path), dtype="float32", kv_cache_tokens=4096, numerics="exact")
    assert not engine.processor.accepts_videos
    convs = CONVERSATIONS[:3]
    assert [o.token_ids for o in engine.chat(convs, GREEDY)] == [hf_greedy(hf, c, MAX_TOKENS) for c in convs]
