"""A histogram that travels between processes (a msgspec struct): the engine core fills it, the
API process exports it through prometheus_client. Also the latency bucket bounds the server uses
(close to vLLM's, so dashboards built for it read ours alike)."""

from __future__ import annotations

import bisect

import msgspec

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0)  # fmt: skip
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0)  # fmt: skip
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


class Histogram(msgspec.Struct, array_like=True):
    """Counts per bucket (`counts[i]`: observations <= bounds[i] and above the bound before it;
    the last entry is the +Inf bucket) and the sum of the observed values."""

    bounds: tuple[float, ...]
    counts: list[int]
    total: float = 0.0

    @classmethod
    def with_bounds(cls, bounds: tuple[float, ...]) -> Histogram:
        return cls(tuple(bounds), [0] * (len(bounds) + 1))

    @property
    def count(self) -> int:
        return sum(self.counts)

    def observe(self, value: float, times: int = 1) -> None:
        """Record `value` `times` times (e.g. one inter-token gap per token a chunk delivered)."""
        self.counts[bisect.bisect_left(self.bounds, value)] += times
        self.total += value * times
