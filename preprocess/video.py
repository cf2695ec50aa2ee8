"""Video clips: probe, choose frames, decode only those frames.

The order matters for cost. `probe` reads packets only (no decoding): every frame's timestamp in
presentation order and where the keyframes are. The frame indices are chosen from that (by the
model's own Hugging Face video processor when it has one, so the same file and fps give the frames
the model was trained on). `decode_frames` then seeks to the keyframe before each group of wanted
frames and decodes forward only as far as it needs, telling the decoder to drop non-reference
frames that are not wanted. A 2 fps sample of a 30 fps clip never decodes the whole clip unless
the clip has a single keyframe; even then the frames nobody references are skipped.

Frames are RGB uint8 arrays [T, H, W, 3], turned upright by the stream's rotation metadata.
Every failure is a `MediaError` whose message can go back to the client.
"""

from __future__ import annotations

import bisect
import hashlib
import inspect
import io
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from preprocess.errors import MediaError
from preprocess.hashing import hash_bytes, hash_to_int
from preprocess.media import DEFAULT_MEDIA
from vlm_engine.config import MediaConfig

__all__ = [
    "DecodedVideo",
    "FrameCache",
    "VideoInfo",
    "decode_frames",
    "load_video",
    "probe",
    "select_video_device",
    "uniform_indices",
]

# Container families a client plausibly sends (FFmpeg's demuxer names). Anything else that FFmpeg
# could open (images, playlists, raw streams) is refused before it reaches a decoder.
_CONTAINERS = ("mov", "mp4", "matroska", "webm", "avi")


@dataclass(frozen=True)
class VideoInfo:
    """What the packets say, before any decoding."""

    container: str
    codec: str
    width: int
    height: int
    average_fps: float
    duration_s: float
    frame_pts: tuple[int, ...]  # every frame, presentation order
    keyframe_pts: tuple[int, ...]
    time_base: float

    @property
    def num_frames(self) -> int:
        return len(self.frame_pts)

    def timestamp_s(self, index: int) -> float:
        return (self.frame_pts[index] - self.frame_pts[0]) * self.time_base


@dataclass
class DecodedVideo:
    frames: np.ndarray  # [T, H, W, 3] uint8, upright
    indices: list[int]  # which frames of the clip, presentation order
    timestamps_s: list[float]
    info: VideoInfo
    decoded: int  # frames the decoder produced to get these (the cost)
    content_hash: int = field(init=False)

    def __post_init__(self) -> None:
        self.content_hash = frames_content_hash(self.frames)

    @property
    def nbytes(self) -> int:
        return int(self.frames.nbytes)


def frames_content_hash(frames: np.ndarray) -> int:
    """The pixels, not the URL or the file, key the prefix and encoder caches. SHA-256 over the
    array's memory (no copy): ~1.5 GB/s with SHA extensions, 3x BLAKE2b here, which matters at
    20 frames of 720p (55 MB)."""
    h = hashlib.sha256(f"vlm-video-v1\0{frames.shape}\0".encode())
    h.update(memoryview(np.ascontiguousarray(frames)).cast("B"))
    return hash_to_int(h.hexdigest()[:32])


# ---- probing ------------------------------------------------------------------------------


def _open(data: bytes) -> Any:
    import av

    try:
        container = av.open(io.BytesIO(data), mode="r", metadata_errors="ignore")
    except av.FFmpegError as exc:
        raise MediaError(f"could not open the video (truncated or not a video file): {_reason(exc)}") from None
    names = set(container.format.name.split(","))
    if not names.intersection(_CONTAINERS):
        container.close()
        raise MediaError(f"unsupported video container {container.format.name!r}; send MP4, MOV, WebM, MKV or AVI")
    return container


def _reason(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text[:200]


def _video_stream(container: Any) -> Any:
    if not container.streams.video:
        kinds = sorted({s.type for s in container.streams}) or ["no streams"]
        raise MediaError(f"the file has no video stream (it has: {', '.join(kinds)})")
    stream = container.streams.video[0]
    import av

    if stream.codec_context is None:  # FFmpeg could not even identify the codec
        raise MediaError("unsupported video codec: this build of FFmpeg has no decoder for the stream")
    try:
        av.Codec(stream.codec_context.name, "r")
    except (av.FFmpegError, ValueError) as exc:
        raise MediaError(f"unsupported video codec {stream.codec_context.name!r}: {_reason(exc)}") from None
    return stream


def _scan_packets(container: Any, stream: Any) -> tuple[list[int], list[int]]:
    import av

    pts: list[int] = []
    keys: list[int] = []
    try:
        for packet in container.demux(stream):
            if packet.size == 0 or packet.pts is None:
                continue
            pts.append(int(packet.pts))
            if packet.is_keyframe:
                keys.append(int(packet.pts))
    except av.FFmpegError as exc:
        raise MediaError(f"the video is truncated or corrupt: {_reason(exc)}") from None
    pts.sort()
    keys.sort()
    return pts, keys


def probe(data: bytes, limits: MediaConfig = DEFAULT_MEDIA) -> VideoInfo:
    """Reads the container and every packet header (no decoding); checks the limits that the
    file alone decides."""
    if len(data) > limits.max_video_bytes:
        raise MediaError(f"video too large: more than {limits.max_video_bytes} bytes")
    container = _open(data)
    try:
        stream = _video_stream(container)
        width, height = int(stream.codec_context.width), int(stream.codec_context.height)
        if width <= 0 or height <= 0:
            raise MediaError("the video stream has no frame size (corrupt header)")
        if width * height > limits.max_video_frame_pixels:
            raise MediaError(
                f"video frames too large: {width}x{height}, at most {limits.max_video_frame_pixels} pixels each"
            )
        pts, keys = _scan_packets(container, stream)
        if not pts:
            raise MediaError("the video has no frames")
        if not keys or keys[0] > pts[0]:
            keys.insert(0, pts[0])  # streams whose first packet is not flagged: decode from the start
        time_base = float(stream.time_base)
        rate = stream.average_rate
        span_s = (pts[-1] - pts[0]) * time_base
        average_fps = float(rate) if rate else (len(pts) / span_s if span_s > 0 else 1.0)
        duration_s = len(pts) / average_fps
        if duration_s > limits.max_video_seconds:
            raise MediaError(
                f"the video is {duration_s:.1f} s long; at most {limits.max_video_seconds:g} s are allowed"
            )
        return VideoInfo(
            container=container.format.name,
            codec=stream.codec_context.name,
            width=width,
            height=height,
            average_fps=average_fps,
            duration_s=duration_s,
            frame_pts=tuple(pts),
            keyframe_pts=tuple(keys),
            time_base=time_base,
        )
    finally:
        container.close()


# ---- choosing frames ----------------------------------------------------------------------


def uniform_indices(info: VideoInfo, media: MediaConfig) -> list[int]:
    """`video_fps` frames per second of video, evenly spread, at most `video_max_frames` (and at least
    one): the rule of Transformers' default video sampler, for models without a video processor."""
    total = info.num_frames
    wanted = int(total / info.average_fps * media.video_fps)
    n = max(1, min(wanted, media.video_max_frames, total))
    return [int(i) for i in np.arange(n, dtype=np.int64) * total // n]


def hf_video_metadata(info: VideoInfo, indices: list[int] | None = None) -> Any:
    """The `VideoMetadata` Transformers' PyAV reader builds for this clip (with the chosen frames'
    indices once they are chosen): what its frame samplers and processors read."""
    from transformers.video_utils import VideoMetadata

    return VideoMetadata(
        total_num_frames=info.num_frames,
        fps=info.average_fps,
        duration=info.duration_s,
        video_backend="pyav",
        height=info.height,
        width=info.width,
        frames_indices=indices,
    )


def hf_indices(video_processor: Any) -> Callable[[VideoInfo, MediaConfig], list[int]]:
    """The model's own Hugging Face video processor chooses (its `sample_frames` on the metadata
    its PyAV reader would build), so our frames are the ones Transformers would feed the model."""
    sample = video_processor.sample_frames

    def choose(info: VideoInfo, media: MediaConfig) -> list[int]:
        metadata = hf_video_metadata(info)
        try:
            indices = sample(metadata, fps=media.video_fps, max_frames=media.video_max_frames)
        except ValueError as exc:
            raise MediaError(f"cannot sample frames from this video: {exc}") from None
        except ZeroDivisionError:
            # Qwen2-VL's sampler rounds the frame count down to whole temporal patches (2 frames)
            # and then divides by it: a 1-frame clip, or max_frames 1, leaves it zero frames.
            step = getattr(video_processor, "temporal_patch_size", None) or 1
            raise MediaError(
                f"cannot sample frames from this video: the model takes frames in groups of {step}, and "
                f"{info.num_frames} frame(s) with max_frames {media.video_max_frames} make no whole group"
            ) from None
        chosen = [int(i) for i in np.asarray(indices).reshape(-1)]
        if len(chosen) > media.video_max_frames and "num_frames" in inspect.signature(sample).parameters:
            # A sampler that caps with its own max_frames attribute and ignores ours (Qwen3-VL's): ask it
            # for our cap's count, spread over the clip as its own cap would be.
            chosen = [int(i) for i in np.asarray(sample(metadata, num_frames=media.video_max_frames)).reshape(-1)]
        return chosen

    return choose


# ---- decoding only what is needed ---------------------------------------------------------


def _upright(frame: Any) -> np.ndarray:
    rgb = frame.to_ndarray(format="rgb24")
    # The display matrix's angle is counter-clockwise; players rotate by it to show the clip upright.
    quarter_turns = round(getattr(frame, "rotation", 0) / 90) % 4
    return np.ascontiguousarray(np.rot90(rgb, k=quarter_turns)) if quarter_turns else rgb


def _groups_by_keyframe(targets: Sequence[int], keys: Sequence[int]) -> list[tuple[int, list[int]]]:
    groups: list[tuple[int, list[int]]] = []
    for target in targets:
        key = keys[bisect.bisect_right(keys, target) - 1]
        if groups and groups[-1][0] == key:
            groups[-1][1].append(target)
        else:
            groups.append((key, [target]))
    return groups


def decode_frames(
    data: bytes,
    info: VideoInfo,
    indices: Sequence[int],
    limits: MediaConfig = DEFAULT_MEDIA,
    deadline: float | None = None,
) -> DecodedVideo:
    """Decodes the frames at `indices` (presentation order) and no more than it must."""
    import av

    if not indices:
        raise MediaError("no frames were chosen from the video")
    if len(indices) > limits.max_video_frames:
        raise MediaError(f"{len(indices)} frames were asked for; at most {limits.max_video_frames} per video")
    if len(indices) * info.width * info.height > limits.max_video_pixels:
        raise MediaError(
            f"{len(indices)} frames of {info.width}x{info.height} exceed the {limits.max_video_pixels}-pixel "
            "budget per video; ask for fewer frames (fps, max_frames)"
        )
    if min(indices) < 0 or max(indices) >= info.num_frames:
        raise MediaError(f"frame index out of range 0..{info.num_frames - 1}")
    # Each wanted frame is written straight into its row(s) of the output (indices may repeat).
    rows: dict[int, list[int]] = {}
    for row, index in enumerate(indices):
        rows.setdefault(info.frame_pts[index], []).append(row)
    targets = sorted(rows)
    got: set[int] = set()
    frames: np.ndarray | None = None
    decoded = 0
    container = _open(data)
    try:
        stream = _video_stream(container)
        ctx = stream.codec_context
        # PyAV's default slice threading: frame threading adds a pipeline of frames in flight,
        # which costs more than it gains when decoding a few frames after each seek.
        for key, group in _groups_by_keyframe(targets, info.keyframe_pts):
            if got.issuperset(group):
                continue  # came out while decoding the group before
            container.seek(key, stream=stream, backward=True, any_frame=False)
            ctx.flush_buffers()
            for packet in container.demux(stream):
                if deadline is not None and time.monotonic() > deadline:
                    raise MediaError("the request's media time budget ran out while decoding the video")
                # Frames nobody references and nobody asked for need not be reconstructed.
                ctx.skip_frame = "DEFAULT" if packet.pts is None or packet.pts in rows else "NONREF"
                for frame in packet.decode():
                    decoded += 1
                    if frame.pts not in rows or frame.pts in got:
                        continue
                    pixels = _upright(frame)
                    if frames is None:
                        frames = np.empty((len(indices), *pixels.shape), dtype=np.uint8)
                    frames[rows[frame.pts]] = pixels
                    got.add(frame.pts)
                # B-frames leave the decoder after later packets went in: stop only once every
                # wanted frame of this group is out (the demuxer's last, empty packet flushes).
                if got.issuperset(group):
                    break
            ctx.skip_frame = "DEFAULT"
    except av.FFmpegError as exc:
        raise MediaError(f"the video could not be decoded (truncated or corrupt): {_reason(exc)}") from None
    finally:
        container.close()
    missing = len(targets) - len(got)
    if missing or frames is None:
        raise MediaError(
            f"the video is truncated or corrupt: {missing} of {len(targets)} chosen frames would not decode"
        )
    return DecodedVideo(frames, list(indices), [info.timestamp_s(i) for i in indices], info, decoded)


# ---- where resize/normalize runs ----------------------------------------------------------


def select_video_device(requested: str = "auto") -> tuple[str, str]:
    """(device, reason) for the model processor's resize/normalize of video frames.

    "auto" picks CUDA when torch sees a GPU: the fast Hugging Face video processors resize and
    normalize torch tensors on it, behind the same call. Decoding stays on the CPU with PyAV
    (seek + skip is what makes sampling cheap; GPU decoding would need torchcodec built with
    NVDEC, which this project does not install)."""
    import torch

    if requested not in ("auto", "cpu", "cuda"):
        raise ValueError(f"video device must be auto, cpu or cuda, got {requested!r}")
    has_cuda = torch.cuda.is_available()
    if requested == "cuda" and not has_cuda:
        raise ValueError("video device cuda was asked for but torch sees no CUDA device")
    if requested == "cpu":
        return "cpu", "video resize/normalize on the CPU (asked for)"
    if has_cuda:
        return "cuda", f"video resize/normalize on {torch.cuda.get_device_name(0)}; decoding on the CPU (PyAV)"
    return "cpu", "video resize/normalize on the CPU: torch sees no CUDA device"


# ---- the cache of extracted frames --------------------------------------------------------


class FrameCache:
    """Decoded frames keyed by (file bytes, sampling, sampler): a repeated request skips the
    decode. Bounded by the bytes of the frames it holds; least recently used goes first."""

    def __init__(self, max_bytes: int = 512 * 1024 * 1024) -> None:
        self.max_bytes = max_bytes
        self._items: OrderedDict[tuple[Any, ...], DecodedVideo] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    def get(self, key: tuple[Any, ...]) -> DecodedVideo | None:
        with self._lock:
            video = self._items.get(key)
            if video is None:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return video

    def put(self, key: tuple[Any, ...], video: DecodedVideo) -> None:
        if video.nbytes > self.max_bytes:
            return
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._bytes -= old.nbytes
            self._items[key] = video
            self._bytes += video.nbytes
            while self._bytes > self.max_bytes:
                _, evicted = self._items.popitem(last=False)
                self._bytes -= evicted.nbytes

    @property
    def nbytes(self) -> int:
        return self._bytes

    def __len__(self) -> int:
        return len(self._items)


def load_video(
    data: bytes,
    media: MediaConfig,
    choose: Callable[[VideoInfo, MediaConfig], list[int]] = uniform_indices,
    cache: FrameCache | None = None,
    sampler_id: str = "uniform",
    deadline: float | None = None,
) -> DecodedVideo:
    """Probe, choose (at `media.video_fps`, at most `media.video_max_frames`: a request's own sampling
    is `media.sampled_at(...)`), decode under `media`'s limits; through `cache` when given (the key is
    the file's hash, not its URL). `deadline` (time.monotonic()): decoding stops with a MediaError
    once it has passed."""
    key = (hash_bytes(data), media.video_fps, media.video_max_frames, sampler_id)
    if cache is not None and (hit := cache.get(key)) is not None:
        return hit
    info = probe(data, media)
    video = decode_frames(data, info, choose(info, media), media, deadline)
    if cache is not None:
        cache.put(key, video)
    return video
