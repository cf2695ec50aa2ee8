"""OpenAI request validation (no processes)."""

from __future__ import annotations

from typing import Any

import pytest

from vlm_engine.server import protocol as P
from vlm_engine.server.errors import ApiError

MSGS = [{"role": "user", "content": "hi"}]


def chat(**body: Any) -> P.GenerateRequest:
    return P.parse_chat({"model": "m", "messages": MSGS, **body}, "m", max_n=4, max_model_len=100, max_images=1)


def test_chat_defaults_and_aliases() -> None:
    req = chat()
    assert req.sampling.max_tokens == 100  # no limit: up to the context
    assert req.sampling.temperature == 1.0 and req.n == 1 and not req.stream
    assert chat(max_completion_tokens=7, max_tokens=9).sampling.max_tokens == 7
    assert chat(stop="x").sampling.stop == ("x",)
    assert chat(logprobs=True, top_logprobs=3).sampling.logprobs == 3
    assert chat(logprobs=True).sampling.logprobs == 0
    req = chat(stream=True, stream_options={"include_usage": True}, ignore_eos=True, seed=5, top_k=-1, future_field=1)
    assert req.include_usage and req.sampling.ignore_eos and req.sampling.seed == 5 and req.sampling.top_k == 0
    assert P.parse_chat({"messages": MSGS}, "m", 4, 100, 1).model == "m"  # model may be omitted


@pytest.mark.parametrize(
    ("body", "status", "param"),
    [
        ({"model": "other"}, 404, "model"),
        ({"messages": []}, 400, "messages"),
        ({"messages": "hi"}, 400, "messages"),
        ({"temperature": -0.5}, 400, "temperature"),
        ({"temperature": "hot"}, 400, "temperature"),
        ({"top_p": 0}, 400, "top_p"),
        ({"max_tokens": 0}, 400, "max_tokens"),
        ({"max_tokens": True}, 400, "max_tokens"),
        ({"n": 5}, 400, "n"),
        ({"stop": ["ok", 3]}, 400, "stop"),
        ({"top_logprobs": 2}, 400, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 50}, 400, "top_logprobs"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url"}, {"type": "image_url"}]}]}, 400, "messages"),
    ],
)
def test_chat_rejections(body: dict[str, Any], status: int, param: str) -> None:
    with pytest.raises(ApiError) as info:
        chat(**body)
    assert info.value.status == status and info.value.param == param
    assert set(info.value.body()["error"]) == {"message", "type", "param", "code"}


def test_completion_prompts() -> None:
    def parse(prompt: Any, **kw: Any) -> P.GenerateRequest:
        return P.parse_completion({"prompt": prompt, **kw}, "m", max_n=4)

    assert parse("a").prompts == ["a"] and parse("a").sampling.max_tokens == 16
    assert parse([1, 2]).prompts == [[1, 2]]
    assert parse(["a", [1]], n=2).num_choices == 4
    assert parse("a", logprobs=2).sampling.logprobs == 2


@pytest.mark.parametrize(
    "body",
    [
        pytest.param({"prompt": []}, id="empty-list"),
        pytest.param({"prompt": [[]]}, id="empty-token-list"),
        pytest.param({"prompt": [1, "a"]}, id="mixed-ids-and-text"),
        pytest.param({"prompt": None}, id="null"),
        pytest.param({"prompt": 5}, id="a-number"),
        pytest.param({"prompt": [True]}, id="a-bool"),
        pytest.param({"prompt": "a", "echo": True}, id="echo"),
        pytest.param({"prompt": "a", "suffix": "x"}, id="suffix"),
        pytest.param({"prompt": ["a", "b"], "n": 3}, id="choices-over-max-n"),
    ],
)
def test_completion_rejections(body: dict[str, Any]) -> None:
    with pytest.raises(ApiError):
        P.parse_completion(body, "m", max_n=4)


def test_sse_chunks_escape_what_line_splitters_split_at() -> None:
    """JSON may carry U+2028, U+2029 and U+0085 raw; SSE clients that split with str.splitlines()
    (httpx's iter_lines) would cut a chunk there, so the server escapes them."""
    import json

    from vlm_engine.server.http_common import sse as _sse

    text = "a\u2028b\u2029c\x85d\x0be\u00e9"
    event = _sse({"content": text})
    assert event.endswith(b"\n\n") and event.count(b"\n") == 2
    line = event.decode()[:-2]
    assert line.splitlines() == [line]
    assert json.loads(line[len("data: ") :]) == {"content": text}
