"""Video clips made here with PyAV, for tests and benchmarks (nothing downloaded).

Each clip pans across a picture (a real photo or a synthetic pattern), so every frame differs
and a wrongly chosen frame shows up as different pixels. Knobs cover what the decoder has to get
right: odd sizes, odd and variable frame rates, rotation metadata, GOP length, codecs and
containers."""

from __future__ import annotations

import io
from fractions import Fraction

import numpy as np
from PIL import Image


def pattern(width: int, height: int, seed: int = 0) -> Image.Image:
    """A deterministic, asymmetric picture (top and bottom differ; so do left and right)."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width]
    pixels = np.stack([(x * 255 // max(1, width - 1)), (y * 255 // max(1, height - 1)), ((x + y) * 7) % 256], -1)
    pixels = pixels.astype(np.int16) + rng.integers(-12, 12, size=pixels.shape)
    pixels[: height // 4, : width // 4] = (250, 250, 40)  # a marker in the top-left corner
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


def pan_frames(picture: Image.Image, width: int, height: int, num_frames: int) -> list[np.ndarray]:
    """`num_frames` views of `picture`, sliding left to right (the picture is scaled to fit)."""
    scale = max(height / picture.height, 1.25 * width / picture.width)
    big = picture.convert("RGB").resize(
        (max(width + 1, round(picture.width * scale)), max(height, round(picture.height * scale)))
    )
    travel = big.width - width
    frames = []
    for i in range(num_frames):
        left = travel * i // max(1, num_frames - 1)
        top = (big.height - height) // 2
        frames.append(np.asarray(big.crop((left, top, left + width, top + height))))
    return frames


def encode_clip(
    frames: list[np.ndarray],
    fps: float,
    codec: str = "libx264",
    container: str = "mp4",
    pix_fmt: str = "yuv420p",
    gop: int | None = None,
    rotation: int | None = None,
    frame_times_s: list[float] | None = None,
    bframes: int | None = None,
) -> bytes:
    """Encodes RGB frames. `frame_times_s` gives each frame its own time (variable frame rate);
    `rotation` writes display-matrix metadata (counter-clockwise degrees); `gop` is the keyframe
    interval in frames."""
    import av

    height, width = frames[0].shape[:2]
    out = io.BytesIO()
    with av.open(out, mode="w", format=container) as muxer:
        stream = muxer.add_stream(codec, rate=Fraction(fps).limit_denominator(1001))
        stream.width, stream.height, stream.pix_fmt = width, height, pix_fmt
        if gop is not None:
            stream.codec_context.gop_size = gop
        if bframes is not None:
            stream.codec_context.max_b_frames = bframes
        if frame_times_s is not None:
            stream.codec_context.time_base = Fraction(1, 1000)
        if rotation is not None:
            stream.set_display_rotation(rotation)
        for i, pixels in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format="rgb24")
            if frame_times_s is not None:
                frame.pts = round(frame_times_s[i] * 1000)
                frame.time_base = Fraction(1, 1000)
            for packet in stream.encode(frame):
                muxer.mux(packet)
        for packet in stream.encode():
            muxer.mux(packet)
    return out.getvalue()


def make_clip(
    width: int = 96,
    height: int = 64,
    fps: float = 10.0,
    seconds: float = 2.0,
    picture: Image.Image | None = None,
    **encode_kwargs: object,
) -> bytes:
    """A clip panning across `picture` (default: `pattern`)."""
    num_frames = max(1, round(fps * seconds))
    frames = pan_frames(picture if picture is not None else pattern(2 * width, 2 * height), width, height, num_frames)
    return encode_clip(frames, fps, **encode_kwargs)  # type: ignore[arg-type]


def audio_only_clip(seconds: float = 0.5) -> bytes:
    """An MP4 with one AAC stream and no video."""
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format="mp4") as muxer:
        stream = muxer.add_stream("aac", rate=16000)
        samples = int(16000 * seconds)
        tone = (0.2 * np.sin(np.arange(samples) * 2 * np.pi * 440 / 16000)).astype(np.float32)
        frame_size = stream.codec_context.frame_size or 1024
        for start in range(0, samples, frame_size):
            chunk = tone[start : start + frame_size]
            frame = av.AudioFrame.from_ndarray(chunk.reshape(1, -1), format="fltp", layout="mono")
            frame.sample_rate = 16000
            frame.pts = start
            for packet in stream.encode(frame):
                muxer.mux(packet)
        for packet in stream.encode():
            muxer.mux(packet)
    return out.getvalue()


def zero_frame_clip() -> bytes:
    """An AVI whose video stream is declared but holds no frames."""
    import av

    out = io.BytesIO()
    with av.open(out, mode="w", format="avi") as muxer:
        stream = muxer.add_stream("mpeg4", rate=10)
        stream.width, stream.height, stream.pix_fmt = 64, 64, "yuv420p"
        muxer.start_encoding()
    return out.getvalue()


def unknown_codec_clip() -> bytes:
    """A valid MP4 whose sample entry names a codec no FFmpeg knows (every 'avc1' tag rewritten:
    the sample entry's and the compatible brand's)."""
    data = make_clip(width=64, height=64, fps=5, seconds=1)
    if b"avc1" not in data:
        raise RuntimeError("the H.264 MP4 has no avc1 sample entry to rewrite")
    return data.replace(b"avc1", b"zzzz")
