"""POST /tokenize and /detokenize (vLLM's shapes): a real server with the tiny Qwen2-VL checkpoint,
compared with its Hugging Face tokenizer and with what a chat completion counts; plus the worker's
and the API client's sides of a tokenize job without processes."""

from __future__ import annotations

import asyncio
import base64
import io
from pathlib import Path
from typing import Any

import httpx
import pytest
import zmq

from tests.conftest import make_image
from tests.server_helpers import ServerProcess, running
from tests.test_server import serve_directory
from vlm_engine import ipc
from vlm_engine.sampling_params import SamplingParams
from vlm_engine.server.engine_client import EngineClient
from vlm_engine.server.preprocess_worker import PreprocessWorker

API_KEY = "tok-key"
MAX_MODEL_LEN = 1024
AUTH = {"Authorization": f"Bearer {API_KEY}"}


@pytest.fixture(scope="module")
def server(tiny_vlm_dir: Path, tmp_path_factory: pytest.TempPathFactory):
    log = tmp_path_factory.mktemp("tokenize-server") / "server.log"
    srv = ServerProcess(
        tiny_vlm_dir,
        log,
        "--served-model-name",
        "tiny-vlm",
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-tokens",
        "8192",
        "--no-warmup",
        "--allow-private-media-urls",  # the image URL below is served from loopback
        api_key=API_KEY,
    )
    with running(srv):
        yield srv


@pytest.fixture(scope="module")
def hf_tokenizer(tiny_vlm_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_vlm_dir))


def post(server: ServerProcess, path: str, body: Any, headers: dict[str, str] | None = None) -> httpx.Response:
    return httpx.post(server.url + path, json=body, headers=AUTH if headers is None else headers, timeout=60)


def ok(server: ServerProcess, path: str, body: Any) -> dict[str, Any]:
    resp = post(server, path, body)
    assert resp.status_code == 200, resp.text
    return resp.json()


def image_png(seed: int = 1) -> bytes:
    buf = io.BytesIO()
    make_image(64, 48, seed=seed).save(buf, format="PNG")
    return buf.getvalue()


def image_uri(seed: int = 1) -> str:
    return "data:image/png;base64," + base64.b64encode(image_png(seed)).decode()


def messages(text: str, *images: str) -> list[dict[str, Any]]:
    parts: list[dict[str, Any]] = [{"type": "image_url", "image_url": {"url": url}} for url in images]
    return [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [*parts, {"type": "text", "text": text}]},
    ]


def chat_prompt_ids(server: ServerProcess, msgs: list[dict[str, Any]]) -> tuple[int, list[int]]:
    """usage.prompt_tokens and the prompt's ids of a real chat completion."""
    body = {"model": "tiny-vlm", "messages": msgs, "max_tokens": 1, "temperature": 0, "return_token_ids": True}
    resp = post(server, "/v1/chat/completions", body)
    assert resp.status_code == 200, resp.text
    return resp.json()["usage"]["prompt_tokens"], resp.json()["prompt_token_ids"]


# ---- through the server ----------------------------------------------------------------------------


@pytest.mark.timeout(300)
def test_tokenize_prompt_is_the_checkpoints_tokenizer(server: ServerProcess, hf_tokenizer: Any) -> None:
    text = "Hello world, how are you today? Ünïcödé too."
    want = hf_tokenizer(text)["input_ids"]
    got = ok(server, "/tokenize", {"model": "tiny-vlm", "prompt": text})
    assert got == {"count": len(want), "max_model_len": MAX_MODEL_LEN, "tokens": want, "token_strs": None}

    plain = ok(server, "/tokenize", {"prompt": text, "add_special_tokens": False, "return_token_strs": True})
    assert plain["tokens"] == hf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert plain["token_strs"] == hf_tokenizer.convert_ids_to_tokens(plain["tokens"])
    assert "".join(plain["token_strs"]).replace("Ġ", " ").startswith("Hello world")

    assert ok(server, "/tokenize", {"prompt": ""})["count"] == len(hf_tokenizer("")["input_ids"])


@pytest.mark.timeout(300)
def test_tokenize_messages_is_the_prompt_a_chat_completion_runs(server: ServerProcess, hf_tokenizer: Any) -> None:
    image_pad = hf_tokenizer.convert_tokens_to_ids("<|image_pad|>")
    text_only = messages("Describe a cat.")
    with_image = messages("Describe this.", image_uri())
    for msgs in (text_only, with_image):
        got = ok(server, "/tokenize", {"model": "tiny-vlm", "messages": msgs})
        usage, prompt_ids = chat_prompt_ids(server, msgs)
        assert got["tokens"] == prompt_ids and got["count"] == usage == len(prompt_ids)
    counted = ok(server, "/tokenize", {"messages": with_image, "return_token_strs": True})
    pads = counted["tokens"].count(image_pad)
    assert pads > 1, "the image's placeholder tokens are counted"
    assert counted["token_strs"].count("<|image_pad|>") == pads

    # Without the generation prompt the conversation stops before the assistant's opening.
    open_ = ok(server, "/tokenize", {"messages": text_only})["tokens"]
    closed = ok(server, "/tokenize", {"messages": text_only, "add_generation_prompt": False})["tokens"]
    assert len(closed) < len(open_) and open_[: len(closed)] == closed
    assert hf_tokenizer.decode(open_[len(closed) :]) == "<|im_start|>assistant\n"


@pytest.mark.timeout(300)
def test_an_image_url_is_fetched_then_counted(server: ServerProcess, tmp_path: Path) -> None:
    (tmp_path / "cat.png").write_bytes(image_png(seed=5))
    with serve_directory(tmp_path) as base:
        by_url = ok(server, "/tokenize", {"messages": messages("What is it?", f"{base}/cat.png")})
        missing = post(server, "/tokenize", {"messages": messages("What is it?", f"{base}/nope.png")})
    assert by_url == ok(server, "/tokenize", {"messages": messages("What is it?", image_uri(seed=5))})
    assert missing.status_code == 400 and "404" in missing.json()["error"]["message"]


@pytest.mark.timeout(300)
def test_detokenize_round_trip(server: ServerProcess, hf_tokenizer: Any) -> None:
    text = "The quick brown fox jumps over the lazy dog."
    ids = ok(server, "/tokenize", {"prompt": text})["tokens"]
    assert ok(server, "/detokenize", {"model": "tiny-vlm", "tokens": ids}) == {"prompt": text}
    assert ok(server, "/detokenize", {"tokens": []}) == {"prompt": ""}
    # Special tokens are text too (vLLM keeps them): a chat prompt decodes to its template.
    chat_ids = ok(server, "/tokenize", {"messages": messages("Hi")})["tokens"]
    decoded = ok(server, "/detokenize", {"tokens": chat_ids})["prompt"]
    assert decoded == hf_tokenizer.decode(chat_ids) and decoded.count("<|im_start|>") == 3


BAD_BODIES = [
    pytest.param("/detokenize", {"tokens": "1 2 3"}, "tokens", id="tokens-not-array"),
    pytest.param("/detokenize", {"tokens": [1, "2"]}, "tokens", id="tokens-not-ints"),
    pytest.param("/detokenize", {"tokens": [1, True]}, "tokens", id="tokens-bool"),
    pytest.param("/detokenize", {"tokens": [1, -3]}, "tokens", id="tokens-negative"),
    pytest.param("/detokenize", {"tokens": [5, 10**9]}, "tokens", id="tokens-out-of-vocab"),
    pytest.param("/detokenize", {}, "tokens", id="tokens-missing"),
    pytest.param("/tokenize", {"model": "tiny-vlm"}, "messages", id="neither-prompt-nor-messages"),
    pytest.param("/tokenize", {"prompt": "a", "messages": messages("a")}, "prompt", id="both"),
    pytest.param("/tokenize", {"prompt": [1, 2]}, "prompt", id="prompt-not-string"),
    pytest.param("/tokenize", {"prompt": "a", "add_special_tokens": "yes"}, "add_special_tokens", id="flag-type"),
    pytest.param("/tokenize", {"messages": []}, "messages", id="messages-empty"),
    pytest.param(
        "/tokenize", {"messages": messages("a", "data:image/png;base64,bm90IGFuIGltYWdl")}, None, id="broken-image"
    ),
    pytest.param("/tokenize", {"messages": [{"content": "no role"}]}, "messages[0]", id="message-without-role"),
    pytest.param(
        "/tokenize",
        {"messages": messages("a"), "add_generation_prompt": False, "continue_final_message": True},
        "continue_final_message",
        id="continue-final-message",
    ),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize(("path", "body", "param"), BAD_BODIES)
def test_bad_bodies_are_400_in_openai_shape(server: ServerProcess, path: str, body: Any, param: str | None) -> None:
    resp = post(server, path, body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error" and error["message"]
    if param is not None:
        assert error["param"] == param
    else:
        assert error["param"].startswith("messages[1].content[0]")  # the broken part, found by the worker


@pytest.mark.timeout(300)
def test_unknown_model_is_404_and_a_missing_key_401(server: ServerProcess) -> None:
    for path, body in (("/tokenize", {"prompt": "a"}), ("/detokenize", {"tokens": [1]})):
        resp = post(server, path, {**body, "model": "gpt-4"})
        assert resp.status_code == 404 and resp.json()["error"]["code"] == "model_not_found"
        resp = post(server, path, body, headers={})
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.timeout(300)
def test_tokenize_jobs_stay_out_of_request_metrics(server: ServerProcess) -> None:
    def counts() -> tuple[float, ...]:
        m = server.metrics()
        media = sum(v for k, v in m.items() if k.startswith("vlm_engine:media_preprocess_seconds_count"))
        errors = sum(v for k, v in m.items() if k.startswith("vlm_engine:request_errors_total"))
        return m["vlm_engine:request_preprocess_time_seconds_count"], media, errors

    before = counts()
    ok(server, "/tokenize", {"messages": messages("Describe this.", image_uri(seed=3))})
    ok(server, "/detokenize", {"tokens": [1, 2, 3]})
    assert post(server, "/detokenize", {"tokens": [10**9]}).status_code == 400
    assert counts() == before
    # The same metrics do count a generation: the check above can fail.
    chat_prompt_ids(server, messages("Describe this.", image_uri(seed=3)))
    after = counts()
    assert after[0] == before[0] + 1 and after[1] > before[1]
    assert server.metrics()["vlm_engine:num_requests_inflight"] == 0


# ---- without processes ------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bos_processor(tiny_vlm_dir: Path) -> Any:
    """The tiny checkpoint's processor with a tokenizer that puts a BOS before plain text (Qwen's adds
    nothing, so `add_special_tokens` would be invisible with it)."""
    from tokenizers.processors import TemplateProcessing

    from vlm_engine.models.registry import load_config, prompt_processor, resolve_model

    source = resolve_model(str(tiny_vlm_dir))
    processor = prompt_processor(source, load_config(source))
    tok = processor.tokenizer
    bos = ("<|endoftext|>", tok.convert_tokens_to_ids("<|endoftext|>"))
    tok._tokenizer.post_processor = TemplateProcessing(single=f"{bos[0]} $A", special_tokens=[bos])
    return processor


def _job(purpose: str, **fields: Any) -> ipc.PreprocessRequest:
    return ipc.PreprocessRequest("tokenize-x", 0, 1, SamplingParams(), purpose=purpose, **fields)


def test_worker_answers_a_job_to_the_api_alone(bos_processor: Any, tmp_path: Path) -> None:
    paths = ipc.IpcPaths(tmp_path)
    ctx = zmq.Context()
    try:
        api, core = ctx.socket(zmq.PULL), ctx.socket(zmq.PULL)
        api.bind(paths.api)
        core.bind(paths.core)
        worker = PreprocessWorker(bos_processor, paths, 3)
        decoder = ipc.Decoder(ipc.ApiInbound)

        def answers(job: ipc.PreprocessRequest) -> list[Any]:
            worker.handle(job)
            got = [decoder.decode(api.recv_multipart())[0]]
            while api.poll(200):
                got.append(decoder.decode(api.recv_multipart())[0])
            return got

        bos = bos_processor.tokenizer.convert_tokens_to_ids("<|endoftext|>")
        plain = bos_processor.tokenizer("Hello there", add_special_tokens=False)["input_ids"]
        done, result = answers(_job("tokenize", prompt="Hello there", return_token_strs=True))
        assert isinstance(done, ipc.PreprocessDone) and (done.worker, done.purpose) == (3, "tokenize")
        assert isinstance(result, ipc.TokenizeResult) and result.request_id == "tokenize-x-0"
        assert result.token_ids == [bos, *plain] and result.token_strs[0] == "<|endoftext|>"
        _, result = answers(_job("tokenize", prompt="Hello there", add_special_tokens=False))
        assert result.token_ids == plain and result.token_strs is None

        # Messages: the chat prompt as it is, or a clear refusal to add BOS on top of the template.
        chat = [{"role": "user", "content": "Hi"}]
        _, result = answers(_job("tokenize", messages=chat, add_special_tokens=False))
        assert result.token_ids == bos_processor.from_messages(chat).token_ids
        done, error = answers(_job("tokenize", messages=chat, add_special_tokens=True))
        assert isinstance(done, ipc.PreprocessDone) and isinstance(error, ipc.RequestError)
        assert (error.status, error.param) == (400, "add_special_tokens")

        _, result = answers(_job("detokenize", prompt=plain))
        assert result.text == "Hello there"
        assert not core.poll(100), "a tokenize job sent something to the engine core"
    finally:
        ctx.destroy(linger=0)


def test_client_keeps_jobs_apart_from_requests_and_fails_them_with_their_worker(tmp_path: Path) -> None:
    async def scenario() -> None:
        client = EngineClient(ipc.IpcPaths(tmp_path), num_workers=2)
        client.start()
        try:
            job = asyncio.ensure_future(client.run_job(_job("tokenize", prompt="Hi")))
            await asyncio.sleep(0.05)
            (engine_id,) = client.jobs
            sent_to = next(w for w in range(2) if client.assigned[w])
            assert (client.num_jobs, client.num_inflight, client.num_waiting) == (1, 0, 0)
            # The worker finished it: the answer reaches the waiting job, the worker's slot is free.
            client._dispatch(ipc.PreprocessDone(sent_to, "tokenize-x", 0, 1, purpose="tokenize"))
            client._dispatch(ipc.TokenizeResult(engine_id, token_ids=[7, 8]))
            assert (await job).token_ids == [7, 8]
            assert client.outstanding == [0, 0] and client.num_jobs == 0

            job = asyncio.ensure_future(client.run_job(_job("detokenize", prompt=[1])))
            await asyncio.sleep(0.05)
            sent_to = next(w for w in range(2) if client.assigned[w])
            client.worker_died(sent_to)
            error = await job
            assert isinstance(error, ipc.RequestError) and error.status == 500 and "died" in error.message
            assert client.num_jobs == 0 and client.tracker.num_live == 0
        finally:
            client.close()

    asyncio.run(scenario())
