"""`vlm-engine serve --model DIR` serves a local Qwen2.5-VL or Qwen3-VL directory: an image and a video
through the OpenAI API (data URIs), answered as the in-process engine answers the same messages."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import make_image
from tests.server_helpers import ServerProcess, running
from vlm_engine import Engine, SamplingParams
from testkit.qwen_vl_checkpoints import cached_qwen2_5_vl, cached_qwen3_vl
from testkit.videos import make_clip

CHECKPOINTS = {"qwen2.5-vl": lambda: cached_qwen2_5_vl("tiny"), "qwen3-vl": lambda: cached_qwen3_vl("tiny")}


@pytest.fixture(scope="module", params=sorted(CHECKPOINTS))
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, ServerProcess]]:
    path = CHECKPOINTS[request.param]()
    srv = ServerProcess(path, tmp_path_factory.mktemp("serve") / "server.log", "--kv-cache-tokens", "4096")
    with running(srv):
        yield path, srv


def data_uri(mime: str, data: bytes) -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


def test_image_and_video_answer_as_the_engine(served: tuple[Path, ServerProcess]) -> None:
    path, srv = served
    image = make_image(83, 61, 12)
    png = io.BytesIO()
    image.save(png, format="PNG")
    clip = make_clip(width=96, height=64, fps=8, seconds=2, picture=make_image(160, 120, 13))
    question = "What do the video and the picture show?"
    api_content: list[dict[str, Any]] = [
        {"type": "video_url", "video_url": {"url": data_uri("video/mp4", clip)}},
        {"type": "image_url", "image_url": {"url": data_uri("image/png", png.getvalue())}},
        {"type": "text", "text": question},
    ]
    body = {"model": str(path), "messages": [{"role": "user", "content": api_content}], "max_tokens": 16,
            "temperature": 0.0}
    reply = httpx.post(srv.base_url + "/chat/completions", json=body, timeout=120.0)
    assert reply.status_code == 200, reply.text
    engine_content: list[dict[str, Any]] = [
        {"type": "video", "video": clip},
        {"type": "image", "image": image},
        {"type": "text", "text": question},
    ]
    engine = Engine(str(path), dtype="float32", kv_cache_tokens=2048)
    expected = engine.chat([[{"role": "user", "content": engine_content}]], SamplingParams(max_tokens=16, temperature=0.0))
    assert reply.json()["choices"][0]["message"]["content"] == expected[0].text
    assert reply.json()["usage"]["prompt_tokens"] == expected[0].prompt_tokens
