"""Metrics without a server: core-side histograms, the request tracker (TTFT, inter-token gaps,
end-to-end from scripted result arrivals), the Prometheus exposition read back, the request log's
lines and the status line."""

from __future__ import annotations

import json
from pathlib import Path

import msgspec
import pytest

from vlm_engine import ipc
from vlm_engine.histogram import Histogram
from vlm_engine.metrics.request_log import RequestLog
from vlm_engine.metrics.request_tracker import RequestRecord, RequestTracker
from vlm_engine.metrics.scrape import parse_metrics
from vlm_engine.metrics.status_log import StatusLine
from vlm_engine.server.metrics import ServerMetrics


class Recorder:
    """A RecordSink that keeps what it was told."""

    def __init__(self) -> None:
        self.ttft: list[float] = []
        self.gaps: list[tuple[float, int]] = []
        self.finished: list[RequestRecord] = []

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.append(ttft_s)

    def on_token_gap(self, gap_s: float, times: int) -> None:
        self.gaps.append((gap_s, times))

    def on_preprocessed(self, done: ipc.PreprocessDone) -> None:
        pass

    def on_finished(self, record: RequestRecord) -> None:
        self.finished.append(record)


def delta(rid: str, tokens: int, ids: list[int], finished: bool = False, reason: str | None = None) -> ipc.Delta:
    return ipc.Delta(rid, "", finished, reason, 5, 0, tokens, token_ids=ids)


def test_histogram_buckets_are_upper_bounds_inclusive() -> None:
    h = Histogram.with_bounds((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 1.0, 3.0):
        h.observe(value)
    h.observe(0.2, times=3)
    assert h.counts == [2, 5, 1] and h.count == 8
    assert h.total == pytest.approx(0.05 + 0.1 + 0.5 + 1.0 + 3.0 + 0.6)


def test_core_stats_travel_with_fresh_histograms() -> None:
    stats = ipc.CoreStats()
    stats.step_forward_s.observe(0.004)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=ipc.CoreStats)
    assert back.step_forward_s == stats.step_forward_s and back.step_forward_s.count == 1
    assert ipc.CoreStats().step_forward_s.count == 0  # a fresh histogram per instance, not a shared default


def test_tracker_latencies_from_result_arrivals() -> None:
    sink = Recorder()
    tracker = RequestTracker([sink], keep_token_ids=True)
    tracker.start("a-0", now=10.0)
    tracker.on_delta(delta("a-0", 0, []), now=10.1)  # nothing generated yet (text held back): no sample
    tracker.on_delta(delta("a-0", 1, [7]), now=10.5)  # first token: TTFT 0.5
    tracker.on_delta(delta("a-0", 4, [8, 9, 10]), now=10.8)  # three tokens in one result: three gaps of 0.1
    tracker.on_delta(delta("a-0", 5, [11], True, "length"), now=11.0)  # last token: gap 0.2
    assert sink.ttft == [pytest.approx(0.5)]
    assert [(pytest.approx(g), n) for g, n in sink.gaps] == [(0.1, 3), (0.2, 1)]
    (record,) = sink.finished
    assert record.output_token_ids == [7, 8, 9, 10, 11] and record.finish_reason == "length"
    assert record.finished - record.arrival == pytest.approx(1.0)
    assert (record.request_id, record.choice) == ("a", 0)
    assert tracker.num_live == 0


def test_tracker_errors_aborts_and_strangers() -> None:
    sink = Recorder()
    tracker = RequestTracker([sink])
    tracker.start("b-0", now=0.0)
    tracker.on_delta(delta("b-0", 2, [1, 2]), now=0.3)  # two tokens with the first result: one zero gap
    tracker.on_abort("b-0", now=0.35)
    tracker.on_delta(delta("b-0", 3, [3], True, "length"), now=0.4)  # late result after the abort: ignored
    tracker.on_delta(delta("never-0", 1, [1], True, "stop"), now=1.0)
    tracker.start("c-0", now=0.0)
    tracker.on_error(ipc.RequestError("c-0", 400, "bad image"), now=0.2)
    assert sink.gaps == [(0.0, 1)] and len(sink.ttft) == 1
    assert [(r.engine_id, r.finish_reason, r.error) for r in sink.finished] == [
        ("b-0", "abort", None),
        ("c-0", None, ipc.RequestError("c-0", 400, "bad image")),
    ]
    assert sink.finished[0].output_token_ids is None  # token ids are kept only when a sink wants them
    assert tracker.num_live == 0


def test_prometheus_exposition_reads_back() -> None:
    stats = ipc.CoreStats(pages_used=3, pages_total=12, running=2, waiting=1, generation_tokens=40)
    stats.step_batch_size.observe(2, times=5)
    metrics = ServerMetrics("m", "r1", lambda: stats, lambda: {"num_requests_inflight": 3, "healthy": 1})
    tracker = RequestTracker([metrics])
    tracker.start("x-0", now=0.0)
    tracker.on_delta(delta("x-0", 1, [5]), now=0.2)
    timing = ipc.RequestTiming(arrival=0.05, first_scheduled=0.1, first_token=0.19, finished=0.5)
    tracker.on_delta(msgspec.structs.replace(delta("x-0", 2, [6], True, "stop"), timing=timing), now=0.5)
    text = metrics.render().decode()
    assert 'vlm_engine:kv_cache_usage_perc{model_name="m",replica="r1"} 0.25' in text
    values = parse_metrics(text)
    assert values["vlm_engine:time_to_first_token_seconds_count"] == 1
    assert values["vlm_engine:time_to_first_token_seconds_sum"] == pytest.approx(0.2)
    assert values["vlm_engine:inter_token_latency_seconds_count"] == 1
    assert values["vlm_engine:request_queue_time_seconds_sum"] == pytest.approx(0.05)
    assert values["vlm_engine:request_prefill_time_seconds_sum"] == pytest.approx(0.09)
    assert values["vlm_engine:request_decode_time_seconds_sum"] == pytest.approx(0.31)
    assert values['vlm_engine:request_success_total{finished_reason="stop"}'] == 1
    assert values["vlm_engine:generation_tokens_total"] == 40
    assert values["vlm_engine:num_requests_running"] == 2 and values["vlm_engine:num_requests_inflight"] == 3
    assert values['vlm_engine:step_batch_size_bucket{le="1.0"}'] == 0
    assert values['vlm_engine:step_batch_size_bucket{le="2.0"}'] == 5
    assert values['vlm_engine:step_batch_size_bucket{le="+Inf"}'] == 5
    assert values["vlm_engine:step_batch_size_sum"] == 10
    assert "_created" not in text


def test_request_log_line(tmp_path: Path) -> None:
    log = RequestLog(tmp_path / "requests.jsonl", "m", "r1")
    tracker = RequestTracker([log], keep_token_ids=True)
    tracker.start("chatcmpl-1-0", now=1.0)
    tracker.on_preprocessed(
        ipc.PreprocessDone(0, "chatcmpl-1", 0, 1, 0.01, 1.01, media_hashes=["00ff"], prompt_token_ids=[1, 2, 3])
    )
    tracker.on_delta(delta("chatcmpl-1-0", 2, [9, 10], True, "stop"), now=1.5)
    tracker.start("chatcmpl-2-0", now=2.0)
    tracker.on_error(ipc.RequestError("chatcmpl-2-0", 400, "no such image", param="messages"), now=2.1)
    log.close()
    first, second = (json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines())
    assert first["request_id"] == "chatcmpl-1" and first["choice"] == 0
    assert first["prompt_token_ids"] == [1, 2, 3] and first["output_token_ids"] == [9, 10]
    assert first["media_hashes"] == ["00ff"] and first["finish_reason"] == "stop" and first["error"] is None
    assert first["preprocess_done"] - first["arrival"] == pytest.approx(0.01, abs=1e-5)
    assert second["error"] == {"status": 400, "message": "no such image", "type": "invalid_request_error",
                               "param": "messages", "code": None}  # fmt: skip
    assert second["finish_reason"] is None and second["output_token_ids"] == []


def test_status_line_rates_and_quiet_when_idle() -> None:
    status = StatusLine()
    stats = ipc.CoreStats(pages_total=100)
    assert status.line(stats, 0, now=0.0) is None  # the first call only takes the baseline
    assert status.line(stats, 0, now=10.0) is None  # idle: nothing to say
    stats = ipc.CoreStats(pages_used=25, pages_total=100, running=2, prompt_tokens=400, generation_tokens=50,
                          prefix_cache_queries=400, cached_prompt_tokens=100, mm_cache_queries=4, mm_cache_hits=1)  # fmt: skip
    line = status.line(stats, 3, now=20.0)
    assert line is not None
    assert "prompt 40.0 tok/s, generation 5.0 tok/s" in line and "running 2, waiting 0, in flight 3" in line
    assert "KV 25.0%" in line and "prefix cache hit 25.0%" in line and "mm cache hit 25.0%" in line
