"""The benchmark harness's pure parts (stats, SSE parsing, arrivals, payloads, roofline arithmetic,
the side-by-side and A/B tables, the peers' command lines), its client against a fake streaming
server, and slow smoke runs of serve_bench, side_by_side and ab against our real server with the
tiny checkpoint."""

from __future__ import annotations

import argparse
import asyncio
import base64
import io
import itertools
import json
import math
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCH))

import ab
import client as C
import guidellm_check as GC
import inproc as I
import models
import peers
import roofline as R
import side_by_side as SBS
import stats as S
import workloads as W

# ---- stats ------------------------------------------------------------------------------------------


def test_dist_percentiles_match_numpy_linear_interpolation() -> None:
    d = S.Dist.of([float(x) for x in range(1, 101)])
    assert d.n == 100
    assert d.mean == pytest.approx(50.5)
    assert d.p50 == pytest.approx(50.5)
    assert d.p90 == pytest.approx(90.1)
    assert d.p99 == pytest.approx(99.01)
    assert (d.min, d.max) == (1.0, 100.0)


def test_dist_ignores_missing_values_and_is_nan_when_empty() -> None:
    assert S.Dist.of([None, 2.0, float("nan"), 4.0]).mean == pytest.approx(3.0)  # type: ignore[list-item]
    empty = S.Dist.of([])
    assert empty.n == 0 and math.isnan(empty.p50)


def _record(
    i: int,
    start: float,
    chunks: list[float],
    tokens: int,
    *,
    prompt: int = 100,
    cached: int = 0,
    error: str | None = None,
    requested: int | None = None,
) -> C.RequestRecord:
    r = C.RequestRecord(i, "none", requested if requested is not None else tokens, start_s=start)
    r.chunk_times = chunks
    r.first_token_s = chunks[0] if chunks else None
    r.end_s = chunks[-1] if chunks else start + 1
    r.output_tokens = tokens
    r.prompt_tokens, r.cached_tokens, r.usage_reported = prompt, cached, True
    r.error = error
    return r


def test_summary_throughput_latency_and_cache_share() -> None:
    records = [
        _record(0, 0.0, [0.5, 0.6, 0.7, 0.8], 4, cached=50),
        _record(1, 0.0, [1.0, 1.2, 1.4, 1.6], 4, cached=0),
        _record(2, 0.0, [], 0, error="HTTP 500: boom"),
    ]
    s = S.summarize(records, duration_s=2.0)
    assert (s.num_requests, s.num_ok, s.num_errors) == (3, 2, 1)
    assert s.request_throughput == pytest.approx(1.0)
    assert s.output_throughput == pytest.approx(4.0)
    assert s.cached_token_share == pytest.approx(50 / 200)
    assert s.ttft.p50 == pytest.approx(0.75)
    assert s.tpot.mean == pytest.approx((0.1 + 0.2) / 2)  # (e2e - ttft) / (n - 1)
    assert s.itl.n == 6 and s.itl.max == pytest.approx(0.2)
    assert s.errors == ["HTTP 500: boom"]
    assert s.output_len_exact


def test_summary_flags_outputs_shorter_than_requested() -> None:
    s = S.summarize([_record(0, 0.0, [0.1, 0.2], 2, requested=8)], 1.0)
    assert not s.output_len_exact


def test_medians_paired_ratios_and_guidellm_quantile() -> None:
    assert S.median([3.0, None, float("nan"), 1.0, 2.0]) == 2.0 and math.isnan(S.median([]))
    tree = S.median_tree([{"a": 1.0, "b": {"c": 5}, "e": ["x"]}, {"a": 3.0, "b": {"c": 1}}, {"a": 2.0, "b": {"c": 3}}])
    assert tree == {"a": 2.0, "b": {"c": 3}, "e": ["x"]}
    # Round by round: the drift (round 2 twice as slow for both) cancels.
    assert S.paired_ratio([10.0, 5.0, 12.0], [8.0, 4.0, 10.0]) == pytest.approx(1.25)
    assert S.lower_quantile([40.0, 10.0, 30.0, 20.0], [1, 1, 1, 1], 0.5) == 20.0
    assert S.lower_quantile([10.0, 20.0, 30.0], [1, 1, 10], 0.5) == 30.0
    assert math.isnan(S.lower_quantile([], [], 0.5))
    rows = S.md_table(["a", "b"], [["1", "2"]])
    assert rows == ["| a | b |", "|---|---|", "| 1 | 2 |"]


def test_timed_stops_at_the_repeats_or_the_time_budget() -> None:
    calls: list[int] = []
    times, last = S.timed(lambda: calls.append(1) or len(calls), repeats=3, warmup=2)
    assert len(times) == 3 and len(calls) == 5 and last == 5
    times, _ = S.timed(lambda: time.sleep(0.01), min_s=0.05, warmup=0)
    assert 2 <= len(times) <= 10 and all(t >= 0.009 for t in times)


def test_interleaved_takes_turns_and_reverses_the_order() -> None:
    calls: list[str] = []
    times = S.interleaved({"a": lambda: calls.append("a"), "b": lambda: calls.append("b")}, rounds=3, warmup=1)
    assert calls == ["a", "b", "a", "b", "b", "a", "a", "b"]
    assert {k: len(v) for k, v in times.items()} == {"a": 3, "b": 3} and all(t >= 0 for v in times.values() for t in v)


def test_decode_rate_per_request_alone_and_over_the_union_when_overlapping() -> None:
    alone = [_record(0, 0.0, [1.0, 1.1, 1.2], 3), _record(1, 2.0, [3.0, 3.2, 3.4], 3)]
    assert S.decode_rate(alone) == pytest.approx((10.0 + 5.0) / 2)
    together = [_record(0, 0.0, [1.0, 1.1, 1.2], 3), _record(1, 0.0, [1.0, 1.2, 1.4], 3)]
    assert S.decode_rate(together) == pytest.approx(4 / 0.4)  # 4 tokens after the first, decoding 1.0 -> 1.4


def test_itl_spreads_multi_token_chunks() -> None:
    r = _record(0, 0.0, [1.0, 1.4, 1.8], 5)  # 4 tokens after the first, in 2 gaps
    assert r.itls == pytest.approx([0.2, 0.2, 0.2, 0.2])
    assert r.decode_itl == pytest.approx(0.2)
    assert r.tpot == pytest.approx(0.2)


# ---- SSE ---------------------------------------------------------------------------------------------


def test_sse_parser_events_comments_done() -> None:
    chunk = {"object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": "Hi"}}]}
    lines = [": keep-alive", "", f"data: {json.dumps(chunk)}", "", "event: ignored", "data:[DONE]", ""]
    events = [e for line in lines if (e := C.sse_event(line)) is not None]
    assert len(events) == 2
    assert events[0].data == chunk and not events[0].done
    assert events[1].done
    assert C.chunk_content(events[0].data) == "Hi"


def test_sse_lines_split_only_where_sse_does() -> None:
    # Raw U+2028 / U+0085 / form feed inside a JSON string (other servers send them unescaped):
    # httpx's aiter_lines() would cut the chunk there.
    text = "a\u2028b\x85c\x0cd"
    body = f"data: {json.dumps({'t': text}, ensure_ascii=False)}\r\n\ndata: [DONE]\n\n".encode()
    pieces = [body[i : i + 5] for i in range(0, len(body), 5)]  # chunk borders inside characters too

    async def lines() -> list[str]:
        import httpx

        class Pieces(httpx.AsyncByteStream):
            async def __aiter__(self) -> Any:
                for piece in pieces:
                    yield piece

        response = httpx.Response(200, stream=Pieces())
        return [line async for line in C.sse_lines(response)]

    got = asyncio.run(lines())
    assert got == [f"data: {json.dumps({'t': text}, ensure_ascii=False)}", "", "data: [DONE]", ""]
    assert json.loads(got[0][6:])["t"] == text


def test_chunk_content_variants() -> None:
    assert C.chunk_content({"choices": [{"delta": {"role": "assistant"}}]}) == ""
    assert C.chunk_content({"choices": [{"delta": {"reasoning_content": "hmm"}}]}) == "hmm"
    assert C.chunk_content({"choices": [{"text": "abc"}]}) == "abc"
    assert C.chunk_content({"choices": [], "usage": {"completion_tokens": 3}}) == ""


def test_usage_chunk_and_stream_error_are_recorded() -> None:
    r = C.RequestRecord(0, "none", 3)
    C.apply_chunk(r, {"choices": [{"delta": {"role": "assistant"}}]}, 0.05)  # llama-server: the prompt is done
    C.apply_chunk(r, {"choices": [{"delta": {"content": "a"}}]}, 0.1)
    C.apply_chunk(
        r,
        {
            "choices": [],
            "usage": {"completion_tokens": 3, "prompt_tokens": 40, "prompt_tokens_details": {"cached_tokens": 32}},
        },
        0.2,
    )
    assert (r.output_tokens, r.prompt_tokens, r.cached_tokens, r.first_token_s) == (3, 40, 32, 0.1)
    assert (r.first_chunk_s, r.first_chunk, r.text) == (0.05, 0.05, "a")
    C.apply_chunk(r, {"choices": [{"delta": {}, "finish_reason": "length"}]}, 0.25)
    assert r.finish_reason == "length"
    C.apply_chunk(r, {"error": {"message": "bad image"}}, 0.3)
    assert r.error and "bad image" in r.error


# ---- arrivals ----------------------------------------------------------------------------------------


def test_poisson_arrivals_deterministic_and_rate() -> None:
    a = C.poisson_arrivals(4.0, 2000, seed=7)
    assert a == C.poisson_arrivals(4.0, 2000, seed=7)
    assert a != C.poisson_arrivals(4.0, 2000, seed=8)
    assert a[0] == 0.0 and all(x <= y for x, y in itertools.pairwise(a))
    assert a[-1] / (len(a) - 1) == pytest.approx(0.25, rel=0.1)
    with pytest.raises(ValueError):
        C.poisson_arrivals(0.0, 3, 0)


# ---- workloads ---------------------------------------------------------------------------------------


class WordTokenizer:
    """One token per whitespace-separated word: enough to test length calibration."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [hash(w) % 1000 for w in text.split()]

    def decode(self, ids: list[int]) -> str:
        return " ".join(f"w{i}" for i in ids)


def _user_parts(payload: dict[str, Any]) -> list[dict[str, Any]]:
    content = payload["messages"][-1]["content"]
    return content if isinstance(content, list) else [{"type": "text", "text": content}]


def _image(part: dict[str, Any]) -> Any:
    from PIL import Image

    url = part["image_url"]["url"]
    assert url.startswith("data:image/jpeg;base64,")
    return Image.open(io.BytesIO(base64.b64decode(url.split(",", 1)[1])))


def test_requests_are_deterministic_valid_openai_payloads() -> None:
    from openai.types.chat.completion_create_params import CompletionCreateParamsStreaming

    allowed = set(CompletionCreateParamsStreaming.__annotations__)
    for name in W.WORKLOAD_NAMES:
        f1 = W.RequestFactory(W.workload_spec(name, shared_prefix_tokens=50), "m", "vlm-engine", seed=3)
        f2 = W.RequestFactory(W.workload_spec(name, shared_prefix_tokens=50), "m", "vlm-engine", seed=3)
        for i in range(4):
            r = f1.build(i)
            assert r.payload == f2.build(i).payload
            assert set(r.payload) - {"ignore_eos"} <= allowed
            assert r.payload["stream"] is True and r.payload["stream_options"] == {"include_usage": True}
            assert r.payload.get("ignore_eos") is (True if f1.spec.pin_length else None)
            assert r.payload["max_tokens"] == r.output_tokens
            lo, hi = f1.spec.output_tokens
            assert lo <= r.output_tokens <= hi
            assert [m["role"] for m in r.payload["messages"]] == (
                ["system", "user"] if f1.spec.shared_prefix_tokens else ["user"]
            )
            json.dumps(r.payload)


def test_our_server_accepts_the_payloads() -> None:
    from vlm_engine.server import protocol
    for name in W.WORKLOAD_NAMES:
        r = W.RequestFactory(W.workload_spec(name, shared_prefix_tokens=20), "m", "vlm-engine").build(0)
        parsed = protocol.parse_chat(r.payload, "m", 16, 8192, 8)
        assert parsed.stream and parsed.include_usage
        assert parsed.sampling.ignore_eos is W.DEFAULT_SPECS[name].pin_length
        assert parsed.sampling.max_tokens == r.output_tokens


def test_image_workloads_send_fresh_photos_and_placard_its_schema() -> None:
    placard = W.RequestFactory(W.workload_spec("placard"), None)
    a, b = placard.build(0), placard.build(1)
    assert a.media == "photo:0" and b.media == "photo:1" and a.payload == placard.build(0).payload
    assert _image(_user_parts(a.payload)[0]).size == (640, 480)
    assert a.payload["response_format"]["json_schema"]["schema"] == W.PLACARD_SCHEMA
    chat = W.RequestFactory(W.workload_spec("imagechat"), None).build(2)
    assert chat.media == "photo:500002" and chat.payload["ignore_eos"] and "response_format" not in chat.payload


def test_extraction_prompts_carry_the_document_their_answers_copy() -> None:
    f = W.RequestFactory(W.workload_spec("extraction"), None)
    for i in range(3):
        r = f.build(i)
        assert r.source and r.source in r.payload["messages"][-1]["content"]
    assert ab.copied_share(f.build(0).source[:40], f.build(0).source) == 1.0
    assert ab.copied_share("nothing of the sort here", f.build(0).source) == 0.0
    assert ab.copied_share("short", "short") is None


def test_data_workload_sends_a_different_image_per_request_and_chatbot_shares_one() -> None:
    data = W.RequestFactory(W.workload_spec("data"), None)
    media = [data.build(i).media for i in range(6)]
    assert len(set(media)) == 6
    img = _image(_user_parts(data.build(0).payload)[0])
    assert img.size == (320, 240) and img.format == "JPEG"
    assert "JSON" in _user_parts(data.build(0).payload)[-1]["text"]
    chat = W.RequestFactory(W.workload_spec("chatbot", shared_image_prob=1.0), None)
    assert {chat.build(i).media for i in range(5)} == {"image:1"}
    # Unique images never collide across workloads (no spurious cache hits between them).
    other = W.RequestFactory(W.workload_spec("chatbot", shared_image_prob=0.0), None)
    assert not {other.build(i).media for i in range(6)} & set(media)


def test_text_only_drops_media_and_keeps_plain_string_content() -> None:
    r = W.RequestFactory(W.text_only(W.workload_spec("data")), None).build(0)
    assert r.media == "none" and isinstance(r.payload["messages"][-1]["content"], str)


def test_flavor_fields() -> None:
    msgs = [{"role": "user", "content": "hi"}]
    assert "ignore_eos" in W.chat_payload(msgs, 8, "m", "vllm")
    peer = W.chat_payload(msgs, 8, "m", "transformers")
    assert "ignore_eos" not in peer
    assert json.loads(peer["generation_config"]) == {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False}
    plain = W.chat_payload(msgs, 8, None, "openai")
    assert "ignore_eos" not in plain and "generation_config" not in plain and "model" not in plain
    assert "generation_config" in W.sent_fields("transformers")
    with pytest.raises(ValueError):
        W.RequestFactory(W.workload_spec("data"), None, flavor="nope")


def test_shared_prefix_has_the_requested_token_count() -> None:
    tok = WordTokenizer()
    text = W.text_of_tokens(2000, 1, tok)
    assert len(tok.encode(text)) == 2000
    f = W.RequestFactory(W.workload_spec("chatbot", shared_prefix_tokens=300), None, tokenizer=tok)
    assert len(tok.encode(f.build(0).payload["messages"][0]["content"])) == 300
    assert f.build(0).payload["messages"][0] == f.build(5).payload["messages"][0]
    assert W.text_of_tokens(0, 1, tok) == ""
    assert 200 <= len(W.text_of_tokens(100, 1, None)) <= 400  # ~4 chars per token without a tokenizer


def test_unknown_workload_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown workload"):
        W.workload_spec("batch")


# ---- roofline ------------------------------------------------------------------------------------------


def _write_checkpoint(path: Path, tensors: dict[str, tuple[str, list[int]]], config: dict[str, Any]) -> Path:
    """A header-only safetensors file is enough: the roofline reads shapes, never data."""
    header, offset = {}, 0
    for name, (dtype, shape) in tensors.items():
        n = math.prod(shape) * {"F32": 4, "BF16": 2}[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + n]}
        offset += n
    blob = json.dumps(header).encode()
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(blob)) + blob + bytes(offset))
    (path / "config.json").write_text(json.dumps(config))
    return path


def test_model_cost_counts_decoder_head_and_attention(tmp_path: Path) -> None:
    _write_checkpoint(
        tmp_path,
        {
            "model.embed_tokens.weight": ("F32", [100, 8]),
            "model.layers.0.self_attn.q_proj.weight": ("F32", [8, 8]),
            "model.layers.0.mlp.up_proj.weight": ("F32", [16, 8]),
            "model.visual.blocks.0.attn.qkv.weight": ("F32", [24, 8]),
        },
        {
            "num_attention_heads": 2,
            "hidden_size": 8,
            "num_hidden_layers": 1,
            "num_key_value_heads": 1,
            "tie_word_embeddings": True,
            "vision_config": {},
        },
    )
    cost = R.ModelCost.from_dir(tmp_path)
    assert cost.decoder_params == 64 + 128
    assert cost.lm_head_params == 800  # tied: the head multiplies by the embedding matrix
    assert cost.vision_params == 192
    assert cost.head_dim == 4
    assert cost.flops_per_token(0) == 2 * (192 + 800)
    assert cost.flops_per_token(10) == 2 * (192 + 800) + 4 * 1 * 2 * 4 * 10
    assert cost.kv_bytes_per_token(2) == 2 * 1 * 1 * 4 * 2
    assert cost.bytes_per_step(batch=3, context=10, dtype_bytes=2) == (192 + 800) * 2 + 3 * 10 * 16
    # int4 decoder, int8 LM head, fp32 KV
    assert cost.bytes_per_step(3, 10, 4, (0.625, 1.0625)) == 192 * 0.625 + 800 * 1.0625 + 3 * 10 * 32


def test_roofline_fractions_and_line(tmp_path: Path) -> None:
    machine = R.MachineCeilings(100e9, 200e9, 20e9, 30e9, 2, "cpu", "t", 2048)
    cost = R.ModelCost(
        decoder_params=10**8,
        lm_head_params=0,
        embed_params=0,
        vision_params=0,
        num_layers=1,
        num_heads=1,
        num_kv_heads=1,
        head_dim=1,
    )
    r = R.roofline(cost, machine, batch=64, context=0, step_s=0.1, dtype="bfloat16", basis="test")
    assert r.achieved_flops == pytest.approx(64 * 2e8 / 0.1)
    assert r.flops_fraction == pytest.approx(0.64)
    assert r.bandwidth_fraction == pytest.approx(2e8 / 0.1 / 30e9)  # bf16 weights, best of read/copy
    assert "64% of matmul FLOP/s" in r.line()
    assert R.roofline(cost, machine, 1, 0, 0.1, "float32", "x").flops_fraction == pytest.approx(2e8 / 0.1 / 100e9)
    int4 = R.roofline(cost, machine, 1, 0, 0.1, "int4", "x")  # Q4_1: 20 bytes per 32 weights
    assert int4.bandwidth_fraction == pytest.approx(1e8 * 20 / 32 / 0.1 / 30e9)
    assert int4.flops_fraction == pytest.approx(2e8 / 0.1 / 100e9)  # against the fp32 ceiling
    # fp32 activations on bf16 weights (auto without bf16 dot products): 2 bytes a weight, fp32 FLOPs.
    bf16_weights = R.roofline(cost, machine, 1, 0, 0.1, R.BF16_WEIGHTS, "x")
    assert bf16_weights.bandwidth_fraction == pytest.approx(1e8 * 2 / 0.1 / 30e9)
    assert bf16_weights.flops_fraction == pytest.approx(2e8 / 0.1 / 100e9)
    assert "n/a" in R.roofline_line(None, 1, 1, 0.1, "float32", "x", machine)
    assert "n/a" in R.roofline_line(tmp_path, 1, 1, 0.1, "float32", "x", machine)  # no checkpoint there


def test_engine_decode_step_measures_only_full_batches(tiny_vlm_dir: Path) -> None:
    # 16 x 600 prompt tokens take 5 prefill steps of 2,048: the first-admitted sequences decode
    # meanwhile and must not finish before the measured steps end.
    m = I.engine_decode_step(str(tiny_vlm_dir), "float32", batch=16, context=600, steps=4)
    assert m["batch_sizes"] == [16] * 4 and 0 < m["forward_s"] <= m["step_s"]
    assert 600 < m["context"] < 620


def test_engine_decode_step_labels_fp32_on_bf16_weights(tiny_vlm_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Without bf16 dot products auto keeps fp32 activations on bf16 weights: the roofline must count
    # 2 bytes a weight there, so the step says so; an explicit float32 keeps fp32 weights.
    monkeypatch.setenv("VLM_ENGINE_CPU_BF16", "0")
    assert I.engine_decode_step(str(tiny_vlm_dir), "auto", batch=2, context=8, steps=1)["dtype"] == R.BF16_WEIGHTS
    assert I.engine_decode_step(str(tiny_vlm_dir), "float32", batch=2, context=8, steps=1)["dtype"] == "float32"


def test_machine_ceilings_cache_roundtrip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = []

    def fake_measure(n: int = 2048, repeats: int = 5) -> R.MachineCeilings:
        import torch

        calls.append(1)
        threads, cpu = torch.get_num_threads(), R.cpu_name()
        return R.MachineCeilings(
            1e9, 2e9, 3e9, 4e9, threads, cpu, torch.__version__, n, isa=R.isa_tier(), fp32_kernel="onednn"
        )

    monkeypatch.setattr(R, "measure_machine", fake_measure)
    path = tmp_path / "machine.json"
    a = R.machine_ceilings(path=path)
    b = R.machine_ceilings(path=path)
    assert a == b and len(calls) == 1
    R.machine_ceilings(refresh=True, path=path)
    assert len(calls) == 2
    # A forced tier (VLM_ENGINE_ISA=avx2 on an AVX-512 CPU) has ceilings of its own.
    monkeypatch.setattr(R, "isa_tier", lambda: "forced-tier")
    assert R.machine_ceilings(path=path).isa == "forced-tier" and len(calls) == 3
    # A cache from before the fp32 ceiling compared MKL with oneDNN (no fp32_kernel) is re-measured.
    old = json.loads(path.read_text())
    del old["fp32_kernel"]
    path.write_text(json.dumps(old))
    assert R.machine_ceilings(path=path).fp32_kernel == "onednn" and len(calls) == 4


def test_fp32_ceiling_is_the_better_of_mkl_and_onednn() -> None:
    # MKL's sgemm (torch.matmul) runs its AVX2 code on AMD CPUs: 171 vs oneDNN's 416 GFLOP/s on a Zen 5.
    flops, kernel = R.measure_fp32_matmul(256, repeats=2)
    assert kernel in ("mkl", "onednn") and flops > 0
    ceilings = R.MachineCeilings(1e9, 2e9, 3e9, 4e9, 2, "cpu", "t", 2048, fp32_kernel="onednn")
    assert "fp32 (onednn)" in ceilings.describe()


def test_matmul_size_keeps_one_call_within_budget() -> None:
    # bf16 without avx512_bf16/AMX ran ~400x slower than fp32: a fixed 2048^3 size made a fresh
    # clone's first machine measurement take ~5 minutes (inside the serve_bench smoke test).
    assert R.matmul_size(2048, "float32", max_call_s=1e9) == 2048
    assert R.matmul_size(2048, "float32", max_call_s=1e-12) == 256
    assert R.matmul_size(128, "float32", max_call_s=1e-12) == 128
    ceilings = R.MachineCeilings(1e9, 2e9, 3e9, 4e9, 2, "cpu", "t", 2048, 512)
    assert "bf16 (512^3)" in ceilings.describe()
    assert "(2048^3)" not in R.MachineCeilings(1e9, 2e9, 3e9, 4e9, 2, "cpu", "t", 2048).describe()
    # A tier without bf16 dot products measures an emulated bf16 rate the engine never runs at.
    assert "emulated" in R.MachineCeilings(1e9, 1e9, 3e9, 4e9, 2, "cpu", "t", 2048, 256, isa="avx2").describe()
    assert "emulated" not in R.MachineCeilings(1e9, 2e9, 3e9, 4e9, 2, "cpu", "t", 2048, isa="avx512_bf16").describe()


def test_decode_steps_time_only_full_decode_batches(tiny_vlm_dir: Path) -> None:
    engine = I.build_engine(str(tiny_vlm_dir), dtype="float32", max_num_seqs=4, max_num_batched_tokens=64)
    prompts = I.random_prompts(engine, 3, 40)
    assert len({tuple(p) for p in prompts}) == 3 and all(len(p) == 40 for p in prompts)
    timed = I.decode_steps(engine, prompts, I.greedy(16), 5)  # 120 prompt tokens: two prefill steps first
    assert len(timed) == 5 and all(s.num_seqs == 3 and s.num_prefill_tokens == 0 for _, s in timed)
    assert all(wall >= s.forward_s >= s.prepare_s >= 0 for wall, s in timed)
    assert not engine.has_unfinished  # the measured requests are aborted afterwards
    assert len(I.decode_steps(engine, I.random_prompts(engine, 2, 8, seed=1), I.greedy(3), 5)) == 2  # then they finish


@pytest.mark.slow
def test_inproc_host_writes_its_rows_and_plot(tiny_vlm_dir: Path, tmp_path: Path) -> None:
    argv = ["host", "--model", str(tiny_vlm_dir), "--dtype", "float32", "--batches", "1,3", "--steps", "2",
            "--warmup", "1", "--prompt-tokens", "16", "--out", str(tmp_path)]  # fmt: skip
    assert I.main(argv) == 0
    rows = json.loads((tmp_path / "results.json").read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 3] and all(r["forward_s"] > 0 and "roofline: " in r["roofline"] for r in rows)
    assert all(r["total_s"] == pytest.approx(r["host_s"] + r["forward_s"]) for r in rows)
    assert (tmp_path / "host.png").read_bytes()[:4] == b"\x89PNG"


# ---- the side-by-side table ---------------------------------------------------------------------------


def _point(server: str, workload: str, value: float, rps: float, ttft: float, rep: int = 1) -> dict[str, Any]:
    s = S.summarize([_record(0, 0.0, [ttft, ttft + 0.1], 2)], 1.0).to_json()
    s["request_throughput"] = rps
    s["output_throughput"] = 10 * rps
    return {"server": server, "plan": workload, "workload": workload, "mode": "closed", "value": value,
            "label": f"c={value}", "rep": rep, "summary": s}  # fmt: skip


def test_aggregate_takes_medians_over_reps() -> None:
    points = [_point("ours", "data", 16, r, 0.1, rep) for rep, r in enumerate((1.0, 3.0, 2.0))]
    (agg,) = SBS.aggregate(points).values()
    assert agg["reps"] == 3 and agg["request_throughput"] == 2.0


def test_side_by_side_table_ratios_and_speedups() -> None:
    suite = SBS.SUITES["transformers"]
    sides = ["ours", "transformers"]
    points = [_point("ours", "data", 16, 1.6, 0.2), _point("transformers", "data", 16, 0.5, 0.8)]
    rows = SBS.table(suite, sides, SBS.aggregate(points), "avx2")
    assert rows[0].count("|") == rows[1].count("|") == rows[2].count("|")
    assert "**3.20x**" in rows[2] and "**4.00x**" in rows[2]  # req/s ratio, TTFT speed-up
    assert rows[2].startswith("| data | c=16 | avx2 | 1.60 | 0.50 | **3.20x** |")


def test_plots_write_pngs(tmp_path: Path) -> None:
    import plots  # matplotlib is in the [test] extra: missing, the install is broken (not a skip)

    points = [_point("ours", "data", c, c, 0.1 * c) for c in (1, 4)] + [
        _point("peer", "data", c, 0.5, 0.5) for c in (1, 4)
    ]
    made = plots.plot_all(points, tmp_path)
    assert {p.name for p in made} == {"latency_vs_concurrency.png", "throughput_vs_concurrency.png"}
    assert all(p.read_bytes()[:4] == b"\x89PNG" for p in made)


def test_server_commands() -> None:
    ours = peers.ServerSpec("ours", "/m", "bfloat16", ("--max-num-seqs", "32"), kv_tokens=4096).command(8000)
    assert (
        ours[1:4] == ["-m", "vlm_engine.cli", "serve"]
        and "--kv-cache-tokens" in ours
        and ours[-2:] == ["--max-num-seqs", "32"]
    )
    assert peers.ServerSpec("ours", "/m").flavor == "vlm-engine"
    llama = peers.ServerSpec("llamacpp", "/m.gguf", kv_tokens=8192, executable="/bin/llama-server", slots=8).command(1)
    assert llama[:3] == ["/bin/llama-server", "-m", "/m.gguf"] and llama[llama.index("-np") + 1] == "8"
    assert "--dtype" not in llama and peers.ServerSpec("llamacpp", "/m").flavor == "llamacpp"
    vllm = peers.ServerSpec("vllm", "/m", "bfloat16").command(2)
    assert vllm[1:3] == ["-m", "vllm.entrypoints.openai.api_server"] and vllm[vllm.index("--model") + 1] == "/m"
    with pytest.raises(ValueError, match="unknown server kind"):
        peers.ServerSpec("nope", "/m").command(3)
    peer = peers.ServerSpec("transformers", "/m", kv_tokens=1000)
    assert peer.flavor == "transformers"
    try:
        cmd = peer.command(8001)
    except FileNotFoundError:  # a peer, from the [bench] extra: legitimately absent from a test install
        pytest.skip("transformers CLI not installed")
    assert "--continuous-batching" in cmd and cmd[cmd.index("--cb-num-blocks") + 1] == "4"


def test_side_names_become_servers(tmp_path: Path) -> None:
    smollm2 = models.MODELS["smollm2"]
    spec = peers.side_spec("ours int4", smollm2, tmp_path, slots=4, kv_tokens=None)
    assert spec.model_dir.endswith("Q4_1.gguf") and spec.extra_args[:2] == ("--quantization", "int4")
    vlm = models.MODELS["qwen2-vl-tiny"]
    spec = peers.side_spec("ours int4", vlm, tmp_path, slots=4, kv_tokens=None)  # no shipped file: quantized here
    assert spec.model_dir == str(tmp_path) and spec.label == "ours int4"
    assert peers.side_spec("transformers bf16", vlm, tmp_path, slots=1, kv_tokens=512).dtype == "bfloat16"
    assert peers.side_spec("ours", vlm, tmp_path, slots=1, kv_tokens=None).dtype == "auto"
    with pytest.raises(FileNotFoundError, match="llama-server"):
        peers.side_spec("llama.cpp F32 + mmproj", vlm, tmp_path, slots=1, kv_tokens=None)
    with pytest.raises(ValueError, match="unknown side"):
        peers.side_spec("ollama", vlm, tmp_path, slots=1, kv_tokens=None)


class _FakeLlama(peers.LlamaCpp):
    """Conversions named, not run: what side_spec asks llama.cpp's tools for."""

    def convert(self, hf_dir: Path, outtype: str, mmproj: bool = False, extra: tuple[str, ...] = ()) -> Path:
        return Path(f"/gguf/{'mmproj-' if mmproj else ''}{outtype}{''.join(extra)}.gguf")

    def quantize(self, src: Path, qtype: str) -> Path:
        return Path(f"/gguf/{src.stem}->{qtype}.gguf")


def test_llamacpp_sides_convert_quantize_and_add_the_projector(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 4096}}))
    llama = _FakeLlama(Path("/bin/llama-server"))
    q25 = models.MODELS["qwen2.5-vl-3b"]
    spec = peers.side_spec("llama.cpp Q4_K_M + mmproj", q25, tmp_path, slots=8, kv_tokens=None, llama=llama)
    assert spec.model_dir == "/gguf/bf16->Q4_K_M.gguf" and spec.kv_tokens == 4096  # the trained context
    assert spec.extra_args[:2] == ("--mmproj", "/gguf/mmproj-bf16.gguf") and spec.slots == 8
    smolvlm = models.MODELS["smolvlm2-500m"]
    spec = peers.side_spec("llama.cpp BF16 + bf16 mmproj", smolvlm, tmp_path, slots=8, kv_tokens=None, llama=llama)
    assert spec.model_dir == "/gguf/bf16.gguf" and spec.extra_args[1] == "/gguf/mmproj-bf16.gguf"
    assert spec.kv_tokens == 2048 * 8  # at least 2,048 a slot
    text = peers.side_spec("llama.cpp F32", models.MODELS["smollm2"], tmp_path, slots=64, kv_tokens=None, llama=llama)
    assert text.model_dir == "/gguf/f32.gguf" and "--mmproj" not in text.extra_args and text.kv_tokens == 65_536


def test_a_model_rows_converter_and_vllm_flags_reach_its_sides(tmp_path: Path) -> None:
    """Qwen3.5's text GGUF is converted without the MTP head a random checkpoint lacks (its projector is not
    told), and vLLM is told the workloads' image size to profile its encoder with."""
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"max_position_embeddings": 4096}}))
    q35 = models.MODELS["qwen3.5-2b"]
    spec = peers.side_spec("llama.cpp BF16 + mmproj", q35, tmp_path, slots=8, kv_tokens=32_768,
                           llama=_FakeLlama(Path("/bin/llama-server")))  # fmt: skip
    assert spec.model_dir == "/gguf/bf16--no-mtp.gguf" and spec.extra_args == ("--mmproj", "/gguf/mmproj-bf16.gguf")
    vllm = peers.side_spec("vllm bf16", q35, tmp_path, slots=8, kv_tokens=32_768)
    limit = json.loads(vllm.extra_args[vllm.extra_args.index("--limit-mm-per-prompt") + 1])
    assert limit["image"] == {"count": 1, "width": 640, "height": 480}
    assert "--limit-mm-per-prompt" not in peers.side_spec("transformers", q35, tmp_path, slots=8, kv_tokens=None).extra_args


# ---- the client against a fake streaming server -----------------------------------------------------------


async def _fake_server(tokens: int, delay: float, state: dict[str, int]) -> asyncio.AbstractServer:
    """A minimal HTTP/1.1 server streaming `tokens` SSE chunks per request, then usage + [DONE]."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(
                next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
            )
            body = json.loads(await reader.readexactly(length))
            state["active"] += 1
            state["peak"] = max(state["peak"], state["active"])
            writer.write(b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n")

            def send(text: str) -> None:
                data = text.encode()
                writer.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")

            for i in range(tokens):
                await asyncio.sleep(delay)
                send(f"data: {json.dumps({'choices': [{'index': 0, 'delta': {'content': f't{i}'}}]})}\n\n")
                await writer.drain()
            usage = {"prompt_tokens": 10, "completion_tokens": tokens, "prompt_tokens_details": {"cached_tokens": 4}}
            send(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n")
            writer.write(b"0\r\n\r\n")
            await writer.drain()
            state["active"] -= 1
            state["requests"] += 1
            assert body["stream"] is True

    return await asyncio.start_server(handle, "127.0.0.1", 0)


def _run_against_fake(
    point: C.LoadPoint, tokens: int = 4, delay: float = 0.01
) -> tuple[list[C.RequestRecord], float, dict[str, int]]:
    state = {"active": 0, "peak": 0, "requests": 0}
    factory = W.RequestFactory(W.text_only(W.workload_spec("data", output_tokens=(tokens, tokens))), "m")

    async def main() -> tuple[list[C.RequestRecord], float]:
        server = await _fake_server(tokens, delay, state)
        port = server.sockets[0].getsockname()[1]
        async with server:
            return await C.run_point(f"http://127.0.0.1:{port}/v1/chat/completions", factory.build, point, seed=1)

    records, duration = asyncio.run(main())
    return records, duration, state


def test_closed_loop_keeps_concurrency_and_records_everything() -> None:
    records, duration, state = _run_against_fake(C.LoadPoint("closed", 3, 9, 60.0, 30.0))
    assert [r.index for r in records] == list(range(9))
    assert state["requests"] == 9 and state["peak"] == 3
    s = S.summarize(records, duration)
    assert s.num_ok == 9 and s.output_len_exact and s.cached_token_share == pytest.approx(0.4)
    assert all(r.ttft is not None and r.ttft >= 0.01 for r in records)
    assert s.itl.p50 == pytest.approx(0.01, abs=0.02)


def test_open_loop_follows_the_poisson_schedule() -> None:
    records, _, state = _run_against_fake(C.LoadPoint("open", 50.0, 10, 60.0, 30.0), tokens=2, delay=0.001)
    expected = C.poisson_arrivals(50.0, 10, seed=1)
    assert state["requests"] == 10
    assert [r.scheduled_s for r in records] == pytest.approx(expected)
    assert all(r.start_s >= r.scheduled_s - 1e-3 for r in records)


def test_connection_errors_become_records_not_exceptions() -> None:
    factory = W.RequestFactory(W.text_only(W.workload_spec("data")), "m")
    point = C.LoadPoint("closed", 2, 2, 10.0, 5.0)
    records, _ = asyncio.run(C.run_point("http://127.0.0.1:9/v1/chat/completions", factory.build, point))
    assert len(records) == 2 and all(r.error for r in records)


# ---- guidellm check ----------------------------------------------------------------------------------------


def test_guidellm_is_given_our_requests_as_jsonl(tmp_path: Path) -> None:
    spec = W.workload_spec("agent", shared_prefix_tokens=0, user_tokens=40, output_tokens=(8, 40))
    factory = W.RequestFactory(W.text_only(spec), "m")
    requests = [factory.build(i) for i in range(6)]
    path = tmp_path / "requests.jsonl"
    GC.write_guidellm_data(requests, path)
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    # guidellm's column mapper takes `prompt` as the user message and `output_tokens_count` as its length.
    assert [set(r) for r in rows] == [{"prompt", "output_tokens_count"}] * 6
    assert [r["prompt"] for r in rows] == [q.payload["messages"][0]["content"] for q in requests]
    assert [r["output_tokens_count"] for r in rows] == [q.output_tokens for q in requests]
    assert len({r["output_tokens_count"] for r in rows}) > 1


def test_harness_run_uses_guidellm_definitions_against_a_streaming_server() -> None:
    spec = W.workload_spec("agent", shared_prefix_tokens=0, user_tokens=40, output_tokens=(4, 4))
    requests = [W.RequestFactory(W.text_only(spec), "m").build(100 + i) for i in range(6)]
    args = argparse.Namespace(concurrency=2, max_duration=60.0, request_timeout=30.0, seed=0)
    state = {"active": 0, "peak": 0, "requests": 0}
    loop = asyncio.new_event_loop()
    server = loop.run_until_complete(_fake_server(4, 0.01, state))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        port = server.sockets[0].getsockname()[1]
        result = GC.run_harness(f"http://127.0.0.1:{port}", requests, args)
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
    assert state["requests"] == 6 and state["peak"] == 2 and result["errors"] == 0
    assert result["output_tokens_mean"] == 4 and result["prompt_tokens_mean"] == 10
    assert result["itl_mean_ms"] == pytest.approx(10, abs=8) and result["itl_p50_ms"] > 0
    assert result["output_tokens_per_s"] == pytest.approx(4 * result["requests_per_s"])


def _check_run(itl_ms: float, tok_s: float, step_ms: float) -> dict[str, float]:
    run = {key: 1.0 for key in GC.COMPARED} | {"chunk_itl_mean_ms": 1.0, "chunk_itl_p50_ms": 1.0}
    run |= {"tpot_mean_ms": 1.0, "tpot_p50_ms": 1.0, "client_cpu_s": 0.5, "server_steps": 100}
    run |= {"itl_mean_ms": itl_ms, "output_tokens_per_s": tok_s, "server_forward_ms_per_step": step_ms}
    return run | GC.normalized(run)


def test_comparison_takes_per_pair_differences_and_normalises_by_server_speed() -> None:
    # The server ran 20% slower during guidellm's runs; guidellm's ITL is 20% higher with it.
    runs = {
        "harness": [_check_run(40.0, 100.0, 50.0), _check_run(44.0, 90.0, 55.0)],
        "guidellm": [_check_run(48.0, 100 / 1.2, 60.0), _check_run(52.8, 75.0, 66.0)],
    }
    rows = GC.comparison_table(runs)
    itl = next(r for r in rows if r.startswith("| itl_mean_ms "))
    assert itl.endswith("| -16.7% **>10%** |")
    per_step = next(r for r in rows if r.startswith("| itl_mean_per_step "))
    assert per_step.endswith("| +0.0% |")
    assert "| 1 | guidellm |" in "\n".join(GC.pair_rows(runs))  # ABBA: the second pair starts with guidellm
    assert math.isnan(GC.counter_delta({}, {})["server_forward_ms_per_step"])  # a server without our counters


def test_guidellm_report_is_read_from_its_successful_requests() -> None:
    def dist(mean: float, median: float) -> dict[str, Any]:
        return {"successful": {"mean": mean, "median": median}, "errored": {"mean": 999.0}}

    metrics = {
        "time_to_first_token_ms": dist(100.0, 90.0),
        "inter_token_latency_ms": dist(20.0, 19.0),
        "requests_per_second": dist(1.5, 1.4),
        "output_tokens_per_second": dist(96.0, 95.0),
        "prompt_token_count": dist(280.0, 280.0),
        "output_token_count": dist(64.0, 64.0),
        "request_totals": {"errored": 0},
    }
    got = GC.parse_guidellm({"benchmarks": [{"metrics": metrics}]})
    assert (got["ttft_p50_ms"], got["itl_mean_ms"], got["requests_per_s"], got["errors"]) == (90.0, 20.0, 1.5, 0.0)


# ---- smoke: serve_bench against our server --------------------------------------------------------------------


@pytest.mark.slow
def test_serve_bench_smoke_against_our_server(tmp_path: Path) -> None:
    import serve_bench

    from testkit.checkpoints import cached_qwen2_vl

    tiny = str(cached_qwen2_vl("tiny"))
    args = [
        "--start",
        "ours",
        "--model-dir",
        tiny,
        "--workload",
        "data,chatbot",
        "--concurrency",
        "2",
        "--num-requests",
        "3",
        "--shared-prefix-tokens",
        "64",
        "--output-tokens",
        "4",
        "--warmup",
        "0",
        "--out",
        str(tmp_path),
    ]
    try:
        code = serve_bench.main(args)
    except (RuntimeError, TimeoutError) as exc:  # our own server: not starting is our breakage, never a skip
        pytest.fail(f"our server did not start: {exc}", pytrace=False)
    result = json.loads((tmp_path / "results.json").read_text())
    assert code == 0
    assert result["flavor"] == "vlm-engine" and "ignore_eos" in result["fields_sent"]
    for p in result["points"]:
        s = p["summary"]
        assert s["num_ok"] == 3 and s["output_len_exact"]
        assert all(r["prompt_tokens"] and r["media"].startswith("image:") for r in p["records"])
    chat = next(p for p in result["points"] if p["workload"] == "chatbot")
    assert chat["summary"]["cached_token_share"] > 0  # the shared prefix hit the prefix cache
    assert (tmp_path / "latency_vs_concurrency.png").exists()


class _HangingSpec(peers.ServerSpec):
    """A 'server' that never becomes healthy and has a child of its own."""

    def command(self, port: int) -> list[str]:
        code = "import subprocess, time; subprocess.Popen(['sleep', '61.234']); time.sleep(60.5)"
        return [sys.executable, "-c", code]


def test_managed_server_kills_its_whole_group_when_startup_fails(tmp_path: Path) -> None:
    import os

    server = peers.ManagedServer(_HangingSpec("ours", "/none"), tmp_path, startup_timeout_s=1.5, stop_grace_s=2.0)
    with pytest.raises(TimeoutError):
        server.start()
    assert server.proc is None
    # No process of the group survives: the leader and its `sleep` child are gone.
    out = os.popen("ps -eo pgid,args").read()
    assert "time.sleep(60.5)" not in out
    assert not any(line.strip().endswith("sleep 61.234") for line in out.splitlines())


def test_roofline_flags_impossible_step_times() -> None:
    machine = R.MachineCeilings(100e9, 200e9, 20e9, 30e9, 2, "cpu", "t", 2048)
    cost = R.ModelCost(10**8, 0, 0, 0, 1, 1, 1, 1)
    assert "IMPLAUSIBLE" in R.roofline(cost, machine, 1, 0, 1e-4, "float32", "client").line()
    assert "IMPLAUSIBLE" not in R.roofline(cost, machine, 1, 0, 0.1, "float32", "client").line()


def test_served_dtype_is_what_our_auto_runs_on_this_cpu(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import serve_bench

    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"dtype": "bfloat16"}}))
    monkeypatch.setenv("VLM_ENGINE_CPU_BF16", "0")  # an AVX2 machine: fp32 activations, bf16 weights
    assert serve_bench.served_dtype(str(tmp_path), ours=True) == R.BF16_WEIGHTS
    assert serve_bench.served_dtype(str(tmp_path), ours=False) == "bfloat16"  # a peer: the checkpoint's
    monkeypatch.setenv("VLM_ENGINE_CPU_BF16", "1")
    assert serve_bench.served_dtype(str(tmp_path), ours=True) == "bfloat16"
    (tmp_path / "config.json").write_text(json.dumps({"torch_dtype": "int8"}))
    assert serve_bench.served_dtype(str(tmp_path), ours=True) == "int8"  # not a float checkpoint: as declared


@pytest.mark.slow
def test_ab_speculative_quick(tmp_path: Path) -> None:
    from testkit.checkpoints import cached_qwen2_vl

    assert ab.main(["speculative", "--quick", "--model", str(cached_qwen2_vl("tiny")), "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    expected = {f"{w}/c={c}/{cfg}" for w in ("extraction", "chat") for c in (1, 2) for cfg in ("off", "ngram")}
    assert set(result["runs"]) == expected  # --quick starts no 'ngram-forced' server
    for runs in result["runs"].values():
        (run,) = runs
        assert run["summary"]["num_ok"] == run["summary"]["num_requests"] == 2 and set(run["spec"]) == set(ab.SPEC_COUNTERS)
        assert run["summary"]["decode_tok_s"] > 0 and len(run["texts"]) == 2
    table = (tmp_path / "table.md").read_text()
    assert "CPU tier **" in table and "| extraction | 2 | ngram |" in table


@pytest.mark.slow
def test_side_by_side_smoke_against_our_server(tmp_path: Path) -> None:
    from testkit.checkpoints import cached_qwen2_vl

    argv = ["transformers", "--smoke", "--plans", "data", "--sides", "ours,ours float32", "--concurrency", "2",
            "--requests", "2", "--model", str(cached_qwen2_vl("tiny")), "--out", str(tmp_path), "--no-decode-roofline"]  # fmt: skip
    assert SBS.main(argv) == 0
    result = json.loads((tmp_path / "results.json").read_text())
    assert {(p["server"], p["label"]) for p in result["points"]} == {("ours", "c=2"), ("ours float32", "c=2")}
    assert all(p["summary"]["num_ok"] == 2 and p["summary"]["output_len_exact"] for p in result["points"])
    assert all(i["peak_rss_bytes"] > 0 for i in result["servers"])
    row = next(line for line in (tmp_path / "table.md").read_text().splitlines() if line.startswith("| data | c=2 |"))
    assert row.count("**") == 8  # ours / ours float32 for req/s and tok/s, speed-ups for TTFT and TPOT


# ---- vs llama.cpp ------------------------------------------------------------------------------------


def test_converter_takes_our_qwen2_tokenizer_as_qwen2_and_nothing_else(tiny_vlm_dir: Path, tmp_path: Path) -> None:
    # Our locally trained Qwen2-VL tokenizer splits with Qwen2's regex: llama.cpp's qwen2 pre-tokenizer.
    from testkit.gguf_makers import uses_qwen2_split

    assert uses_qwen2_split(tiny_vlm_dir)
    other = json.loads((tiny_vlm_dir / "tokenizer.json").read_text())
    other["pre_tokenizer"] = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
    (tmp_path / "tokenizer.json").write_text(json.dumps(other))
    assert not uses_qwen2_split(tmp_path)
    assert not uses_qwen2_split(tmp_path / "missing")


def test_llamacpp_tables_put_each_plan_in_its_unit() -> None:
    def point(server: str, plan: str, tok_s: float, req_s: float) -> dict[str, Any]:
        summary = {"output_throughput": tok_s, "request_throughput": req_s, "ttft": {"p50": 0.5}}
        return {"server": server, "plan": plan, "label": "c=16", "rep": 1, "summary": summary | {"mean_prompt_tokens": 229}}

    text = [point(n, "textchat", t, 1.0) for n, t in zip(SBS.LLAMA_TEXT, (260.0, 200.0, 130.0, 65.0))]
    vision = [point(n, "vlm-data", 20.0, r) for n, r in zip(SBS.LLAMA_VLM, (1.5, 1.0, 1.8, 1.2))]
    rows = SBS.table(SBS.SUITES["llamacpp-text"], list(SBS.LLAMA_TEXT), SBS.aggregate(text), "avx2")
    textchat16 = next(r for r in rows if r.startswith("| textchat | c=16 |"))
    assert "| 260.0 | 200.0 | 130.0 | 65.0 | **1.30x** | **1.30x** | **0.50x** |" in textchat16  # F32, best, int4/Q4_1
    assert not any("vlm-data" in r for r in rows)
    vrows = SBS.table(SBS.SUITES["llamacpp-vlm"], list(SBS.LLAMA_VLM), SBS.aggregate(vision), "avx2")
    data16 = next(r for r in vrows if r.startswith("| vlm-data | c=16 |"))
    # ours / llama.cpp F32, ours int8 / llama.cpp Q8_0
    assert "| 1.50 | 1.00 | 1.80 | 1.20 | **1.50x** | **1.50x** | 500 / 500 / 500 / 500 | 229.0 / 229.0 / 229.0 / 229.0 |" in data16
    assert all(r.count("|") == vrows[0].count("|") for r in vrows)
