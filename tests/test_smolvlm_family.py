"""SmolVLM2 beyond the family matrix (tests/test_family_matrix.py): one media item per tile, and video
against Transformers end to end (the processor's prompt ids equal ours), and an image with a video in one
prompt (which Transformers' processor cannot give pixels for: one `pixel_values`), which equals Transformers'
model fed every tile and frame in prompt order."""

from __future__ import annotations

import tempfile
from typing import Any

import pytest
import torch

from tests.conftest import make_image, user
from tests.family_table import exact_engine, family, hf_model
from vlm_engine import Engine
from testkit.videos import make_clip

SMOLVLM = family("smolvlm")
MAX_TOKENS = SMOLVLM.max_tokens
GREEDY = SMOLVLM.greedy
FPS = 2.0
TILE_TOKENS = 16  # the tiny preset: 64-px tiles, 8-px patches, pixel shuffle by 2


@pytest.fixture(scope="module")
def engine() -> Engine:
    return exact_engine(SMOLVLM)


def test_one_item_per_tile(engine: Engine) -> None:
    """Each tile and each global image is one run of image tokens and one media item, with a hash of
    its own; the same picture gives the same tile hashes."""
    prompt = engine.process_messages(SMOLVLM.conversations[2])
    assert len(prompt.media) == (3 * 2 + 1) + (1 * 3 + 1)
    assert all(m.span.length == TILE_TOKENS and m.grid_thw == (1, 8, 8) for m in prompt.media)
    assert len({m.span.content_hash for m in prompt.media}) == len(prompt.media)
    again = engine.process_messages(user("Again:", make_image(97, 41, 2)))
    assert [m.span.content_hash for m in again.media] == [m.span.content_hash for m in prompt.media[:7]]


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


def test_video_matches_hf(engine: Engine, clip: bytes) -> None:
    model, processor = hf_model(SMOLVLM)
    inputs, frames = hf_video_inputs(processor, clip)
    prompt = engine.process_messages(video_conv(clip), mm_processor_kwargs={"fps": FPS})
    assert prompt.token_ids == inputs["input_ids"][0].tolist()
    assert len(prompt.media) == len(frames)
    assert engine.tokenizer.decode(prompt.token_ids).count("Frame from 00:0") == len(frames)
    ours = engine.chat([video_conv(clip)], GREEDY, mm_processor_kwargs={"fps": FPS})[0]
    assert ours.token_ids == _generate(model, inputs)


def test_image_and_video_match_hf_model(engine: Engine, clip: bytes) -> None:
    """Transformers' processor writes the prompt of a video and an image but keeps only the video's pixels;
    its model, given the frames and then the image's tiles (prompt order), is the reference."""
    model, processor = hf_model(SMOLVLM)
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
