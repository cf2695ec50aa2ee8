"""`vlm-engine serve --model DIR` serves a local Qwen2.5-VL, Qwen3-VL or Qwen3.5 directory: an image and a
video through the OpenAI API (data URIs), answered as the in-process engine answers the same messages; for
Qwen3.5 (linear-attention state slots) also a structured answer through the Responses API and a second turn
that resumes a prefix-cache state snapshot."""

from __future__ import annotations

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import make_image
from tests.server_helpers import ServerProcess, running
from vlm_engine import Engine, SamplingParams
from testkit.qwen3_5_checkpoints import cached_qwen3_5
from testkit.qwen_vl_checkpoints import cached_qwen2_5_vl, cached_qwen3_vl
from testkit.videos import make_clip

CHECKPOINTS = {
    "qwen2.5-vl": lambda: cached_qwen2_5_vl("tiny"),
    "qwen3-vl": lambda: cached_qwen3_vl("tiny"),
    "qwen3.5": lambda: cached_qwen3_5("tiny"),
}


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


def test_qwen3_5_structured_responses_and_a_second_turn(served: tuple[Path, ServerProcess]) -> None:
    path, srv = served
    if "qwen3.5" not in path.name:
        pytest.skip("the state-slot checks are Qwen3.5's")
    schema = {"type": "object", "properties": {"label": {"type": "string", "maxLength": 12}}, "required": ["label"]}
    body = {
        "model": str(path),
        "input": "Name the picture in one word, as JSON.",
        "text": {"format": {"type": "json_schema", "name": "label", "schema": schema, "strict": True}},
        "max_output_tokens": 40,
        "temperature": 0.0,
    }
    reply = httpx.post(srv.base_url + "/responses", json=body, timeout=120.0)
    assert reply.status_code == 200, reply.text
    text = reply.json()["output"][0]["content"][0]["text"]
    assert isinstance(json.loads(text)["label"], str)
    # A long first turn, then a second turn extending it: the second resumes the snapshot at the
    # first prompt's last full page, and answers as a cold engine does.
    first = [{"role": "user", "content": "Describe a museum placard. " * 12}]
    chat = {"model": str(path), "messages": first, "max_tokens": 8, "temperature": 0.0}
    answer = httpx.post(srv.base_url + "/chat/completions", json=chat, timeout=120.0).json()
    second = first + [answer["choices"][0]["message"], {"role": "user", "content": "Shorter, please."}]
    reply = httpx.post(srv.base_url + "/chat/completions", json={**chat, "messages": second}, timeout=120.0)
    assert reply.status_code == 200, reply.text
    assert reply.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
    engine = Engine(str(path), dtype="float32", kv_cache_tokens=2048, enable_prefix_cache=False)
    expected = engine.chat([second], SamplingParams(max_tokens=8, temperature=0.0))
    assert reply.json()["choices"][0]["message"]["content"] == expected[0].text
