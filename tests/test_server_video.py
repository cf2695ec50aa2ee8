"""Video through the HTTP API (the real `vlm-engine serve` on the tiny Qwen2-VL): a good clip
answers, and every kind of bad video is a 400 that names the part and the reason, costs no KV
page, leaves the worker alive and the server serving."""

from __future__ import annotations

import base64
import http.server
import socketserver
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest

from tests.server_helpers import ServerProcess, running
from vlm_engine.testing.videos import audio_only_clip, encode_clip, make_clip, unknown_codec_clip, zero_frame_clip

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


def bad_cases(stalling_url: str) -> list[tuple[str, Any, str]]:
    clip = make_clip(width=96, height=64, fps=10, seconds=2)
    long_clip = make_clip(width=64, height=64, fps=5, seconds=6)
    noise = encode_clip(list(np.random.default_rng(0).integers(0, 256, (10, 240, 320, 3), dtype=np.uint8)), 10)
    return [
        ("truncated", video_message(data_uri(clip[: len(clip) * 6 // 10])), "truncated"),
        ("audio-only", video_message(data_uri(audio_only_clip())), "no video stream"),
        ("zero-frames", video_message(data_uri(zero_frame_clip(), "video/x-msvideo")), "no frames"),
        ("unknown-codec", video_message(data_uri(unknown_codec_clip())), "unsupported video codec"),
        ("over-duration", video_message(data_uri(long_clip)), "at most 5 s"),
        ("over-pixels", video_message(data_uri(clip), fps=10, max_frames=64), "pixel"),
        ("over-bytes", video_message(data_uri(noise)), "too large"),
        ("bad-fps", video_message(data_uri(clip), fps=-1), "fps"),
        (
            "bad-kwargs",
            {"messages": video_message(data_uri(clip)), "mm_processor_kwargs": {"max_frames": 0}},
            "max_frames",
        ),
        ("an-image", video_message(data_uri(b"\x89PNG\r\n\x1a\n" + b"\0" * 64)), "unsupported video container"),
        ("not-media", video_message(data_uri(b"hello, this is text" * 8)), "could not open the video"),
        ("image-mime", video_message("data:image/png;base64,AAAA"), "expected video/*"),
        ("outside-dir", video_message("/etc/passwd"), "outside the allowed media directory"),
        ("timeout", video_message(stalling_url), "timed out fetching video"),
        (
            "two-videos",
            [{"role": "user", "content": [video_message(data_uri(clip))[0]["content"][0]] * 2}],
            "at most 1 videos",
        ),
    ]


def test_bad_videos_are_400s_that_name_the_part_and_cost_nothing(server: ServerProcess, stalling_url: str) -> None:
    worker_pid = server.child_pid("preprocess-0")
    for name, case, reason in bad_cases(stalling_url):
        extra = {k: v for k, v in case.items() if k != "messages"} if isinstance(case, dict) else {}
        messages = case["messages"] if isinstance(case, dict) else case
        response = chat(server, messages, **extra)
        assert response.status_code == 400, (name, response.text)
        error = response.json()["error"]
        assert reason in error["message"], (name, error)
        where = {"two-videos": "messages", "bad-kwargs": "mm_processor_kwargs"}.get(name, "messages[0].content[0]")
        assert error["param"] == where, (name, error)
    assert server.child_pid("preprocess-0") == worker_pid  # the worker survived every one
    metrics = server.metrics()
    assert metrics["vlm_engine:kv_pages_used"] == 0 and metrics["vlm_engine:num_requests_inflight"] == 0
    good = chat(server, video_message(data_uri(make_clip(width=96, height=64, fps=10, seconds=2))))
    assert good.status_code == 200, good.text
