"""Read a /metrics page back into numbers (tests, benchmarks): sample name -> value, with the
per-server labels (`model_name`, `replica`) summed away and other labels kept in the key, e.g.
`vlm_engine:time_to_first_token_seconds_bucket{le="0.1"}`."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

SERVER_LABELS = ("model_name", "replica")


def parse_metrics(text: str) -> dict[str, float]:
    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = {k: v for k, v in sample.labels.items() if k not in SERVER_LABELS}
            key = sample.name
            if labels:
                key += "{" + ",".join(f'{k}="{v}"' for k, v in sorted(labels.items())) + "}"
            values[key] = values.get(key, 0.0) + sample.value
    return values
