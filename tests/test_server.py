"""The OpenAI-compatible server end to end: a real `vlm-engine serve` subprocess with the tiny
Qwen2-VL checkpoint, driven by the official `openai` SDK (responses checked against its models)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import functools
import http.server
import io
import json
import signal
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from tests.conftest import make_image
from tests.server_helpers import ServerProcess, assert_exact_schema, running, sse_events

pytestmark = pytest.mark.timeout(300)

API_KEY = "test-key"
MAX_MODEL_LEN = 1024


@pytest.fixture(scope="module")
def media_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("media")
    make_image(64, 48, seed=1).save(root / "cat.png")
    (root / "not_an_image.png").write_bytes(b"this is not a png")
    return root


@pytest.fixture(scope="module")
def server(tiny_vlm_dir: Path, media_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("server") / "server.log"
    srv = ServerProcess(
        tiny_vlm_dir,
        log,
        "--served-model-name",
        "tiny-vlm",
        "--kv-cache-tokens",
        "16384",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--allowed-local-media-path",
        str(media_dir),
        "--allow-private-media-urls",  # the image URLs below are served from loopback
        "--limit-mm-per-prompt",
        "2",
        "--max-image-bytes",
        "100000",
        "--allowed-origins",
        "http://placard.example",
        api_key=API_KEY,
    )
    with running(srv):
        yield srv


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=60)


def data_uri(image: Any, fmt: str = "PNG") -> str:
    buf = io.BytesIO()
    image.save(buf, format=fmt)
    mime = {"PNG": "png", "JPEG": "jpeg", "WEBP": "webp", "GIF": "gif"}[fmt]
    return f"data:image/{mime};base64," + base64.b64encode(buf.getvalue()).decode()


def noise_image(width: int, height: int) -> Any:
    from PIL import Image

    return Image.fromarray(np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8))


@contextlib.contextmanager
def serve_directory(root: Path) -> Iterator[str]:
    class Quiet(http.server.SimpleHTTPRequestHandler):
        def log_message(self, *args: Any) -> None:
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(Quiet, directory=str(root)))
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


def user(text: str, *images: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}} for url in images]
    parts.append({"type": "text", "text": text})
    return [{"role": "user", "content": parts}]


def raw_chat_stream(server: ServerProcess, body: dict[str, Any]) -> Any:
    """A streaming chat request read with httpx, for what the SDK hides (raw SSE lines, early close)."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.stream("POST", server.base_url + "/chat/completions", json=body, headers=headers, timeout=60)


def chat(client: openai.OpenAI, messages: Any, max_tokens: int = 8, **kw: Any) -> ChatCompletion:
    kw.setdefault("temperature", 0.0)
    return client.chat.completions.create(model="tiny-vlm", messages=messages, max_tokens=max_tokens, **kw)


def raw_post(server: ServerProcess, path: str, body: dict[str, Any], timeout: float = 60) -> httpx.Response:
    headers = {"Authorization": f"Bearer {API_KEY}"}
    return httpx.post(server.base_url + path, json=body, headers=headers, timeout=timeout)


# ---- basics -------------------------------------------------------------------------------------


def test_health_was_503_while_loading_and_models_listed(server: ServerProcess, client: openai.OpenAI) -> None:
    assert server.health_codes[-1] == 200
    assert 503 in server.health_codes, f"health never reported loading: {server.health_codes}"
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-vlm"]
    raw = httpx.get(server.base_url + "/models", headers={"Authorization": f"Bearer {API_KEY}"}).json()
    assert raw["object"] == "list"
    assert_exact_schema(Model, raw["data"][0])


def test_no_web_app_unless_asked(server: ServerProcess) -> None:
    # Without --app the server is the API alone: no page, no redirect from /.
    assert httpx.get(server.url + "/").status_code == 404
    assert httpx.get(server.url + "/placard/").status_code == 404


def test_cors_allows_only_the_configured_origins(server: ServerProcess) -> None:
    def preflight(origin: str) -> httpx.Response:
        headers = {
            "Origin": origin,
            "Access-Control-Request-Method": "POST",
            "Access-Control-Request-Headers": "authorization, content-type",
        }
        return httpx.options(server.base_url + "/chat/completions", headers=headers)

    allowed = preflight("http://placard.example")
    assert allowed.status_code == 200
    assert allowed.headers["access-control-allow-origin"] == "http://placard.example"
    assert "authorization" in allowed.headers["access-control-allow-headers"].lower()
    refused = preflight("http://elsewhere.example")
    assert "access-control-allow-origin" not in refused.headers


def test_chat_non_streaming_exact_schema(server: ServerProcess) -> None:
    body = {
        "model": "tiny-vlm",
        "messages": user("Describe the weather."),
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
        "some_unknown_field": {"x": 1},
    }
    resp = raw_post(server, "/chat/completions", body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    completion = assert_exact_schema(ChatCompletion, data)
    assert completion.id.startswith("chatcmpl-")
    choice = completion.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert data["choices"][0]["message"]["refusal"] is None and data["choices"][0]["logprobs"] is None
    usage = completion.usage
    assert usage.completion_tokens == 6 and usage.total_tokens == usage.prompt_tokens + 6
    assert usage.prompt_tokens_details.cached_tokens is not None


def test_chat_streaming_with_usage_matches_non_streaming(server: ServerProcess, client: openai.OpenAI) -> None:
    messages = user("Count to ten, please.")
    expected = chat(client, messages, max_tokens=12, extra_body={"ignore_eos": True})
    body = {
        "model": "tiny-vlm",
        "messages": messages,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    with raw_chat_stream(server, body) as resp:
        assert resp.status_code == 200
        assert resp.headers["content-type"].startswith("text/event-stream")
        events = sse_events(list(resp.iter_lines()))
    assert events[-1] == "[DONE]"
    chunks = [assert_exact_schema(ChatCompletionChunk, json.loads(e)) for e in events[:-1]]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert len({c.id for c in chunks}) == 1
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert all(c.usage is None for c in chunks[:-1])
    text = "".join(c.choices[0].delta.content or "" for c in chunks[:-1])
    assert text == expected.choices[0].message.content
    assert chunks[-2].choices[0].finish_reason == "length"
    assert usage_chunk.usage.completion_tokens == 12
    assert usage_chunk.usage.prompt_tokens == expected.usage.prompt_tokens
    # The same prompt again: its full pages come from the prefix cache.
    assert usage_chunk.usage.prompt_tokens_details.cached_tokens > 0

    # And through the SDK's own stream parser.
    stream = client.chat.completions.create(
        model="tiny-vlm",
        messages=messages,
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    sdk_chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in sdk_chunks if c.choices) == text


def test_stop_strings(client: openai.OpenAI) -> None:
    messages = user("Tell me a story.")
    full = chat(client, messages, max_tokens=24, extra_body={"ignore_eos": True}).choices[0].message.content
    # A stop string from the middle of the greedy output: the output must end just before it.
    at = next(i for i in range(4, len(full) - 3) if full[i : i + 3].strip() and full.find(full[i : i + 3]) == i)
    stop = full[at : at + 3]
    stopped = chat(client, messages, max_tokens=24, stop=[stop, "@@never@@"], extra_body={"ignore_eos": True})
    assert stopped.choices[0].message.content == full[:at]
    assert stopped.choices[0].finish_reason == "stop"
    assert stopped.usage.completion_tokens < 24
    stream = client.chat.completions.create(
        model="tiny-vlm",
        messages=messages,
        max_tokens=24,
        temperature=0,
        stop=stop,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == full[:at]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    messages = user("Pick random words.")

    def sample(seed: int) -> str:
        return chat(client, messages, max_tokens=12, temperature=1.0, seed=seed).choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert any(sample(seed) != first for seed in (1, 2, 3))


def test_n_choices_and_logprobs(server: ServerProcess, client: openai.OpenAI) -> None:
    body = {
        "model": "tiny-vlm",
        "messages": user("Hi"),
        "max_tokens": 4,
        "n": 2,
        "seed": 7,
        "temperature": 1.0,
        "logprobs": True,
        "top_logprobs": 3,
    }
    resp = raw_post(server, "/chat/completions", body)
    assert resp.status_code == 200, resp.text
    completion = assert_exact_schema(ChatCompletion, resp.json())
    assert [c.index for c in completion.choices] == [0, 1]
    for choice in completion.choices:
        content = choice.logprobs.content
        assert len(content) == 4
        assert all(len(entry.top_logprobs) == 3 and entry.logprob <= 0 for entry in content)
    assert completion.usage.completion_tokens == 8


# ---- completions ----------------------------------------------------------------------------------


def test_completions(server: ServerProcess, client: openai.OpenAI) -> None:
    text = client.completions.create(model="tiny-vlm", prompt="Once upon a time", max_tokens=5, temperature=0)
    assert text.object == "text_completion" and len(text.choices) == 1
    assert text.usage.completion_tokens == 5
    resp = raw_post(
        server,
        "/completions",
        {
            "model": "tiny-vlm",
            "prompt": [[5, 6, 7, 8], "Hello there"],
            "max_tokens": 3,
            "logprobs": 2,
            "temperature": 0,
        },
    )
    assert resp.status_code == 200, resp.text
    batch = assert_exact_schema(Completion, resp.json())
    assert [c.index for c in batch.choices] == [0, 1]
    hello = client.completions.create(model="tiny-vlm", prompt="Hello there", max_tokens=1)
    assert batch.usage.prompt_tokens == 4 + hello.usage.prompt_tokens  # each prompt counted once
    assert all(len(c.logprobs.tokens) == 3 and len(c.logprobs.top_logprobs[0]) == 2 for c in batch.choices)
    stream = client.completions.create(
        model="tiny-vlm",
        prompt="Once upon a time",
        max_tokens=5,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text.choices[0].text
    assert chunks[-1].usage.completion_tokens == 5


# ---- images ---------------------------------------------------------------------------------------


def test_images_data_uri_local_file_and_two_images(client: openai.OpenAI, media_dir: Path) -> None:
    from PIL import Image

    text_only = chat(client, user("What is in the picture?"))
    image = Image.open(media_dir / "cat.png")
    by_uri = chat(client, user("What is in the picture?", data_uri(image)))
    by_file = chat(client, user("What is in the picture?", f"file://{media_dir / 'cat.png'}"))
    assert by_uri.usage.prompt_tokens > text_only.usage.prompt_tokens
    # Same pixels, same prompt: same tokens, same greedy answer, and the KV is reused.
    assert by_file.choices[0].message.content == by_uri.choices[0].message.content
    assert by_file.usage.prompt_tokens == by_uri.usage.prompt_tokens
    assert by_file.usage.prompt_tokens_details.cached_tokens > 0
    with serve_directory(media_dir) as url:
        by_http = chat(client, user("What is in the picture?", f"{url}/cat.png"))
    assert by_http.choices[0].message.content == by_uri.choices[0].message.content
    two = chat(client, user("Compare them.", data_uri(image, "JPEG"), data_uri(make_image(40, 40, seed=3), "WEBP")))
    assert two.usage.prompt_tokens > by_uri.usage.prompt_tokens
    gif = chat(client, user("And this?", data_uri(make_image(32, 32, seed=4).convert("P"), "GIF")))
    assert gif.choices[0].finish_reason in ("stop", "length")


# ---- errors -------------------------------------------------------------------------------------


def _assert_error(exc: openai.APIStatusError, status: int) -> dict[str, Any]:
    assert exc.status_code == status
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


# Each builds a request's messages from media_dir; every one is a 400 that holds no KV page.
BAD_MESSAGES = [
    pytest.param(lambda media: user("x", "data:image/png;base64,!!!notbase64"), id="malformed-data-uri"),
    pytest.param(
        lambda media: user("x", "data:image/png;base64," + base64.b64encode(b"garbage bytes").decode()),
        id="undecodable-image",
    ),
    pytest.param(lambda media: user("x", data_uri(noise_image(256, 256))), id="over-max-image-bytes"),
    pytest.param(
        lambda media: user("x", *[data_uri(make_image(16, 16, seed=s)) for s in range(3)]),
        id="over-limit-mm-per-prompt",
    ),
    pytest.param(lambda media: user("x", f"file://{media / 'not_an_image.png'}"), id="local-file-not-an-image"),
    pytest.param(lambda media: user("x", "file:///etc/hostname"), id="outside-allowed-local-media-path"),
    pytest.param(lambda media: [{"role": "robot", "content": "hi"}], id="malformed-message"),
    pytest.param(lambda media: [], id="no-messages"),
]


@pytest.mark.parametrize("messages_of", BAD_MESSAGES)
def test_bad_messages_are_400(
    server: ServerProcess, client: openai.OpenAI, media_dir: Path, messages_of: Callable[[Path], Any]
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, messages_of(media_dir))
    assert _assert_error(info.value, 400)["message"]
    assert _wait_metric(server, "vlm_engine:kv_pages_used", 0)


def test_prompt_over_the_context_is_400(server: ServerProcess, client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, user("word " * (MAX_MODEL_LEN + 10)))
    error = _assert_error(info.value, 400)
    assert error["code"] == "context_length_exceeded" and "context" in error["message"]
    assert _wait_metric(server, "vlm_engine:kv_pages_used", 0)


@pytest.mark.parametrize(
    "kwargs",
    [
        pytest.param({"temperature": -1.0}, id="negative-temperature"),
        pytest.param({"top_p": 2.0}, id="top_p-over-1"),
        pytest.param({"max_tokens": 0}, id="zero-max_tokens"),
        pytest.param({"extra_body": {"top_k": -5}}, id="negative-top_k"),
        pytest.param({"top_logprobs": 2}, id="top_logprobs-without-logprobs"),
        pytest.param({"n": 1000}, id="n-too-large"),
    ],
)
def test_bad_sampling_parameters_are_400(server: ServerProcess, client: openai.OpenAI, kwargs: dict[str, Any]) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, user("x"), **kwargs)
    _assert_error(info.value, 400)
    assert _wait_metric(server, "vlm_engine:kv_pages_used", 0)


def test_unknown_model_is_404_and_a_wrong_key_401(server: ServerProcess, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="no-such-model", messages=user("x"))
    assert _assert_error(info.value, 404)["code"] == "model_not_found"

    wrong_key = openai.OpenAI(base_url=server.base_url, api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as info:
        wrong_key.chat.completions.create(model="tiny-vlm", messages=user("x"))
    _assert_error(info.value, 401)
    with pytest.raises(openai.AuthenticationError):
        wrong_key.models.list()


def test_bad_streaming_request_and_bad_json_are_400_before_any_stream(
    server: ServerProcess, client: openai.OpenAI
) -> None:
    # Bad requests with stream=True fail before the stream starts, with the same status.
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny-vlm", messages=user("x", "data:image/png;base64,AAAA"), stream=True)
    resp = httpx.post(
        server.base_url + "/chat/completions",
        content=b"{not json",
        headers={"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"},
    )
    assert resp.status_code == 400 and resp.json()["error"]["type"] == "invalid_request_error"
    # Nothing leaked.
    assert _wait_metric(server, "vlm_engine:kv_pages_used", 0)


# ---- concurrency ------------------------------------------------------------------------------------

PROMPTS = [f"Request number {i}: write about topic {i * 7 % 11}." for i in range(20)]


async def _stream_text(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[str, int]:
    stream = await client.chat.completions.create(
        model="tiny-vlm",
        messages=user(prompt),
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text, tokens = [], 0
    async for chunk in stream:
        if chunk.choices:
            text.append(chunk.choices[0].delta.content or "")
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
    return "".join(text), tokens


@pytest.mark.slow
def test_20_concurrent_streams_equal_each_alone(server: ServerProcess) -> None:
    async def run() -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
        client = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)
        alone = [await _stream_text(client, p, 16) for p in PROMPTS]
        together = await asyncio.gather(*(_stream_text(client, p, 16) for p in PROMPTS))
        await client.close()
        return alone, list(together)

    alone, together = asyncio.run(run())
    assert all(tokens == 16 for _, tokens in alone)
    assert together == alone


def test_bad_requests_do_not_disturb_others(server: ServerProcess, client: openai.OpenAI) -> None:
    prompts = PROMPTS[:6]
    expected = [
        chat(client, user(p), max_tokens=10, extra_body={"ignore_eos": True}).choices[0].message.content
        for p in prompts
    ]

    async def run() -> list[Any]:
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key=API_KEY, max_retries=0, timeout=120)
        good = [asyncio.ensure_future(_stream_text(aclient, p, 10)) for p in prompts]
        bad = []
        for i in range(4):
            await asyncio.sleep(0.02)
            bad.append(
                asyncio.ensure_future(
                    aclient.chat.completions.create(
                        model="tiny-vlm",
                        messages=user("x", "data:image/png;base64," + base64.b64encode(b"junk%d" % i).decode()),
                    )
                )
            )
        results = await asyncio.gather(*good, *bad, return_exceptions=True)
        await aclient.close()
        return results

    results = asyncio.run(run())
    assert [r[0] for r in results[:6]] == expected
    assert all(isinstance(r, openai.BadRequestError) for r in results[6:])


# ---- disconnects, metrics, shutdown -------------------------------------------------------------------


def _wait_metric(server: ServerProcess, name: str, value: float, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if server.metrics()[name] == value:
            return True
        time.sleep(0.05)
    return False


def test_disconnect_aborts_and_frees_pages(server: ServerProcess) -> None:
    body = {
        "model": "tiny-vlm",
        "messages": user("A very long story, please."),
        "max_tokens": 800,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with raw_chat_stream(server, body) as resp:
        lines = resp.iter_lines()
        seen = [line for _, line in zip(range(6), lines)]
        assert any(line.startswith("data: ") for line in seen)
        metrics = server.metrics()
        assert metrics["vlm_engine:kv_pages_used"] > 0 and metrics["vlm_engine:num_requests_running"] == 1
    # The connection is closed: the request is aborted and its pages come back.
    assert _wait_metric(server, "vlm_engine:num_requests_running", 0)
    assert server.metrics()["vlm_engine:kv_pages_used"] == 0
    assert server.metrics()["vlm_engine:num_requests_inflight"] == 0

    # A non-streaming client that hangs up is noticed too, while tokens keep arriving: the request
    # stops well before max_tokens instead of decoding to the end for nobody.
    tokens_before = server.metrics()["vlm_engine:generation_tokens_total"]
    url = httpx.URL(server.base_url)
    payload = json.dumps({**body, "stream": False}).encode()
    head = (
        f"POST {url.path}/chat/completions HTTP/1.1\r\nHost: {url.host}:{url.port}\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(payload)}\r\n\r\n"
    ).encode()
    with socket.create_connection((url.host, url.port)) as sock:
        sock.sendall(head + payload)
        assert _wait_metric(server, "vlm_engine:num_requests_running", 1)
    assert _wait_metric(server, "vlm_engine:num_requests_inflight", 0)
    assert _wait_metric(server, "vlm_engine:num_requests_running", 0)
    assert server.metrics()["vlm_engine:generation_tokens_total"] - tokens_before < body["max_tokens"]
    assert server.metrics()["vlm_engine:kv_pages_used"] == 0


def test_metrics_endpoint(server: ServerProcess) -> None:
    text = httpx.get(server.url + "/metrics").text
    assert "# TYPE vlm_engine:kv_pages_used gauge" in text
    metrics = server.metrics()
    assert metrics["vlm_engine:kv_pages_total"] == 16384 // 16 and metrics["vlm_engine:healthy"] == 1

    # Latency histograms: one more 12-token request adds one TTFT, one e2e and one queue-time
    # sample and 11 inter-token gaps; buckets are cumulative and end at the count.
    names = {
        "ttft": "vlm_engine:time_to_first_token_seconds",
        "itl": "vlm_engine:inter_token_latency_seconds",
        "e2e": "vlm_engine:e2e_request_latency_seconds",
        "queue": "vlm_engine:request_queue_time_seconds",
    }
    assert all(f"# TYPE {name} histogram" in text for name in names.values())
    body = {"model": "tiny-vlm", "messages": user("Count."), "max_tokens": 12, "temperature": 0, "ignore_eos": True}
    assert raw_post(server, "/chat/completions", body).status_code == 200
    assert _wait_metric(server, "vlm_engine:num_requests_running", 0)
    after = server.metrics()
    assert after["vlm_engine:generation_tokens_total"] - metrics["vlm_engine:generation_tokens_total"] == 12
    added = {key: after[f"{name}_count"] - metrics[f"{name}_count"] for key, name in names.items()}
    assert added == {"ttft": 1, "itl": 11, "e2e": 1, "queue": 1}
    for name in names.values():
        buckets = [v for k, v in after.items() if k.startswith(f"{name}_bucket")]
        assert buckets == sorted(buckets) and buckets[-1] == after[f"{name}_count"]
        assert after[f"{name}_sum"] >= 0


def test_sigterm_leaves_no_child_process(server: ServerProcess) -> None:
    """Runs last in this module: the shared server shuts down cleanly."""
    assert len(server.child_pids) >= 3
    assert server.stop(signal.SIGTERM) == 0
    assert server.leftover_children() == []
