"""Speculative decoding through the real server (`vlm-engine serve --speculative ngram` on
SmolLM2's real weights, whose copies of the prompt prompt lookup predicts): the same tokens as the engine without speculation, streamed several at a time, stop
strings and logprobs that end where the text does, the acceptance counters in /metrics and the
request log, and every KV page back in the pool afterwards."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import make_image
from tests.server_helpers import ServerProcess, running, sse_events
from vlm_engine import Engine, SamplingParams

pytestmark = pytest.mark.slow

TEXT = "Ticket 4471: the blue kettle on shelf B2 leaks at the base; customer Anna Pirelli, 0161 496 0325."
PROMPTS = [
    f"Repeat this text exactly: {TEXT}",
    f"Copy the customer name and phone number from this ticket: {TEXT}",
    "Name three colors.",
]
MAX_TOKENS = 40
SMOLLM2 = "SmolLM2-135M-Instruct"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    run_dir = tmp_path_factory.mktemp("spec-server")
    srv = ServerProcess(
        SMOLLM2, run_dir / "server.log",
        "--served-model-name", "smollm2", "--kv-cache-tokens", "4096",
        "--speculative", "ngram", "--num-speculative-tokens", "4", "--speculative-disable-batch-size", "64",
        "--request-log", str(run_dir / "requests.jsonl"),
    )  # fmt: skip
    with running(srv):
        yield srv


def chat(server: ServerProcess, content: Any, **body: Any) -> httpx.Response:
    body = {"model": "smollm2", "messages": [{"role": "user", "content": content}], "temperature": 0,
            "max_tokens": MAX_TOKENS, "ignore_eos": True, **body}  # fmt: skip
    return httpx.post(server.base_url + "/chat/completions", json=body, timeout=120)


@pytest.fixture(scope="module")
def reference() -> list[list[int]]:
    """The engine without speculation, in this process (same fp32 weights as the server)."""
    engine = Engine(SMOLLM2, dtype="float32", kv_cache_tokens=4096)
    prompts = [engine.process_messages([{"role": "user", "content": p}]) for p in PROMPTS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
    return [out.token_ids for out in engine.generate(prompts, params)]


def test_greedy_tokens_equal_the_engine_without_speculation(server: ServerProcess, reference) -> None:
    before = server.metrics()
    for prompt, want in zip(PROMPTS, reference):
        body = chat(server, prompt, return_token_ids=True).json()
        assert body["choices"][0]["token_ids"] == want
        assert body["usage"]["completion_tokens"] == MAX_TOKENS
    after = server.metrics()
    drafts = after["vlm_engine:spec_decode_num_drafts_total"] - before["vlm_engine:spec_decode_num_drafts_total"]
    accepted = (
        after["vlm_engine:spec_decode_num_accepted_tokens_total"]
        - before["vlm_engine:spec_decode_num_accepted_tokens_total"]
    )
    assert drafts > 0 and accepted > 0
    lengths = after["vlm_engine:spec_decode_acceptance_length_count"]
    assert lengths >= drafts
    assert after["vlm_engine:kv_pages_used"] == 0


def test_stream_carries_several_tokens_per_chunk_and_the_same_text(server: ServerProcess) -> None:
    prompt = PROMPTS[0]
    whole = chat(server, prompt, logprobs=True).json()
    lines: list[str] = []
    with httpx.stream(
        "POST", server.base_url + "/chat/completions", timeout=120,
        json={"model": "smollm2", "messages": [{"role": "user", "content": prompt}], "temperature": 0,
              "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True, "logprobs": True,
              "stream_options": {"include_usage": True}},
    ) as resp:  # fmt: skip
        lines = list(resp.iter_lines())
    events = [json.loads(e) for e in sse_events(lines) if e != "[DONE]"]
    pieces = [e["choices"][0] for e in events if e.get("choices")]
    streamed = "".join(p["delta"].get("content") or "" for p in pieces)
    assert streamed == whole["choices"][0]["message"]["content"]
    per_chunk = [len(p["logprobs"]["content"]) for p in pieces if p.get("logprobs")]
    assert sum(per_chunk) == MAX_TOKENS == events[-1]["usage"]["completion_tokens"]
    assert max(per_chunk) > 1  # an accepted draft arrived as one chunk of several tokens
    assert len(whole["choices"][0]["logprobs"]["content"]) == MAX_TOKENS


def test_stop_string_ends_text_tokens_and_logprobs_together(server: ServerProcess) -> None:
    full = chat(server, PROMPTS[1], return_token_ids=True).json()["choices"][0]
    text = full["message"]["content"]
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    cut = chat(server, PROMPTS[1], stop=[stop], logprobs=True, return_token_ids=True).json()
    choice = cut["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert choice["message"]["content"] == text[: text.index(stop)]
    n = cut["usage"]["completion_tokens"]
    assert len(choice["logprobs"]["content"]) == n == len(choice["token_ids"])
    assert choice["token_ids"] == full["token_ids"][:n]


def test_request_log_reports_acceptance_and_bad_input_costs_nothing(server: ServerProcess) -> None:
    import base64
    import io

    buf = io.BytesIO()
    make_image(48, 48, seed=3).save(buf, format="PNG")
    image = {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()},
    }
    ok = chat(server, PROMPTS[1])
    assert ok.status_code == 200
    bad = chat(server, [image, {"type": "text", "text": "Describe it."}])  # a text-only model
    assert bad.status_code == 400, bad.text
    entries = [json.loads(line) for line in (server.log_path.parent / "requests.jsonl").read_text().splitlines()]
    spec = [e for e in entries if e["spec_drafts"]]
    assert spec, "no request in the log speculated"
    for e in spec:
        assert e["spec_accepted_tokens"] <= e["spec_draft_tokens"]
        assert e["spec_acceptance_length"] == pytest.approx(1 + e["spec_accepted_tokens"] / e["spec_drafts"], abs=1e-3)
    assert server.metrics()["vlm_engine:kv_pages_used"] == 0
