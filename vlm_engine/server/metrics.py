"""`GET /metrics`: Prometheus metrics through prometheus_client, named as vLLM's dashboards expect
(`vlm_engine:` instead of `vllm:`), every sample labelled with `model_name` and `replica`.

Two sources, one registry owned by the API process:
- per-request histograms and counters observed here (`ServerMetrics` is a `RecordSink` of the
  request tracker): TTFT, inter-token latency, end-to-end, queue / prefill / decode / preprocess
  time, prompt and generation lengths, media preprocessing seconds by kind, finishes and errors;
- the engine core's gauges, counters and per-step histograms, which the core sends whole
  (cumulative) with every result message: `_CoreCollector` exposes the latest copy, so counters
  stay exact across processes without prometheus_client's multiprocess files.

The gauges of the Gateway API Inference Extension's model-server protocol are also exported under
vLLM's names (`VLLM_ALIASES`), so that its endpoint picker reads them without configuration.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric
from prometheus_client.registry import Collector
from prometheus_client.samples import Sample
from prometheus_client.utils import floatToGoString

from vlm_engine import histogram as H
from vlm_engine import ipc
from vlm_engine.metrics.request_tracker import RequestRecord

disable_created_metrics()  # no `_created` series: dashboards never use them (vLLM does the same)

PREFIX = "vlm_engine:"
LABELS = ("model_name", "replica")
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000)
MEDIA_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class ServerMetrics:
    def __init__(self, model_name: str, replica: str, core_stats: Callable[[], ipc.CoreStats],
                 gauges: Callable[[], dict[str, float]],
                 core_info: Callable[[], ipc.CoreReady | None] = lambda: None) -> None:  # fmt: skip
        self.registry = CollectorRegistry()
        self.label_values = (model_name, replica)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, LABELS, buckets=buckets, registry=self.registry).labels(
                *self.label_values
            )

        self.ttft = histogram(
            "time_to_first_token_seconds", "Request accepted to first token, as the API saw it", H.TTFT_BUCKETS
        )
        self.itl = histogram(
            "inter_token_latency_seconds", "Gap between output tokens, as the API saw it", H.ITL_BUCKETS
        )
        self.e2e = histogram("e2e_request_latency_seconds", "Request accepted to last token", H.REQUEST_BUCKETS)
        self.queue = histogram(
            "request_queue_time_seconds", "In the engine core's queue before first scheduled", H.REQUEST_BUCKETS
        )
        self.prefill = histogram("request_prefill_time_seconds", "First scheduled to first token", H.REQUEST_BUCKETS)
        self.decode = histogram("request_decode_time_seconds", "First token to finish", H.REQUEST_BUCKETS)
        self.preprocess = histogram(
            "request_preprocess_time_seconds",
            "In a preprocess worker: template, tokenization, media",
            H.REQUEST_BUCKETS,
        )
        self.prompt_tokens = histogram("request_prompt_tokens", "Prompt length of finished requests", TOKEN_BUCKETS)
        self.generation_tokens = histogram(
            "request_generation_tokens", "Output length of finished requests", TOKEN_BUCKETS
        )
        self.spec_acceptance = histogram(
            "request_spec_acceptance_length",
            "Speculative decoding: tokens per verification step over a finished request",
            ipc.ACCEPTANCE_LENGTH_BUCKETS,
        )
        self.media = Histogram(
            PREFIX + "media_preprocess_seconds",
            "Media preprocessing by kind: url_fetch (downloads, in the API process), image_decode, "
            "video_extraction, pdf_render (PDF pages), image_processor (resize/normalize)",
            (*LABELS, "kind"),
            buckets=MEDIA_BUCKETS,
            registry=self.registry,
        )
        self.success = Counter(
            PREFIX + "request_success",
            "Finished requests by finish reason",
            (*LABELS, "finished_reason"),
            registry=self.registry,
        )
        self.api_requests = Counter(
            PREFIX + "api_requests",
            "Finished engine requests by the API that asked (chat_completions, completions, responses), errors included",
            (*LABELS, "api"),
            registry=self.registry,
        )
        self.errors = Counter(
            PREFIX + "request_errors",
            "Requests answered with an error, by HTTP status",
            (*LABELS, "status"),
            registry=self.registry,
        )
        self.worker_restarts = Counter(
            PREFIX + "preprocess_worker_restarts",
            "Preprocess workers that died and were restarted (the prompts they held got an error)",
            LABELS,
            registry=self.registry,
        ).labels(*self.label_values)
        self.registry.register(_CoreCollector(self.label_values, core_stats, gauges, core_info))

    def render(self) -> bytes:
        return generate_latest(self.registry)

    # ---- RecordSink ---------------------------------------------------------------------------

    def on_first_token(self, ttft_s: float) -> None:
        self.ttft.observe(ttft_s)

    def on_token_gap(self, gap_s: float, times: int) -> None:
        for _ in range(times):
            self.itl.observe(gap_s)

    def on_preprocessed(self, done: ipc.PreprocessDone) -> None:
        self.preprocess.observe(done.seconds)
        for m in done.media:
            self.media.labels(*self.label_values, m.kind).observe(m.seconds)

    def on_finished(self, record: RequestRecord) -> None:
        if record.media_fetch_s is not None:
            self.media.labels(*self.label_values, "url_fetch").observe(record.media_fetch_s)
        self.api_requests.labels(*self.label_values, record.api or "unknown").inc()
        if record.error is not None:
            self.errors.labels(*self.label_values, str(record.error.status)).inc()
            return
        self.success.labels(*self.label_values, record.finish_reason or "abort").inc()
        if record.completion_tokens == 0:
            return
        self.e2e.observe(record.finished - record.arrival)  # type: ignore[operator]
        self.prompt_tokens.observe(record.prompt_tokens)
        self.generation_tokens.observe(record.completion_tokens)
        t = record.timing
        if t is not None and t.first_scheduled is not None and t.first_token is not None:
            self.queue.observe(t.first_scheduled - t.arrival)
            self.prefill.observe(t.first_token - t.first_scheduled)
            if t.finished is not None:
                self.decode.observe(t.finished - t.first_token)
        if t is not None and t.spec_drafts:
            self.spec_acceptance.observe(1 + t.spec_accepted_tokens / t.spec_drafts)


# (name, help, CoreStats field) for the core's gauges, counters and per-step histograms.
_CORE_GAUGES = [
    ("num_requests_running", "Requests in the running batch", "running"),
    ("num_requests_waiting", "Requests queued in the engine core", "waiting"),
    ("kv_pages_used", "KV cache pages held by requests", "pages_used"),
    ("kv_pages_total", "KV cache pages in the pool", "pages_total"),
    ("kv_pages_cached", "KV pages holding a reusable prefix", "pages_cached"),
    ("state_slots_used", "Linear-attention state slots held (running requests, checkpoints, snapshots)", "state_slots_used"),
    ("state_slots_total", "Linear-attention state slots in the pool (0: the model keeps none)", "state_slots_total"),
    ("state_snapshots", "Prefix-cache snapshots of linear-attention state kept", "state_snapshots"),
]
_CORE_COUNTERS = [
    ("prompt_tokens", "Prompt tokens of admitted requests (prefix-cache hits included)", "prompt_tokens"),
    ("prefill_tokens", "Tokens run through prefill (recomputation after preemption included)", "prefill_tokens"),
    ("generation_tokens", "Tokens sampled", "generation_tokens"),
    ("cached_prompt_tokens", "Prompt tokens served from the prefix cache", "cached_prompt_tokens"),
    ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache", "prefix_cache_queries"),
    ("prefix_cache_hits", "Prompt tokens found in the prefix cache", "cached_prompt_tokens"),
    ("mm_cache_queries", "Media items looked up in the vision-encoder cache", "mm_cache_queries"),
    ("mm_cache_hits", "Media items found in the vision-encoder cache", "mm_cache_hits"),
    ("num_preemptions", "Requests preempted for lack of KV pages", "preemptions"),
    ("state_snapshot_hits", "Prefix-cache hits resumed from a linear-attention state snapshot", "state_snapshot_hits"),
    ("engine_steps", "Engine steps run", "steps"),
    (
        "grammar_mask_seconds",
        "Host time building structured-output token masks (overlapped with the forward)",
        "grammar_mask_s",
    ),
    ("spec_decode_num_drafts", "Speculative decoding: verified sequences that carried a draft", "spec_drafts"),
    ("spec_decode_num_draft_tokens", "Speculative decoding: draft tokens proposed and verified", "spec_draft_tokens"),
    ("spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted", "spec_accepted_tokens"),
]
_CORE_HISTOGRAMS = [
    ("step_schedule_seconds", "Host time in the scheduler, per step", "step_schedule_s"),
    ("step_forward_seconds", "Forward pass and sampling, per step", "step_forward_s"),
    ("step_update_seconds", "Host time applying a step's results", "step_update_s"),
    ("step_batch_size", "Sequences in a step", "step_batch_size"),
    ("step_prefill_tokens", "Prompt tokens computed in a step", "step_prefill_tokens"),
    ("step_cached_tokens", "Prompt tokens newly served from the prefix cache in a step", "step_cached_tokens"),
    ("step_decode_tokens", "Decode tokens in a step", "step_decode_tokens"),
    ("spec_decode_propose_seconds", "Speculative decoding: proposing drafts, per step", "step_spec_propose_s"),
    (
        "spec_decode_acceptance_length",
        "Speculative decoding: tokens one verification emitted for one sequence (accepted drafts + 1)",
        "spec_acceptance_length",
    ),
]


# The Gateway API Inference Extension (Kubernetes' inference gateway, llm-d) routes by scraping every
# model server for the gauges of its model-server protocol (kubernetes-sigs/gateway-api-inference-extension,
# docs/proposals/003-model-server-protocol): queued requests, running requests, KV cache utilization
# (a fraction) and, optionally, the cache config (labels block_size and num_gpu_blocks). Its endpoint
# picker (EPP) reads them by vLLM's names unless told otherwise, and how it is told changed between
# releases (command-line flags, then per-engine `engineConfigs`, with the flags rejected). These few
# gauges are therefore exported twice, under our name and vLLM's, with the same value and labels, so
# that an unconfigured EPP works with every release. Nothing else is duplicated (deploy/README.md).
VLLM_ALIASES = {
    PREFIX + "num_requests_waiting": "vllm:num_requests_waiting",
    PREFIX + "num_requests_running": "vllm:num_requests_running",
    PREFIX + "kv_cache_usage_perc": "vllm:kv_cache_usage_perc",
    PREFIX + "cache_config_info": "vllm:cache_config_info",
}


class _CoreCollector(Collector):
    def __init__(self, label_values: tuple[str, str], core_stats: Callable[[], ipc.CoreStats],
                 gauges: Callable[[], dict[str, float]],
                 core_info: Callable[[], ipc.CoreReady | None]) -> None:  # fmt: skip
        self.label_values = list(label_values)
        self.core_stats = core_stats
        self.gauges = gauges
        self.core_info = core_info

    def collect(self) -> Iterator[Metric]:
        stats, labels = self.core_stats(), self.label_values
        core_gauges = [self._gauge(name, doc, getattr(stats, attr)) for name, doc, attr in _CORE_GAUGES]
        usage = stats.pages_used / stats.pages_total if stats.pages_total else 0.0
        core_gauges.append(self._gauge("kv_cache_usage_perc", "Fraction of KV cache pages in use (0..1)", usage))
        info = self.core_info()
        if info is not None:  # known once the core reported ready; /metrics may be read before that
            core_gauges.append(self._cache_config(info))
        yield from core_gauges
        yield from (_vllm_alias(family) for family in core_gauges if family.name in VLLM_ALIASES)
        for name, value in self.gauges().items():
            yield self._gauge(name, _API_GAUGE_HELP[name], value)
        for name, doc, attr in _CORE_COUNTERS:
            family = CounterMetricFamily(PREFIX + name, doc, labels=LABELS)
            family.add_metric(labels, getattr(stats, attr))
            yield family
        for name, doc, attr in _CORE_HISTOGRAMS:
            hist: H.Histogram = getattr(stats, attr)
            family = HistogramMetricFamily(PREFIX + name, doc, labels=LABELS)
            family.add_metric(labels, _cumulative_buckets(hist), hist.total)
            yield family

    def _gauge(self, name: str, doc: str, value: float) -> GaugeMetricFamily:
        family = GaugeMetricFamily(PREFIX + name, doc, labels=LABELS)
        family.add_metric(self.label_values, value)
        return family

    def _cache_config(self, info: ipc.CoreReady) -> GaugeMetricFamily:
        """An info gauge (always 1) whose labels carry the KV cache layout, as vLLM's cache_config_info:
        the EPP's prefix-cache scorer hashes prompts in blocks of `block_size` tokens (our KV page size),
        and reads `num_gpu_blocks` (our KV pages, whatever the device) to size its index."""
        family = GaugeMetricFamily(
            PREFIX + "cache_config_info",
            "KV cache layout in labels: block_size = tokens per KV page, num_gpu_blocks = KV pages in the pool",
            labels=(*LABELS, "block_size", "num_gpu_blocks"),
        )
        family.add_metric([*self.label_values, str(info.page_size), str(info.num_pages)], 1)
        return family


def _vllm_alias(family: Metric) -> Metric:
    """`family` under vLLM's name: same type, labels and values (see VLLM_ALIASES)."""
    name = VLLM_ALIASES[family.name]
    alias = Metric(name, f"{family.documentation} (= {family.name}, for the Gateway API Inference Extension)",
                   family.type)  # fmt: skip
    alias.samples = [Sample(name, s.labels, s.value, s.timestamp, s.exemplar) for s in family.samples]
    return alias


_API_GAUGE_HELP = {
    "num_requests_inflight": "Engine requests accepted by the API and not finished (preprocessing included)",
    "healthy": "1 when the server is ready and serving",
    "preprocess_workers_ready": "Preprocess workers up and taking prompts",
}


def _cumulative_buckets(hist: H.Histogram) -> list[tuple[str, float]]:
    out, running = [], 0
    for bound, n in zip(hist.bounds, hist.counts):
        running += n
        out.append((floatToGoString(bound), running))
    out.append(("+Inf", running + hist.counts[-1]))
    return out


def observe_requests(state: Any) -> ServerMetrics:
    """Wire the API process's observers: Prometheus metrics (unless --disable-log-stats) and the
    request log (--request-log) become sinks of the engine client's request tracker."""
    config, client = state.config, state.client
    metrics = ServerMetrics(
        config.model_name,
        config.replica,
        lambda: client.stats,
        lambda: {
            "num_requests_inflight": client.num_inflight,
            "healthy": int(state.healthy),
            "preprocess_workers_ready": len(client.ready_workers),
        },
        lambda: client.core_info,
    )
    if config.observability.log_stats:
        client.tracker.sinks.append(metrics)
    if config.observability.request_log is not None:
        from vlm_engine.metrics.request_log import RequestLog

        client.tracker.sinks.append(RequestLog(config.observability.request_log, config.model_name, config.replica))
        client.tracker.keep_token_ids = True
    state.metrics = metrics
    return metrics
