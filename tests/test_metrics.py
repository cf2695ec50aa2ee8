"""Latency histograms: bucket placement, the Prometheus text, and the per-request latencies the
API process records (TTFT, inter-token gaps, end-to-end) from scripted result arrivals."""

from __future__ import annotations

import msgspec
import pytest

from vlm_engine import ipc
from vlm_engine.metrics.histogram import Histogram
from vlm_engine.metrics.latency import RequestLatencies


def test_histogram_buckets_are_upper_bounds_inclusive() -> None:
    h = Histogram.with_bounds((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 1.0, 3.0):
        h.observe(value)
    h.observe(0.2, times=3)
    assert h.counts == [2, 5, 1] and h.count == 8
    assert h.total == pytest.approx(0.05 + 0.1 + 0.5 + 1.0 + 3.0 + 0.6)
    lines = h.prometheus_lines("x_seconds", "help")
    assert lines[:2] == ["# HELP x_seconds help", "# TYPE x_seconds histogram"]
    assert lines[2:5] == [
        'x_seconds_bucket{le="0.1"} 2',
        'x_seconds_bucket{le="1.0"} 7',
        'x_seconds_bucket{le="+Inf"} 8',
    ]
    assert lines[-1] == "x_seconds_count 8"


def test_histogram_travels_inside_core_stats() -> None:
    stats = ipc.CoreStats()
    stats.queue_time.observe(0.4)
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(stats), type=ipc.CoreStats)
    assert back.queue_time == stats.queue_time and back.queue_time.count == 1
    assert ipc.CoreStats().queue_time.count == 0  # a fresh histogram per instance, not a shared default


def test_request_latencies_from_result_arrivals() -> None:
    lat = RequestLatencies()
    lat.start("a-0", now=10.0)
    lat.on_result("a-0", 0, False, now=10.1)  # nothing generated yet (e.g. text held back): ignored
    lat.on_result("a-0", 1, False, now=10.5)  # first token: TTFT 0.5
    lat.on_result("a-0", 4, False, now=10.8)  # three tokens in one result: three gaps of 0.1
    lat.on_result("a-0", 5, True, now=11.0)  # last token: gap 0.2, e2e 1.0
    assert lat.ttft.count == 1 and lat.ttft.total == pytest.approx(0.5)
    assert lat.itl.count == 4 and lat.itl.total == pytest.approx(0.3 + 0.2)
    assert lat.e2e.count == 1 and lat.e2e.total == pytest.approx(1.0)
    assert lat.num_live == 0


def test_aborted_and_unknown_requests_leave_no_state() -> None:
    lat = RequestLatencies()
    lat.start("b-0", now=0.0)
    lat.on_result("b-0", 2, False, now=0.3)  # two tokens with the first result: one zero gap
    lat.drop("b-0")
    lat.on_result("b-0", 3, True, now=0.4)  # late result after the abort: not counted
    lat.on_result("never-started", 1, True, now=1.0)
    lat.start("c-0", now=0.0)
    lat.on_result("c-0", 0, True, now=0.2)  # finished without a token (an error): no e2e sample
    assert (lat.ttft.count, lat.itl.count, lat.e2e.count) == (1, 1, 0)
    assert lat.num_live == 0
