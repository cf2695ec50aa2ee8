"""`GET /metrics` in the Prometheus text format: the engine core's latest published stats (counters,
gauges, the queue-time histogram) and the API process's own latency histograms (TTFT, ITL, e2e)."""

from __future__ import annotations

from typing import Any

# (name, type, help, value getter)
_METRICS: list[tuple[str, str, str, Any]] = [
    ("vlm_kv_pages_used", "gauge", "KV cache pages held by requests", lambda s, c: s.pages_used),
    ("vlm_kv_pages_total", "gauge", "KV cache pages in the pool", lambda s, c: s.pages_total),
    ("vlm_kv_pages_cached", "gauge", "KV pages holding a reusable prefix", lambda s, c: s.pages_cached),
    ("vlm_requests_running", "gauge", "Requests in the running batch", lambda s, c: s.running),
    ("vlm_requests_waiting", "gauge", "Requests queued in the engine core", lambda s, c: s.waiting),
    (
        "vlm_requests_inflight",
        "gauge",
        "Engine requests accepted by the API and not finished",
        lambda s, c: c.num_inflight,
    ),
    ("vlm_steps_total", "counter", "Engine steps run", lambda s, c: s.steps),
    (
        "vlm_prompt_tokens_total",
        "counter",
        "Prompt tokens computed (prefix-cache hits excluded)",
        lambda s, c: s.prompt_tokens,
    ),
    ("vlm_generation_tokens_total", "counter", "Tokens sampled", lambda s, c: s.generation_tokens),
    (
        "vlm_prefix_cache_hit_tokens_total",
        "counter",
        "Prompt tokens served from the prefix cache",
        lambda s, c: s.cached_prompt_tokens,
    ),
    ("vlm_preemptions_total", "counter", "Requests preempted for lack of KV pages", lambda s, c: s.preemptions),
    ("vlm_step_schedule_seconds_total", "counter", "Host time spent scheduling", lambda s, c: s.schedule_s),
    (
        "vlm_step_forward_seconds_total",
        "counter",
        "Time spent in forward passes and sampling",
        lambda s, c: s.forward_s,
    ),
    ("vlm_step_update_seconds_total", "counter", "Host time spent applying step results", lambda s, c: s.update_s),
    (
        "vlm_grammar_mask_seconds_total",
        "counter",
        "Host time spent building structured-output token masks (on a thread, during the forward)",
        lambda s, c: s.grammar_mask_s,
    ),
]


def render_metrics(state: Any) -> str:
    stats, client = state.client.stats, state.client
    lines = []
    for name, kind, help_text, get in _METRICS:
        lines.append(f"# HELP {name} {help_text}")
        lines.append(f"# TYPE {name} {kind}")
        lines.append(f"{name} {get(stats, client)}")
    latencies = client.latencies
    for name, histogram, help_text in (
        ("vlm_time_to_first_token_seconds", latencies.ttft, "Request accepted to first token, as the API saw it"),
        ("vlm_inter_token_latency_seconds", latencies.itl, "Gap between output tokens, as the API saw it"),
        ("vlm_e2e_request_latency_seconds", latencies.e2e, "Request accepted to last token"),
        ("vlm_request_queue_time_seconds", stats.queue_time, "Waiting in the engine core before first scheduled"),
    ):
        lines += histogram.prometheus_lines(name, help_text)
    lines.append("# HELP vlm_healthy 1 when the server is ready and serving")
    lines.append("# TYPE vlm_healthy gauge")
    lines.append(f"vlm_healthy {int(state.healthy)}")
    return "\n".join(lines) + "\n"
