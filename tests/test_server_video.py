"""Video through the HTTP API (the real `vlm-engine serve` on the tiny Qwen2-VL): a good clip
answers, and every kind of bad video is a 400 that names the part and the reason, costs no KV
page, leaves the worker alive and the server serving."""

from __future__ import annotations

import base64
import http.server
import socketserver
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.server_helpers import ServerProcess, running
from testkit.videos import audio_only_clip, encode_clip, make_clip, unknown_codec_clip, zero_frame_clip

pytestmark = pytest.mark.slow


def data_uri(data: bytes, mime: str = "video/mp4") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def video_message(url: str, text: str = "What happens?", **part_fields: Any) -> list[dict[str, Any]]:
    part = {"type": "video_url", "video_url": {"url": url, **part_fields}}
    return [{"role": "user", "content": [part, {"type": "text", "text": text}]}]


class _Stalling(http.server.BaseHTTPRequestHandler):
    """Accepts the request and never answers (a media URL that times out)."""

    def do_GET(self) -> None:
        time.sleep(5)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture(scope="module")
def stalling_url() -> Iterator[str]:
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Stalling)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/clip.mp4"
    server.shutdown()


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("videos")
    (root / "clip.mp4").write_bytes(make_clip(width=96, height=64, fps=10, seconds=2))
    return root


@pytest.fixture(scope="module")
def server(tiny_vlm_dir: Path, media_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("server-video") / "server.log"
    srv = ServerProcess(
        tiny_vlm_dir,
        log,
        "--served-model-name",
        "tiny-vlm",
        "--kv-cache-tokens",
        "8192",
        "--allow-private-media-urls",  # the video URLs below are served from loopback
        "--limit-mm-per-prompt",
        "image=2,video=1",
        "--max-video-seconds",
        "5",
        "--max-video-bytes",
        "400000",
        "--max-video-pixels",
        str(12 * 96 * 64),
        "--video-fetch-timeout",
        "1",
        "--allowed-local-media-path",
        str(media_dir),
    )
    with running(srv):
        yield srv


def chat(server: ServerProcess, messages: list[dict[str, Any]], **extra: Any) -> httpx.Response:
    body = {"model": "tiny-vlm", "messages": messages, "max_tokens": 8, "temperature": 0, **extra}
    return httpx.post(server.base_url + "/chat/completions", json=body, timeout=60)


def test_a_video_is_answered(server: ServerProcess, media_dir: Path) -> None:
    clip = (media_dir / "clip.mp4").read_bytes()
    answer = chat(server, video_message(data_uri(clip)))
    assert answer.status_code == 200, answer.text
    text_only = chat(server, [{"role": "user", "content": "What happens?"}])
    assert answer.json()["usage"]["prompt_tokens"] > text_only.json()["usage"]["prompt_tokens"] + 8
    # The same clip from an allowed local path, at another fps: more frames, more tokens.
    local = chat(server, video_message(str(media_dir / "clip.mp4"), fps=4))
    assert local.status_code == 200, local.text
    assert local.json()["usage"]["prompt_tokens"] > answer.json()["usage"]["prompt_tokens"]
    # mm_processor_kwargs sets the sampling for parts that do not (vLLM's field).
    kwargs = chat(server, video_message(data_uri(clip)), mm_processor_kwargs={"fps": 4})
    assert kwargs.json()["usage"]["prompt_tokens"] == local.json()["usage"]["prompt_tokens"]


@dataclass(frozen=True)
class Clips:
    """What the bad-video cases are made of, encoded once per module."""

    clip: bytes
    long_clip: bytes
    noise: bytes
    stalling_url: str


@pytest.fixture(scope="module")
def clips(stalling_url: str) -> Clips:
    noise = encode_clip(list(np.random.default_rng(0).integers(0, 256, (10, 240, 320, 3), dtype=np.uint8)), 10)
    return Clips(
        clip=make_clip(width=96, height=64, fps=10, seconds=2),
        long_clip=make_clip(width=64, height=64, fps=5, seconds=6),
        noise=noise,
        stalling_url=stalling_url,
    )


FIRST_PART = "messages[0].content[0]"

# (request of the clips: messages, or a dict of messages and other body fields; words the error
# message must hold; the error's param)
BAD_VIDEOS = [
    pytest.param(
        lambda c: video_message(data_uri(c.clip[: len(c.clip) * 6 // 10])), "truncated", FIRST_PART, id="truncated"
    ),
    pytest.param(lambda c: video_message(data_uri(audio_only_clip())), "no video stream", FIRST_PART, id="audio-only"),
    pytest.param(
        lambda c: video_message(data_uri(zero_frame_clip(), "video/x-msvideo")),
        "no frames",
        FIRST_PART,
        id="zero-frames",
    ),
    pytest.param(
        lambda c: video_message(data_uri(unknown_codec_clip())),
        "unsupported video codec",
        FIRST_PART,
        id="unknown-codec",
    ),
    pytest.param(lambda c: video_message(data_uri(c.long_clip)), "at most 5 s", FIRST_PART, id="over-duration"),
    pytest.param(
        lambda c: video_message(data_uri(c.clip), fps=10, max_frames=64), "pixel", FIRST_PART, id="over-pixels"
    ),
    pytest.param(lambda c: video_message(data_uri(c.noise)), "too large", FIRST_PART, id="over-bytes"),
    pytest.param(lambda c: video_message(data_uri(c.clip), fps=-1), "fps", FIRST_PART, id="bad-fps"),
    pytest.param(
        lambda c: {"messages": video_message(data_uri(c.clip)), "mm_processor_kwargs": {"max_frames": 0}},
        "max_frames",
        "mm_processor_kwargs",
        id="bad-kwargs",
    ),
    pytest.param(
        lambda c: video_message(data_uri(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)),
        "unsupported video container",
        FIRST_PART,
        id="an-image",
    ),
    pytest.param(
        lambda c: video_message(data_uri(b"hello, this is text" * 8)),
        "could not open the video",
        FIRST_PART,
        id="not-media",
    ),
    pytest.param(
        lambda c: video_message("data:image/png;base64,AAAA"), "expected video/*", FIRST_PART, id="image-mime"
    ),
    pytest.param(
        lambda c: video_message("/etc/passwd"), "outside the allowed media directory", FIRST_PART, id="outside-dir"
    ),
    pytest.param(lambda c: video_message(c.stalling_url), "timed out fetching video", FIRST_PART, id="timeout"),
    pytest.param(
        lambda c: [{"role": "user", "content": [video_message(data_uri(c.clip))[0]["content"][0]] * 2}],
        "at most 1 videos",
        "messages",
        id="two-videos",
    ),
]


@pytest.mark.parametrize(("request_of", "reason", "param"), BAD_VIDEOS)
def test_a_bad_video_is_a_400_that_names_the_part_and_costs_nothing(
    server: ServerProcess, clips: Clips, request_of: Callable[[Clips], Any], reason: str, param: str
) -> None:
    worker_pid = server.child_pid("preprocess-0")
    case = request_of(clips)
    extra = {k: v for k, v in case.items() if k != "messages"} if isinstance(case, dict) else {}
    messages = case["messages"] if isinstance(case, dict) else case
    response = chat(server, messages, **extra)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert reason in error["message"] and error["param"] == param, error
    assert server.child_pid("preprocess-0") == worker_pid  # the worker survived it
    metrics = server.metrics()
    assert metrics["vlm_engine:kv_pages_used"] == 0 and metrics["vlm_engine:num_requests_inflight"] == 0


def test_the_server_serves_after_the_bad_videos(server: ServerProcess, clips: Clips) -> None:
    good = chat(server, video_message(data_uri(clips.clip)))
    assert good.status_code == 200, good.text
