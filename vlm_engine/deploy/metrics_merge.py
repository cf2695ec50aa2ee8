"""Several servers' /metrics as one Prometheus exposition: each metric family declared once, with
every server's samples under it (they differ by their `replica` label, so nothing collides)."""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector


class _Merged(Collector):
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge_expositions(texts: list[str]) -> bytes:
    merged: dict[str, Metric] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            into = merged.get(family.name)
            if into is None:
                merged[family.name] = family
            else:
                into.samples.extend(family.samples)
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Merged(list(merged.values())))
    return generate_latest(registry)
