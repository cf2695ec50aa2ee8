"""Server configuration: the engine's `EngineConfig` plus the server-only sections, one frozen
tree built by the CLI (`vlm_engine.cli`, flags generated from these fields) and shipped to every
child process. As in vlm_engine.config, each option is written once: default and help on its field."""

from __future__ import annotations

from dataclasses import dataclass, field

from vlm_engine.config import EngineConfig, FlatOptions, Section, above, at_least, comma_list, doc, text_or_none


def _app_names() -> list[str]:
    from vlm_engine.server.apps import APPS  # FastAPI: only the API process and the CLI need it

    return sorted(APPS)


def _tool_parser_names() -> list[str]:
    from vlm_engine.server.tool_parsers import TOOL_PARSERS

    return sorted(TOOL_PARSERS)


@dataclass(frozen=True)
class ApiConfig(Section):
    """The HTTP API: where it listens, who may call it, what one request may ask."""

    host: str = field(default="127.0.0.1", metadata=doc("the address to listen on"))
    port: int = field(default=8000, metadata=doc("the port to listen on"))
    api_key: str | None = field(
        default=None,
        metadata=doc(
            "require 'Authorization: Bearer KEY'", env="VLM_ENGINE_API_KEY", parse=text_or_none, metavar="KEY"
        ),
    )
    max_waiting_requests: int = field(
        default=1024,
        metadata=doc("engine requests accepted but not yet running; beyond this many, answer 503", check=at_least(0)),
    )
    retry_after_s: int = field(
        default=1, metadata=doc("the Retry-After, in seconds, a 503 'overloaded' answer suggests")
    )
    max_n: int = field(default=16, metadata=doc("most choices (n x prompts) in one request", check=at_least(1)))
    max_request_bytes: int = field(
        default=64 * 1024 * 1024,
        metadata=doc("JSON body cap (413 above it); images come base64-encoded", check=at_least(1)),
    )
    tool_call_parser: str = field(
        default="hermes",
        metadata=doc("how tool_choice=auto finds calls in the text (server.tool_parsers)", choices=_tool_parser_names),
    )

    responses_store_entries: int = field(
        default=1024,
        metadata=doc("responses kept for previous_response_id and GET /v1/responses/{id}", check=at_least(1)),
    )
    responses_store_bytes: int = field(
        default=256 * 1024 * 1024,
        metadata=doc(
            "bytes (as JSON, images included) the stored responses may hold; oldest out first", check=at_least(1)
        ),
    )
    responses_store_ttl_s: float = field(
        default=3600.0, metadata=doc("seconds a stored response is kept", metavar="SECONDS", check=above(0))
    )


def _origins(text: str) -> tuple[str, ...]:
    return tuple(origin.rstrip("/") for origin in comma_list(text) or ())


@dataclass(frozen=True)
class WebConfig(Section):
    """A static web app hosted next to the API (server.apps), and CORS for pages served elsewhere."""

    app: str | None = field(
        default=None, metadata=doc("also serve this web app at /APP (/ redirects there)", choices=_app_names)
    )
    allowed_origins: tuple[str, ...] = field(
        default=(),
        metadata=doc(
            "comma-separated origins allowed by CORS ('*' for any; default: same origin only)",
            parse=_origins,
            metavar="ORIGINS",
        ),
    )


@dataclass(frozen=True)
class ObservabilityConfig(Section):
    """Metrics, logs and traces (docs/ARCHITECTURE.md, "Observability")."""

    replica_id: str | None = field(
        default=None, metadata=doc("the `replica` label of every metric (default: hostname:port)", metavar="ID")
    )
    log_stats: bool = field(
        default=True, metadata=doc("latency/step metrics, per-step histograms and the periodic status line")
    )
    log_stats_interval_s: float = field(
        default=10.0, metadata=doc("seconds between status lines (0: never)", check=at_least(0))
    )
    request_log: str | None = field(
        default=None,
        metadata=doc("append one JSON line per finished request (token ids included) to this file", metavar="PATH"),
    )
    profile_dir: str | None = field(
        default=None,
        metadata=doc("enable POST /start_profile, /stop_profile; torch profiler traces go here", metavar="DIR"),
    )


@dataclass(frozen=True)
class ProcessConfig(Section):
    """The child processes: how many workers, their priority, start-up and shutdown."""

    preprocess_workers: int = field(default=1, metadata=doc("preprocess worker processes", check=at_least(1)))
    # API, preprocess and detokenizer yield the cores to the engine core. Measured (SmolLM2, 2 cores,
    # streaming, concurrency 64, bf16): nice 10 and 19 give the same tokens/s, but at 19 the API and
    # detokenizer get too little CPU while the core is saturated (ITL p50 ~190 ms vs ~110 ms, TTFT
    # ~2.2 s vs ~1.5 s); nice 0 costs ~8% tokens/s at concurrency 16.
    side_process_nice: int = field(
        default=10, metadata=doc("niceness of the API, preprocess and detokenizer processes")
    )
    shutdown_timeout_s: float = field(
        default=5.0, metadata=doc("seconds in-flight requests get on SIGTERM before they are aborted")
    )
    warmup: bool = field(
        default=True, metadata=doc("a warm-up request (and the grammar tokenizer index) before /health turns 200")
    )
    log_level: str = field(
        default="info", metadata=doc("the log level of every process", choices=("debug", "info", "warning", "error"))
    )


_RAY_ROUTINGS = ("affinity", "round_robin", "pow2")


@dataclass(frozen=True)
class RayConfig(Section):
    """Scale-out on Ray Serve (vlm_engine.deploy): replicas of this whole server behind one endpoint."""

    ray: bool = field(default=False, metadata=doc("serve replicas of this server on Ray Serve (the 'ray' extra)"))
    ray_address: str | None = field(
        default=None,
        metadata=doc("the Ray cluster to join ('auto', ray://...; default: start a local one)", metavar="ADDRESS"),
    )
    ray_replicas: int = field(default=1, metadata=doc("replicas (the minimum when autoscaling)", check=at_least(1)))
    ray_max_replicas: int | None = field(
        default=None,
        metadata=doc("autoscale up to this many replicas on ongoing requests per replica", check=at_least(1)),
    )
    ray_target_ongoing_requests: float = field(
        default=16.0, metadata=doc("autoscaling's target of ongoing requests per replica", check=above(0))
    )
    ray_max_ongoing_requests: int = field(
        default=256, metadata=doc("requests one replica may hold before Serve queues more", check=at_least(1))
    )
    ray_replica_cpus: float = field(
        default=1.0, metadata=doc("CPUs Ray reserves for each replica", check=above(0))
    )
    ray_replica_gpus: float = field(
        default=0.0, metadata=doc("GPUs Ray reserves for each replica (and makes visible to it)", metavar="X")
    )
    ray_routing: str = field(
        default="affinity",
        metadata=doc("how requests pick a replica: prefix + media cache affinity, round robin, or Serve's "
                     "power of two choices", choices=_RAY_ROUTINGS),
    )  # fmt: skip

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.ray_max_replicas is not None and self.ray_max_replicas < self.ray_replicas:
            raise ValueError("ray_max_replicas must be >= ray_replicas")


@dataclass(frozen=True)
class ServerConfig(FlatOptions):
    """`vlm-engine serve`'s whole configuration. `ServerConfig.from_flat(port=0, max_num_seqs=8)`
    routes option names to their sections, the engine's included."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    api: ApiConfig = field(default_factory=ApiConfig)
    web: WebConfig = field(default_factory=WebConfig)
    observability: ObservabilityConfig = field(default_factory=ObservabilityConfig)
    process: ProcessConfig = field(default_factory=ProcessConfig)
    ray: RayConfig = field(default_factory=RayConfig)

    @property
    def model_name(self) -> str:
        """The model id clients see and send."""
        return self.engine.model.served_model_name or self.engine.model.model

    @property
    def replica(self) -> str:
        import socket

        return self.observability.replica_id or f"{socket.gethostname()}:{self.api.port}"
