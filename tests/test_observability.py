"""What the server tells its operator, checked against the real `vlm-engine serve` (tiny Qwen2-VL):
/metrics counts what happened (TTFT per request, prefix and media cache hits, preemptions), the
request log holds exactly the token ids the API returned, a profile run writes a trace that loads,
and the periodic status line appears in the log. The server is conftest's `observed_server`."""

from __future__ import annotations

import base64
import io
import json
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.conftest import OBSERVED_REPLICA as REPLICA
from tests.conftest import make_image
from tests.server_helpers import ServerProcess, sse_events

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(observed_server: ServerProcess) -> ServerProcess:
    return observed_server


@pytest.fixture(scope="module")
def run_dir(observed_server: ServerProcess) -> Path:
    return observed_server.log_path.parent


def chat(server: ServerProcess, messages: list[dict[str, Any]], **body: Any) -> httpx.Response:
    body = {"model": "tiny-vlm", "messages": messages, "temperature": 0, "max_tokens": 8, **body}
    return httpx.post(server.base_url + "/chat/completions", json=body, timeout=120)


def text(content: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": content}]


def image_uri(seed: int) -> str:
    buf = io.BytesIO()
    make_image(56, 56, seed=seed).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def settled(server: ServerProcess, timeout_s: float = 10.0) -> dict[str, float]:
    """/metrics once nothing is in flight (the core's stats reach the API with its last output)."""
    deadline = time.monotonic() + timeout_s
    while True:
        values = server.metrics()
        idle = values["vlm_engine:num_requests_inflight"] == 0 and values["vlm_engine:num_requests_running"] == 0
        if idle or time.monotonic() > deadline:
            return values
        time.sleep(0.05)


def added(before: dict[str, float], after: dict[str, float], name: str) -> float:
    return after.get(name, 0.0) - before.get(name, 0.0)


def log_lines(run_dir: Path) -> dict[str, dict[str, Any]]:
    lines = (run_dir / "requests.jsonl").read_text().splitlines()
    return {entry["request_id"]: entry for entry in map(json.loads, lines)}


def test_every_sample_names_model_and_replica(server: ServerProcess) -> None:
    body = httpx.get(server.url + "/metrics").text
    samples = [line for line in body.splitlines() if line and not line.startswith("#")]
    assert samples and all('model_name="tiny-vlm"' in line and f'replica="{REPLICA}"' in line for line in samples)
    assert "# TYPE vlm_engine:time_to_first_token_seconds histogram" in body
    assert "# TYPE vlm_engine:prompt_tokens_total counter" in body


def test_ttft_count_is_the_number_of_requests(server: ServerProcess) -> None:
    before = settled(server)
    n = 5
    with ThreadPoolExecutor(n) as pool:
        codes = list(pool.map(lambda i: chat(server, text(f"Count to {i}."), ignore_eos=True).status_code, range(n)))
    assert codes == [200] * n
    after = settled(server)
    for name in ("time_to_first_token", "e2e_request_latency", "request_queue_time", "request_prefill_time",
                 "request_decode_time", "request_preprocess_time"):  # fmt: skip
        assert added(before, after, f"vlm_engine:{name}_seconds_count") == n, name
    assert added(before, after, "vlm_engine:request_generation_tokens_sum") == 8 * n
    assert added(before, after, 'vlm_engine:request_success_total{finished_reason="length"}') == n
    assert added(before, after, "vlm_engine:inter_token_latency_seconds_count") == 7 * n
    assert added(before, after, "vlm_engine:generation_tokens_total") == 8 * n
    assert added(before, after, "vlm_engine:step_decode_tokens_sum") == 7 * n
    assert added(before, after, "vlm_engine:engine_steps_total") == added(
        before, after, "vlm_engine:step_forward_seconds_count"
    )


def test_repeated_prefix_raises_cached_tokens_and_hits(server: ServerProcess) -> None:
    prompt = text("A long shared system-style preamble that fills several KV pages. " * 4)
    chat(server, prompt).raise_for_status()
    before = settled(server)
    usage = chat(server, prompt).json()["usage"]
    after = settled(server)
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert cached >= 32
    assert added(before, after, "vlm_engine:cached_prompt_tokens_total") == cached
    assert added(before, after, "vlm_engine:prefix_cache_hits_total") == cached
    assert added(before, after, "vlm_engine:prefix_cache_queries_total") == usage["prompt_tokens"]
    assert added(before, after, "vlm_engine:prompt_tokens_total") == usage["prompt_tokens"]
    assert added(before, after, "vlm_engine:step_cached_tokens_sum") == cached


def test_repeated_image_raises_mm_cache_hits(server: ServerProcess) -> None:
    picture = {"type": "image_url", "image_url": {"url": image_uri(seed=3)}}
    before = settled(server)
    for opening in ("First look:", "A different text before the same picture:"):
        # Different text ahead of the image: the prefix cache cannot cover it, the encoder cache can.
        chat(server, [{"role": "user", "content": [{"type": "text", "text": opening}, picture]}]).raise_for_status()
    after = settled(server)
    assert added(before, after, "vlm_engine:mm_cache_queries_total") == 2
    assert added(before, after, "vlm_engine:mm_cache_hits_total") == 1
    assert added(before, after, 'vlm_engine:media_preprocess_seconds_count{kind="image_decode"}') == 2
    assert added(before, after, 'vlm_engine:media_preprocess_seconds_count{kind="image_processor"}') == 2


def test_a_burst_that_overflows_the_kv_pool_counts_preemptions(server: ServerProcess) -> None:
    before = settled(server)
    n, tokens = 8, 100  # 8 x (~25 + 100) tokens against a 512-token pool
    with ThreadPoolExecutor(n) as pool:
        bodies = list(
            pool.map(lambda i: chat(server, text(f"Story {i}."), max_tokens=tokens, ignore_eos=True), range(n))
        )
    assert [b.status_code for b in bodies] == [200] * n
    assert all(b.json()["usage"]["completion_tokens"] == tokens for b in bodies)
    after = settled(server)
    assert added(before, after, "vlm_engine:num_preemptions_total") > 0
    assert after["vlm_engine:kv_pages_used"] == 0 and after["vlm_engine:kv_cache_usage_perc"] == 0
    log = log_lines(server.log_path.parent)
    preempted = [log[b.json()["id"]]["preemptions"] for b in bodies]
    assert sum(preempted) == added(before, after, "vlm_engine:num_preemptions_total")


def test_request_log_holds_the_token_ids_the_api_returned(server: ServerProcess) -> None:
    picture = {"type": "image_url", "image_url": {"url": image_uri(seed=5)}}
    plain = chat(server, text("Say something."), return_token_ids=True, max_tokens=12).json()
    with_image = chat(server, [{"role": "user", "content": [picture, {"type": "text", "text": "What?"}]}],
                      return_token_ids=True).json()  # fmt: skip
    with httpx.stream("POST", server.base_url + "/chat/completions", timeout=60, json={
        "model": "tiny-vlm", "messages": text("Stream it."), "max_tokens": 10, "temperature": 0, "stream": True,
        "return_token_ids": True, "stream_options": {"include_usage": True},
    }) as resp:  # fmt: skip
        events = [json.loads(e) for e in sse_events(list(resp.iter_lines())) if e != "[DONE]"]
    streamed_ids = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert len(streamed_ids) == events[-1]["usage"]["completion_tokens"]
    bad = chat(
        server,
        [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}],
    )
    assert bad.status_code == 400

    log = log_lines(server.log_path.parent)
    for body in (plain, with_image):
        entry = log[body["id"]]
        assert entry["output_token_ids"] == body["choices"][0]["token_ids"]
        assert entry["prompt_token_ids"] == body["prompt_token_ids"]
        assert entry["num_output_tokens"] == body["usage"]["completion_tokens"] == len(entry["output_token_ids"])
        assert entry["finish_reason"] == body["choices"][0]["finish_reason"] and entry["error"] is None
        stamps = [entry[k] for k in ("arrival", "preprocess_done", "first_scheduled", "first_token", "finish")]
        assert stamps == sorted(stamps), stamps
    assert len(log[with_image["id"]]["media_hashes"]) == 1 and log[plain["id"]]["media_hashes"] == []
    streamed = log[events[0]["id"]]
    assert (
        streamed["output_token_ids"] == streamed_ids and streamed["prompt_token_ids"] == events[0]["prompt_token_ids"]
    )
    failed = [e for e in log.values() if e["error"] is not None and e["error"]["status"] == 400]
    assert failed and failed[-1]["error"]["message"] == bad.json()["error"]["message"]
    assert failed[-1]["output_token_ids"] == [] and failed[-1]["finish_reason"] is None


def test_a_profile_run_writes_a_trace_that_loads(server: ServerProcess, run_dir: Path) -> None:
    assert httpx.post(server.url + "/start_profile", timeout=30).json() == {"status": "started"}
    assert httpx.post(server.url + "/start_profile", timeout=30).status_code == 409  # already running
    chat(server, text("Profile me."), max_tokens=4).raise_for_status()
    stopped = httpx.post(server.url + "/stop_profile", timeout=120).json()
    core, *workers = (Path(p) for p in stopped["traces"])
    assert core == Path(stopped["trace"]) and core.name.startswith("engine-core-")
    assert [w.name.split("-")[:2] for w in workers] == [["preprocess", "0"]]  # one worker
    names = {}
    for trace in (core, *workers):
        assert trace.parent == run_dir / "profiles" and trace.exists()
        names[trace] = {e.get("name") for e in json.loads(trace.read_text())["traceEvents"]}
    assert "engine_step" in names[core] and any(str(n).startswith("aten::") for n in names[core])
    assert "preprocess" in names[workers[0]]
    assert httpx.post(server.url + "/stop_profile", timeout=30).status_code == 409  # nothing running


def test_status_line_in_the_log(server: ServerProcess) -> None:
    chat(server, text("One more."), max_tokens=4).raise_for_status()
    deadline = time.monotonic() + 10
    while "throughput: prompt" not in server.log() and time.monotonic() < deadline:
        time.sleep(0.2)
    line = next(line for line in server.log().splitlines() if "throughput: prompt" in line)
    assert "tok/s" in line and "KV" in line and "prefix cache hit" in line
