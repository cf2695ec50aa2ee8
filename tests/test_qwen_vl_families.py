"""Qwen2.5-VL, Qwen3-VL and Qwen3-VL-MoE: greedy tokens from Engine equal Transformers' `generate` in
exact fp32 on tiny random checkpoints built from the real config classes (text; one image; two images
of odd sizes; multi-turn; video; image + video; batched = alone; prefix cache on = off; preempted and
chunked through the images = not), plus fast numerics against exact, structured output and
speculative decoding on the same checkpoints."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.conftest import make_image, to_hf_messages
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
from testkit.qwen_vl_checkpoints import cached_qwen2_5_vl, cached_qwen3_vl
from testkit.videos import make_clip

MAX_TOKENS = 20
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
FPS = 2.0
VARIANTS = {
    "qwen2.5-vl": lambda: cached_qwen2_5_vl("tiny"),
    "qwen3-vl": lambda: cached_qwen3_vl("tiny"),
    "qwen3-vl-moe": lambda: cached_qwen3_vl("tiny-moe"),
}


CONVERSATIONS = [*base_conversations(), wide_image()]
NAMES = ["text", "one-image", "two-odd-images", "multi-turn", "wide-image"]


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def variant(request: pytest.FixtureRequest) -> tuple[str, Path]:
    return request.param, VARIANTS[request.param]()


@pytest.fixture(scope="module")
def hf_model(variant: tuple[str, Path]) -> tuple[Any, Any]:
    return load_hf_model(variant[1])


@pytest.fixture(scope="module")
def references(hf_model: tuple[Any, Any]) -> list[list[int]]:
    return hf_references(hf_model, CONVERSATIONS, MAX_TOKENS)


@pytest.fixture(scope="module")
def engine(variant: tuple[str, Path]) -> Engine:
    return exact_engine(variant[1])


def test_prompt_equals_hf_processor(engine: Engine, hf_model: tuple[Any, Any]) -> None:
    _, processor = hf_model
    for conv in CONVERSATIONS:
        hf_messages, images = to_hf_messages(conv)
        text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
        ids = processor(text=[text], images=images or None, return_tensors="pt")["input_ids"][0].tolist()
        assert engine.process_messages(conv).token_ids == ids


@pytest.mark.parametrize("index", range(len(CONVERSATIONS)), ids=NAMES)
def test_alone_matches_hf(engine: Engine, references: list[list[int]], index: int) -> None:
    assert engine.chat([CONVERSATIONS[index]], GREEDY)[0].token_ids == references[index]


def test_batched_equals_alone(engine: Engine, references: list[list[int]]) -> None:
    assert [o.token_ids for o in engine.chat(CONVERSATIONS, GREEDY)] == references
    assert engine.pool.num_free == engine.pool.num_pages


def test_prefix_cache_on_equals_off(variant: tuple[str, Path], engine: Engine, references: list[list[int]]) -> None:
    conv = CONVERSATIONS[2]
    first = engine.chat([conv], GREEDY)[0]
    again = engine.chat([conv], GREEDY)[0]
    assert again.cached_tokens >= again.prompt_tokens - engine.config.cache.page_size  # the images' KV reused
    uncached = uncached_engine(variant[1])
    off = uncached.chat([conv], GREEDY)[0]
    assert off.cached_tokens == 0
    assert first.token_ids == again.token_ids == off.token_ids == references[2]


def test_preempted_and_chunked_through_images_equals_not(variant: tuple[str, Path], references: list[list[int]]) -> None:
    # 48-token chunks split every image's placeholder run (up to 64 tokens); a pool of two prompts'
    # worth makes the batch preempt.
    engine = Engine(
        str(variant[1]), dtype="float32", kv_cache_tokens=200, max_num_batched_tokens=48, page_size=8, numerics="exact"
    )
    assert [o.token_ids for o in engine.chat(CONVERSATIONS, GREEDY)] == references
    assert engine.scheduler.num_preemptions > 0
    assert engine.pool.num_free == engine.pool.num_pages


# ---- video ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def clip() -> bytes:
    return make_clip(width=97, height=75, fps=7, seconds=3, pix_fmt="yuv444p", picture=make_image(200, 150, 8))


def hf_video_greedy(hf_model: tuple[Any, Any], data: bytes, image: Any = None) -> list[int]:
    """Transformers end to end: its PyAV reader, its processor choosing frames and timing them."""
    from transformers.video_utils import read_video_pyav

    model, processor = hf_model
    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        f.write(data)
        f.flush()
        frames, metadata = read_video_pyav(
            f.name, lambda metadata, **_: processor.video_processor.sample_frames(metadata, fps=FPS)
        )
    content: list[dict[str, Any]] = [{"type": "video"}, {"type": "text", "text": "What happens?"}]
    if image is not None:
        content += [{"type": "image"}, {"type": "text", "text": "And here?"}]
    text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False)
    inputs = processor(
        text=[text],
        images=[image] if image is not None else None,
        videos=[frames],
        video_metadata=[metadata],
        do_sample_frames=False,
        return_tensors="pt",
    )
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


def video_conv(data: bytes, image: Any = None) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "video", "video": data}, {"type": "text", "text": "What happens?"}]
    if image is not None:
        content += [{"type": "image", "image": image}, {"type": "text", "text": "And here?"}]
    return [{"role": "user", "content": content}]


def test_video_matches_hf(engine: Engine, hf_model: tuple[Any, Any], clip: bytes) -> None:
    ours = engine.chat([video_conv(clip)], GREEDY, mm_processor_kwargs={"fps": FPS})[0]
    assert ours.token_ids == hf_video_greedy(hf_model, clip)


def test_image_and_video_match_hf(engine: Engine, hf_model: tuple[Any, Any], clip: bytes) -> None:
    image = make_image(61, 45, 9)
    conv = video_conv(clip, image)
    kinds = [m.kind for m in engine.process_messages(conv, mm_processor_kwargs={"fps": FPS}).media]
    assert kinds[0] == "video" and kinds[-1] == "image"
    ours = engine.chat([conv], GREEDY, mm_processor_kwargs={"fps": FPS})[0]
    assert ours.token_ids == hf_video_greedy(hf_model, clip, image)


def test_video_time_spaces_the_temporal_positions(engine: Engine, variant: tuple[str, Path], clip: bytes) -> None:
    """Qwen2.5-VL: a video's temporal positions step by tokens_per_second x seconds per frame group;
    Qwen3-VL: each frame group is its own item behind its timestamp text."""
    prompt = engine.process_messages(video_conv(clip), mm_processor_kwargs={"fps": FPS})
    videos = [m for m in prompt.media if m.kind == "video"]
    assert prompt.positions is not None
    if variant[0] == "qwen2.5-vl":
        (video,) = videos
        assert video.grid_seconds == pytest.approx(2 / FPS)  # 2 frames per temporal step at 2 fps
        t_axis = np.unique(prompt.positions[0, video.span.offset : video.span.end])
        assert list(np.diff(t_axis)) == [2] * (video.grid_thw[0] - 1)  # 2 tokens/s x 1 s per step
    else:
        assert len(videos) > 1 and all(v.grid_thw[0] == 1 for v in videos)
        assert engine.tokenizer.decode(prompt.token_ids).count(" seconds>") == len(videos)


# ---- the engine's other paths on these families --------------------------------------------------


def test_fast_numerics_agree_with_exact(variant: tuple[str, Path], engine: Engine) -> None:
    agreed = fast_agreement(variant[1], engine, [CONVERSATIONS[2], CONVERSATIONS[3]], MAX_TOKENS)
    assert min(agreed) >= MAX_TOKENS // 2, agreed


def test_structured_output_with_an_image(engine: Engine) -> None:
    params = SamplingParams(max_tokens=80, temperature=0.0, json_schema=STRUCTURED_SCHEMA)
    out = engine.chat([CONVERSATIONS[1]], params)[0]
    assert out.finish_reason == "stop"
    assert set(json.loads(out.text)) == {"title", "year"}


def test_ngram_speculation_is_token_exact(variant: tuple[str, Path], references: list[list[int]]) -> None:
    spec = Engine(
        str(variant[1]), dtype="float32", kv_cache_tokens=4096, numerics="exact",
        speculative="ngram", speculative_disable_batch_size=1000,
    )
    assert [o.token_ids for o in spec.chat(CONVERSATIONS[:3], GREEDY)] == references[:3]


def test_max_frames_caps_the_video(engine: Engine) -> None:
    """Qwen3-VL's frame sampler caps with its own max_frames attribute and ignores the caller's: the
    request's cap must still hold (8 frames = 4 temporal groups of 2), spread over the whole clip."""
    long_clip = make_clip(width=64, height=48, fps=10, seconds=20)
    prompt = engine.process_messages(video_conv(long_clip), mm_processor_kwargs={"fps": FPS, "max_frames": 8})
    assert sum(m.grid_thw[0] for m in prompt.media if m.kind == "video") == 4
