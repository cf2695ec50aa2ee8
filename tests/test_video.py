"""Video input: our frame sampler and decoder against Transformers' own (PyAV backend, the model's
video processor choosing the frames), greedy parity with HF `generate` on the tiny Qwen2-VL, the
caches, and the cost of decoding (only the frames needed)."""

from __future__ import annotations

import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from preprocess.errors import MediaError
from preprocess.video import FrameCache, decode_frames, hf_indices, load_video, probe
from tests.conftest import make_image
from vlm_engine import Engine, SamplingParams
from vlm_engine.config import MediaConfig
from testkit.videos import encode_clip, make_clip, pan_frames, pattern

MAX_TOKENS = 16
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
FPS = 2.0


def sampled(fps: float, max_frames: int, **limits: Any) -> MediaConfig:
    """Media config sampling videos at `fps`, at most `max_frames` (a request's own sampling)."""
    return MediaConfig(video_fps=fps, video_max_frames=max_frames, **limits)

# Each clip stresses one thing the decoder must get right.
CLIPS: dict[str, dict[str, Any]] = {
    "odd-size": {
        "width": 97,
        "height": 75,
        "fps": 7,
        "seconds": 3,
        "pix_fmt": "yuv444p",
    },  # x264 4:2:0 needs even sizes
    "ntsc-rate": {"width": 64, "height": 56, "fps": 30000 / 1001, "seconds": 2},
    "rotated": {"width": 96, "height": 64, "fps": 10, "seconds": 2, "rotation": 90},
    "short-gop-bframes": {"width": 96, "height": 64, "fps": 12, "seconds": 2, "gop": 6, "bframes": 2},
    "vp9-webm-odd": {"width": 77, "height": 59, "fps": 9, "seconds": 2, "codec": "libvpx-vp9", "container": "webm"},
    "mpeg4-avi": {"width": 80, "height": 64, "fps": 8, "seconds": 2, "codec": "mpeg4", "container": "avi"},
    "h264-mov": {"width": 96, "height": 64, "fps": 10, "seconds": 2, "container": "mov"},
    "hevc-mp4": {"width": 96, "height": 64, "fps": 10, "seconds": 2, "codec": "libx265"},
    "av1-mp4": {"width": 128, "height": 96, "fps": 10, "seconds": 2, "codec": "libsvtav1"},
}
VFR_TIMES_S = [0.0, 0.05, 0.3, 0.35, 0.4, 0.9, 1.0, 1.05, 1.5, 1.6, 2.0, 2.2, 2.3, 2.9, 3.0, 3.4]


def clip(name: str) -> bytes:
    import av

    codec = CLIPS.get(name, {}).get("codec", "libx264")
    if codec not in av.codecs_available:  # HEVC and AV1 only where the FFmpeg build has them
        pytest.skip(f"this PyAV build has no {codec} encoder")
    if name == "variable-rate":
        return encode_clip(
            pan_frames(pattern(192, 128, seed=3), 96, 64, len(VFR_TIMES_S)), 10, frame_times_s=VFR_TIMES_S
        )
    return make_clip(**CLIPS[name])


def hf_frames(data: bytes, video_processor: Any, fps: float, max_frames: int) -> tuple[np.ndarray, list[int]]:
    """Transformers' own PyAV reader, its frames chosen by the model's video processor."""
    from transformers.video_utils import read_video_pyav

    with tempfile.NamedTemporaryFile(suffix=".video") as f:
        f.write(data)
        f.flush()
        frames, metadata = read_video_pyav(
            f.name, lambda metadata, **_: video_processor.sample_frames(metadata, fps=fps, max_frames=max_frames)
        )
    return frames, [int(i) for i in metadata.frames_indices]


@pytest.fixture(scope="module")
def engine(tiny_vlm_dir: Path) -> Engine:
    return Engine(str(tiny_vlm_dir), dtype="float32", kv_cache_tokens=8192, numerics="exact")


# ---- frames: the same ones Transformers picks, decoded cheaper --------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "odd-size",
        "ntsc-rate",
        "rotated",
        "short-gop-bframes",
        "variable-rate",
        "mpeg4-avi",
        "h264-mov",
        "hevc-mp4",
        "av1-mp4",
    ],
)
def test_chosen_frames_equal_transformers(hf_tiny_vlm: Any, name: str) -> None:
    _, processor = hf_tiny_vlm
    data = clip(name)
    ref, ref_indices = hf_frames(data, processor.video_processor, FPS, 32)
    info = probe(data)
    ours = decode_frames(data, info, hf_indices(processor.video_processor)(info, sampled(FPS, 32)))
    assert ours.indices == ref_indices
    if name == "rotated":
        # Transformers' reader ignores the display matrix; players (and we) show the clip upright.
        ref = np.stack([np.rot90(f, k=1) for f in ref])
        assert ours.frames.shape[1:3] == (96, 64)
    np.testing.assert_array_equal(ours.frames, ref)


def test_webm_without_a_frame_count_is_still_sampled() -> None:
    # Matroska/WebM headers carry no frame count (Transformers' reader sees 0 frames); the packet
    # scan counts them.
    data = clip("vp9-webm-odd")
    info = probe(data)
    assert info.num_frames == 18 and info.container.startswith("matroska")
    video = load_video(data, sampled(2, 8))
    assert video.frames.shape == (4, 59, 77, 3)


def test_rotation_turns_frames_upright() -> None:
    upright = np.asarray(pattern(96, 64))  # its yellow marker is top-left
    data = encode_clip([upright] * 4, 4, rotation=90)  # stored sideways-tagged: shown turned 90° CCW
    frame = load_video(data, sampled(4, 4)).frames[0]
    assert frame.shape == (96, 64, 3)
    bottom_left = frame[-16:, :16].reshape(-1, 3).mean(0)
    assert bottom_left[0] > 200 and bottom_left[1] > 200 and bottom_left[2] < 90  # the marker, turned CCW


def test_sampling_decodes_a_fraction_of_the_frames() -> None:
    # 1 s GOPs at 30 fps, 2 fps wanted: seek to each keyframe, decode forward only as far as needed.
    data = make_clip(width=128, height=96, fps=30, seconds=4, gop=30)
    info = probe(data)
    assert info.num_frames == 120 and len(info.keyframe_pts) == 4
    video = load_video(data, sampled(2, 64))
    assert len(video.indices) == 8
    assert video.decoded < info.num_frames // 2, video.decoded


def test_frame_cache_skips_the_decode_and_is_bounded() -> None:
    data = make_clip(width=96, height=64, fps=10, seconds=2)
    cache = FrameCache(max_bytes=10 * 96 * 64 * 3)
    first = load_video(data, sampled(2, 8), cache=cache)
    again = load_video(data, sampled(2, 8), cache=cache)
    assert again is first and cache.hits == 1
    other = load_video(data, sampled(4, 8), cache=cache)  # other sampling: another entry
    assert other is not first and len(other.indices) == 8
    assert cache.nbytes <= cache.max_bytes and len(cache) == 1  # 4 + 8 frames do not both fit
    assert first.content_hash != other.content_hash


def test_limits_name_the_reason() -> None:
    data = make_clip(width=96, height=64, fps=10, seconds=3)
    with pytest.raises(MediaError, match="at most 2 s"):
        probe(data, MediaConfig(max_video_seconds=2))
    with pytest.raises(MediaError, match="too large"):
        probe(data, MediaConfig(max_video_bytes=100))
    with pytest.raises(MediaError, match="pixel"):
        load_video(data, sampled(4, 8, max_video_pixels=96 * 64 * 4))
    with pytest.raises(MediaError, match="at most 4 per video"):  # a chooser that ignores the cap
        decode_frames(data, probe(data), list(range(8)), MediaConfig(max_video_frames=4, video_max_frames=4))
    with pytest.raises(ValueError, match="video_max_frames 8 is above max_video_frames 4"):  # sampling over the cap
        sampled(2, 8, max_video_frames=4)


def test_a_spent_media_budget_stops_the_decode() -> None:
    data = make_clip(width=96, height=64, fps=10, seconds=2)
    with pytest.raises(MediaError, match="media time budget ran out"):
        load_video(data, sampled(2, 8), deadline=time.monotonic() - 1)
    assert len(load_video(data, sampled(2, 8), deadline=time.monotonic() + 60).indices) == 4


# ---- greedy parity with Transformers --------------------------------------------------------------


def video_conv(data: bytes, *extra: Any) -> list[dict[str, Any]]:
    content: list[dict[str, Any]] = [{"type": "video", "video": data}]
    for item in extra:
        content.append({"type": "text", "text": item} if isinstance(item, str) else {"type": "image", "image": item})
    return [{"role": "user", "content": content}]


def hf_video_greedy(hf: Any, data: bytes, rotate: int = 0, image: Any = None) -> list[int]:
    model, processor = hf
    frames, _ = hf_frames(data, processor.video_processor, FPS, 32)
    if rotate:
        frames = np.stack([np.rot90(f, k=rotate) for f in frames])
    content: list[dict[str, Any]] = [{"type": "video"}, {"type": "text", "text": "What happens in this video?"}]
    if image is not None:
        content += [{"type": "image"}, {"type": "text", "text": "And in this picture?"}]
    text = processor.apply_chat_template(
        [{"role": "user", "content": content}], add_generation_prompt=True, tokenize=False
    )
    inputs = processor(
        text=[text],
        images=[image] if image is not None else None,
        videos=[frames],
        do_sample_frames=False,
        return_tensors="pt",
    )
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("name", ["odd-size", "ntsc-rate", "rotated", "variable-rate"])
def test_greedy_tokens_equal_transformers(engine: Engine, hf_tiny_vlm: Any, name: str) -> None:
    data = clip(name)
    ours = engine.chat([video_conv(data, "What happens in this video?")], GREEDY, mm_processor_kwargs={"fps": FPS})[0]
    assert ours.token_ids == hf_video_greedy(hf_tiny_vlm, data, rotate=1 if name == "rotated" else 0)


def test_image_and_video_in_one_message(engine: Engine, hf_tiny_vlm: Any) -> None:
    data, image = clip("odd-size"), make_image(64, 48, 11)
    conv = video_conv(data, "What happens in this video?", image, "And in this picture?")
    prompt = engine.process_messages(conv)
    assert [m.kind for m in prompt.media] == ["video", "image"]
    out = engine.chat([conv], GREEDY)[0]
    assert out.token_ids == hf_video_greedy(hf_tiny_vlm, data, image=image)


def test_a_batch_of_videos_equals_each_alone(engine: Engine) -> None:
    convs = [video_conv(clip(n), "Describe.") for n in ("odd-size", "ntsc-rate", "short-gop-bframes")]
    convs.append([{"role": "user", "content": "Only text here."}])
    batched = engine.chat(convs, GREEDY)
    alone = [engine.chat([c], GREEDY)[0] for c in convs]
    assert [o.token_ids for o in batched] == [o.token_ids for o in alone]
    assert engine.pool.num_free == engine.pool.num_pages


def test_the_same_video_twice_costs_one_encode_and_one_decode(engine: Engine) -> None:
    data = make_clip(width=96, height=64, fps=10, seconds=2, picture=make_image(200, 120, 21))
    encodes_before = engine.runner.encoder_cache.misses
    hits_before = engine.processor.frame_cache.hits
    first = engine.chat([video_conv(data, "Describe it.")], GREEDY)[0]
    second = engine.chat([video_conv(data, "Describe it again, differently.")], GREEDY)[0]
    assert engine.processor.frame_cache.hits == hits_before + 1  # the second request skipped decoding
    assert second.cached_tokens >= first.prompt_tokens - 32  # the video's KV came from the prefix cache
    assert engine.runner.encoder_cache.misses == encodes_before + 1  # one vision encode for both
