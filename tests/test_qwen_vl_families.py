"""The Qwen-VL families beyond the family matrix (tests/test_family_matrix.py): Qwen2.5-VL, Qwen3-VL and
Qwen3-VL-MoE on video (alone, with an image, the temporal positions, the frame cap) against Transformers end
to end, n-gram speculation token-exact; Qwen2-VL with requests arriving while others decode and a prefix
cache that reuses only the text before a different picture."""

from __future__ import annotations

import tempfile
from typing import Any

import numpy as np
import pytest
import torch

from tests.conftest import make_image, user
from tests.family_table import Family, exact_engine, family, hf_model, references
from vlm_engine import Engine
from testkit.videos import make_clip

FPS = 2.0
MAX_TOKENS = 20
GREEDY = family("qwen2.5-vl").greedy


@pytest.fixture(scope="module", params=["qwen2.5-vl", "qwen3-vl", "qwen3-vl-moe"])
def row(request: pytest.FixtureRequest) -> Family:
    return family(request.param)


@pytest.fixture(scope="module")
def engine(row: Family) -> Engine:
    return exact_engine(row)


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


def test_video_matches_hf(engine: Engine, row: Family, clip: bytes) -> None:
    ours = engine.chat([video_conv(clip)], GREEDY, mm_processor_kwargs={"fps": FPS})[0]
    assert ours.token_ids == hf_video_greedy(hf_model(row), clip)


def test_image_and_video_match_hf(engine: Engine, row: Family, clip: bytes) -> None:
    image = make_image(61, 45, 9)
    conv = video_conv(clip, image)
    kinds = [m.kind for m in engine.process_messages(conv, mm_processor_kwargs={"fps": FPS}).media]
    assert kinds[0] == "video" and kinds[-1] == "image"
    ours = engine.chat([conv], GREEDY, mm_processor_kwargs={"fps": FPS})[0]
    assert ours.token_ids == hf_video_greedy(hf_model(row), clip, image)


def test_video_time_spaces_the_temporal_positions(engine: Engine, row: Family, clip: bytes) -> None:
    """Qwen2.5-VL: a video's temporal positions step by tokens_per_second x seconds per frame group;
    Qwen3-VL: each frame group is its own item behind its timestamp text."""
    prompt = engine.process_messages(video_conv(clip), mm_processor_kwargs={"fps": FPS})
    videos = [m for m in prompt.media if m.kind == "video"]
    assert prompt.positions is not None
    if row.name == "qwen2.5-vl":
        (video,) = videos
        assert video.grid_seconds == pytest.approx(2 / FPS)  # 2 frames per temporal step at 2 fps
        t_axis = np.unique(prompt.positions[0, video.span.offset : video.span.end])
        assert list(np.diff(t_axis)) == [2] * (video.grid_thw[0] - 1)  # 2 tokens/s x 1 s per step
    else:
        assert len(videos) > 1 and all(v.grid_thw[0] == 1 for v in videos)
        assert engine.tokenizer.decode(prompt.token_ids).count(" seconds>") == len(videos)


def test_ngram_speculation_is_token_exact(row: Family) -> None:
    spec = Engine(
        str(row.path), dtype="float32", kv_cache_tokens=4096, numerics="exact",
        speculative="ngram", speculative_disable_batch_size=1000,
    )
    assert [o.token_ids for o in spec.chat(row.conversations[:3], row.greedy)] == list(references(row)[:3])


def test_max_frames_caps_the_video(engine: Engine) -> None:
    """Qwen3-VL's frame sampler caps with its own max_frames attribute and ignores the caller's: the
    request's cap must still hold (8 frames = 4 temporal groups of 2), spread over the whole clip."""
    long_clip = make_clip(width=64, height=48, fps=10, seconds=20)
    prompt = engine.process_messages(video_conv(long_clip), mm_processor_kwargs={"fps": FPS, "max_frames": 8})
    assert sum(m.grid_thw[0] for m in prompt.media if m.kind == "video") == 4


# ---- Qwen2-VL ---------------------------------------------------------------------------------------------


def test_requests_arriving_while_others_decode() -> None:
    qwen2_vl = family("qwen2-vl")
    engine, convs, greedy = exact_engine(qwen2_vl), qwen2_vl.conversations, qwen2_vl.greedy
    pending = {engine.add_request(engine.process_messages(convs[i]), greedy): i for i in (0, 1)}
    results: dict[int, list[int]] = {}
    later = [2, 3, 4, 5, 6, 7]
    steps = 0
    while pending:
        for out in engine.step():
            if out.finished:
                results[pending.pop(out.request_id)] = out.token_ids
        steps += 1
        if later and steps % 3 == 0:  # a newcomer every few decode steps
            i = later.pop(0)
            pending[engine.add_request(engine.process_messages(convs[i]), greedy)] = i
    assert [results[i] for i in range(8)] == list(references(qwen2_vl))


def test_prefix_cache_reuses_only_the_text_before_another_picture() -> None:
    qwen2_vl = family("qwen2-vl")
    engine = exact_engine(qwen2_vl)
    first = engine.chat([qwen2_vl.conversations[4]], qwen2_vl.greedy)[0]
    again = engine.chat([qwen2_vl.conversations[4]], qwen2_vl.greedy)[0]
    assert first.token_ids == again.token_ids == references(qwen2_vl)[4]
    assert again.cached_tokens > 0 and again.cached_tokens >= again.prompt_tokens - engine.config.cache.page_size
    other_image = user(make_image(120, 120, 99), "Describe it in detail.")
    third = engine.chat([other_image], qwen2_vl.greedy)[0]
    # Same text and placeholder count, different pixels: only the text before the image is reusable.
    image_offset = engine.process_messages(other_image).media[0].span.offset
    assert third.cached_tokens <= image_offset
