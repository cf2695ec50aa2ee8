"""The media options take effect in process as in the server: `Engine(video_fps=...,
video_max_frames=..., limit_mm_per_prompt=..., max_video_seconds=..., video_device=...)` reach the
prompt processor (one `registry.prompt_processor(source, hf_config, media)` for both), where they
were once accepted and ignored. The tiny Qwen2-VL's sampler takes frames in pairs (its temporal
patch, at least 4), so a video of N sampled frames has a temporal grid of N / 2."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from preprocess.errors import PromptError
from tests.conftest import make_image
from testkit.videos import make_clip
from vlm_engine import Engine
from vlm_engine.config import MediaPerPrompt

CLIP = make_clip(width=96, height=64, fps=10, seconds=6)  # 60 frames: the defaults (2 fps, 32 at most) sample 12


@pytest.fixture(scope="module")
def engine(tiny_vlm_dir: Path) -> Engine:
    return Engine(
        str(tiny_vlm_dir),
        dtype="float32",
        kv_cache_tokens=4096,
        video_fps=1.0,
        video_max_frames=8,
        limit_mm_per_prompt=MediaPerPrompt(image=1, video=1),
        max_video_seconds=6.0,
    )


def video_message(data: bytes, **sampling: Any) -> list[dict[str, Any]]:
    return [{"role": "user", "content": [{"type": "video", "video": data, **sampling}, {"type": "text", "text": "?"}]}]


def sampled_frames(engine: Engine, messages: list[dict[str, Any]], **kwargs: Any) -> int:
    (video,) = engine.process_messages(messages, **kwargs).media
    return video.grid_thw[0] * 2


def test_the_engines_video_sampling_applies(engine: Engine) -> None:
    assert sampled_frames(engine, video_message(CLIP)) == 6  # video_fps 1
    # A request's own fps is capped by the engine's video_max_frames (8), not the default's 32.
    assert sampled_frames(engine, video_message(CLIP), mm_processor_kwargs={"fps": 10}) == 8
    assert sampled_frames(engine, video_message(CLIP, fps=4)) == 8  # a part's own fps, same cap


def test_the_engines_video_length_limit_applies(engine: Engine) -> None:
    longer = make_clip(width=96, height=64, fps=10, seconds=7)
    with pytest.raises(PromptError, match="at most 6 s"):
        engine.process_messages(video_message(longer))  # the default allows 600 s


def test_the_engines_media_per_prompt_applies(engine: Engine) -> None:
    image = make_image(32, 32, seed=1)
    one = [{"role": "user", "content": [{"type": "image", "image": image}, {"type": "text", "text": "?"}]}]
    assert len(engine.process_messages(one).media) == 1
    two = [{"role": "user", "content": [{"type": "image", "image": image}, *one[0]["content"]]}]
    with pytest.raises(PromptError, match="at most 1 images per prompt"):
        engine.process_messages(two)  # the default allows 8
    videos = [{"role": "user", "content": [{"type": "video", "video": CLIP}, *video_message(CLIP)[0]["content"]]}]
    with pytest.raises(PromptError, match="at most 1 videos per prompt"):
        engine.process_messages(videos)


@pytest.mark.skipif(torch.cuda.is_available(), reason="asks for CUDA resizing where torch sees no CUDA device")
def test_the_engines_video_device_applies(tiny_vlm_dir: Path) -> None:
    with pytest.raises(ValueError, match="video device cuda was asked for"):
        Engine(str(tiny_vlm_dir), dtype="float32", kv_cache_tokens=4096, video_device="cuda")
