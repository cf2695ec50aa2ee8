"""Operations on Kubernetes.

1. The Gateway API Inference Extension's model-server protocol: the gauges its endpoint picker (EPP)
   scrapes, as the protocol defines them (written down here), exported by the shared live server
   with the right types and meaning, and named in deploy/README.md exactly as exported.
2. deploy/ray/rayservice.yaml, the KubeRay RayService: its structure, its serveConfigV2 under Ray
   Serve's own schema, and our application builder run on its args. No Kubernetes cluster is used.
"""

from __future__ import annotations

import importlib
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
import yaml  # PyYAML: transformers' own dependency
from prometheus_client.parser import text_string_to_metric_families

from tests.conftest import OBSERVED_REPLICA as REPLICA
from tests.kernel_builds import setup_missing
from tests.server_helpers import REPO, ServerProcess

pytestmark = pytest.mark.timeout(300)

DEPLOY_README = REPO / "deploy/README.md"
RAYSERVICE = REPO / "deploy/ray/rayservice.yaml"
APP_BUILDER = "vlm_engine.deploy.ray_serve:app_builder"


@dataclass(frozen=True)
class ProtocolMetric:
    name: str  # the protocol's name for it
    type: str  # the protocol's type: "Gauge", or "Labeled" (an info gauge whose label holds the value)
    vllm: str  # vLLM's metric: what the EPP reads unless configured otherwise
    ours: str | None  # the same metric under vlm-engine's name; None: not exported
    flag: str  # the EPP's command-line flag naming the metric (older releases)
    engine_config_key: str  # its key in an entry of the EPP's `engineConfigs` (newer releases)
    label: str | None = None  # Labeled: the label that holds the value


# The protocol: kubernetes-sigs/gateway-api-inference-extension, docs/proposals/003-model-server-protocol/
# README.md, "Metrics Reporting" (names may differ between servers, types and semantics MUST NOT). Flags:
# the EPP's runserver options; engineConfigs keys: its metrics extractor's factories.go (the Gateway API
# Inference Extension and llm-d/llm-d-router agree on both).
PROTOCOL = (
    ProtocolMetric("TotalQueuedRequests", "Gauge", "vllm:num_requests_waiting", "vlm_engine:num_requests_waiting",
                   "--total-queued-requests-metric", "queuedRequestsSpec"),
    ProtocolMetric("TotalRunningRequests", "Gauge", "vllm:num_requests_running", "vlm_engine:num_requests_running",
                   "--total-running-requests-metric", "runningRequestsSpec"),
    ProtocolMetric("KVCacheUtilization", "Gauge", "vllm:kv_cache_usage_perc", "vlm_engine:kv_cache_usage_perc",
                   "--kv-cache-usage-percentage-metric", "kvUsageSpec"),
    ProtocolMetric("BlockSize", "Labeled", "vllm:cache_config_info", "vlm_engine:cache_config_info",
                   "--cache-info-metric", "cacheInfoSpec", label="block_size"),
    ProtocolMetric("NumGPUBlocks", "Labeled", "vllm:cache_config_info", "vlm_engine:cache_config_info",
                   "--cache-info-metric", "cacheInfoSpec", label="num_gpu_blocks"),
)  # fmt: skip
# Optional, for servers with dynamic LoRA adapters; vlm-engine has none, so it exports nothing for it.
LORA = ProtocolMetric("LoRA adapters", "Labeled", "vllm:lora_requests_info", None, "--lora-info-metric", "loraSpec")


# ---- deploy/README.md names what the server exports -------------------------------------------


def gateway_section() -> str:
    text = DEPLOY_README.read_text()
    start = text.index("## Routing with the Kubernetes Gateway API Inference Extension")
    end = text.find("\n## ", start + 1)
    return text[start : end if end >= 0 else len(text)]


def table_rows(section: str) -> dict[str, list[str]]:
    """The mapping table: protocol metric name -> the row's cells with backticks stripped (a row may
    name several metrics, "BlockSize, NumGPUBlocks")."""
    rows: dict[str, list[str]] = {}
    for line in section.splitlines():
        if not line.startswith("| ") or line.startswith(("| Protocol metric", "|---")):
            continue
        cells = [cell.strip().strip("`") for cell in line.strip().strip("|").split("|")]
        for name in cells[0].split(", "):
            rows[name] = cells
    return rows


def fenced_blocks(section: str, language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", section, flags=re.DOTALL)


def test_readme_table_maps_the_protocol_to_exported_names() -> None:
    rows = table_rows(gateway_section())
    assert set(rows) == {m.name for m in (*PROTOCOL, LORA)}
    for m in (*PROTOCOL, LORA):
        kind, vllm, ours, flag, key = rows[m.name][1:]
        assert (kind, vllm, flag, key) == (m.type, m.vllm, m.flag, m.engine_config_key), m.name
        assert ours == (m.ours or "not exported"), m.name


def test_readme_epp_configuration_names_exported_metrics() -> None:
    """The flags and the engineConfigs entry that deploy/README.md gives an EPP name exactly the
    metrics the server exports (or "" for LoRA, which turns it off)."""
    expected = {m.flag: m.ours for m in PROTOCOL} | {LORA.flag: ""}
    (flags_block,) = fenced_blocks(gateway_section(), "sh")
    flags = dict(re.fullmatch(r"(--[a-z-]+)=(.*)", line).groups() for line in flags_block.splitlines())
    assert {flag: value.strip('"') for flag, value in flags.items()} == expected

    (config_block,) = fenced_blocks(gateway_section(), "yaml")
    (engine,) = yaml.safe_load(config_block)["engineConfigs"]
    assert engine.pop("name") == "vlm-engine"
    assert engine == {m.engine_config_key: m.ours for m in PROTOCOL} | {LORA.engine_config_key: ""}


# ---- the exposition, without a server ----------------------------------------------------------


def families_of(text: str) -> dict[str, Any]:
    return {family.name: family for family in text_string_to_metric_families(text)}


def samples_of(family: Any) -> set[tuple[tuple[tuple[str, str], ...], float]]:
    return {(tuple(sorted(s.labels.items())), s.value) for s in family.samples}


def test_vllm_names_duplicate_ours_exactly() -> None:
    from vlm_engine import ipc
    from vlm_engine.server.metrics import VLLM_ALIASES, ServerMetrics

    stats = ipc.CoreStats(pages_used=3, pages_total=12, running=2, waiting=5)
    info: list[ipc.CoreReady] = []
    metrics = ServerMetrics("m", "r1", lambda: stats, dict, lambda: info[0] if info else None)
    # Before the core reports ready its page size is unknown: no cache info yet, the rest is there.
    families = families_of(metrics.render().decode())
    assert "vlm_engine:cache_config_info" not in families and "vllm:cache_config_info" not in families
    assert families["vllm:num_requests_waiting"].samples[0].value == 5

    info.append(ipc.CoreReady("m", max_model_len=512, num_pages=12, page_size=16, pid=1))
    families = families_of(metrics.render().decode())
    # Nothing but the protocol's gauges is duplicated.
    assert {name for name in families if name.startswith("vllm:")} == set(VLLM_ALIASES.values())
    for ours, vllm in VLLM_ALIASES.items():
        assert families[vllm].type == families[ours].type == "gauge"
        assert samples_of(families[vllm]) == samples_of(families[ours]), vllm
    assert families["vllm:kv_cache_usage_perc"].samples[0].value == 0.25
    (sample,) = families["vllm:cache_config_info"].samples
    assert sample.value == 1 and sample.labels == {
        "model_name": "m", "replica": "r1", "block_size": "16", "num_gpu_blocks": "12"
    }  # fmt: skip


# ---- against the shared live server --------------------------------------------------------------


def scrape(server: ServerProcess) -> tuple[str, dict[str, Any]]:
    text = httpx.get(server.url + "/metrics", timeout=5.0).text
    return text, families_of(text)


def protocol_value(families: dict[str, Any], name: str, m: ProtocolMetric) -> float:
    """What an EPP reads for `m` under the metric `name`: the gauge's value, or the label's."""
    (sample,) = families[name].samples  # one series per server: the EPP takes the first it finds
    return float(sample.labels[m.label]) if m.label else sample.value


@pytest.mark.slow
def test_protocol_metrics_are_exported_with_the_protocols_types(observed_server: ServerProcess) -> None:
    _, families = scrape(observed_server)
    for m in PROTOCOL:
        for name in (m.vllm, m.ours):
            family = families.get(name)
            assert family is not None, f"{m.name}: {name} is not exported"
            assert family.type == "gauge", f"{m.name}: {name} is a {family.type}"  # Labeled: an info gauge
            for sample in family.samples:
                assert sample.labels["model_name"] == "tiny-vlm" and sample.labels["replica"] == REPLICA
        assert protocol_value(families, m.vllm, m) == protocol_value(families, m.ours, m), m.name
    assert LORA.vllm not in families  # no LoRA adapters, so no LoRA info to pretend
    (info,) = families["vllm:cache_config_info"].samples
    assert info.value == 1
    assert int(info.labels["block_size"]) == 16  # observed_server runs the default --page-size
    (pages,) = families["vlm_engine:kv_pages_total"].samples
    assert int(info.labels["num_gpu_blocks"]) == pages.value == 512 // 16  # --kv-cache-tokens 512


@pytest.mark.slow
def test_exposition_parses_with_prometheus_go_parser(observed_server: ServerProcess) -> None:
    """The EPP parses /metrics with Go's expfmt text parser; so does promtool. Lint remarks (exit 3:
    names with ':', as vLLM's) are fine; a parse error (exit 1) is what would blind an EPP."""
    if shutil.which("promtool") is None:
        setup_missing("promtool is not installed (Debian's prometheus package has it: `make system-packages`)")
    text, _ = scrape(observed_server)
    result = subprocess.run(["promtool", "check", "metrics"], input=text, capture_output=True, text=True, check=False)
    out = result.stdout + result.stderr
    assert result.returncode in (0, 3) and "error while linting" not in out, out
    vllm_remarks = [line for line in out.splitlines() if line.startswith("vllm:")]
    assert all(line.endswith("metric names should not contain ':'") for line in vllm_remarks), vllm_remarks


def chat(server: ServerProcess, i: int, max_tokens: int) -> int:
    body = {"model": "tiny-vlm", "messages": [{"role": "user", "content": f"Story {i}."}],
            "max_tokens": max_tokens, "ignore_eos": True}  # fmt: skip
    return httpx.post(server.base_url + "/chat/completions", json=body, timeout=120).status_code


@pytest.mark.slow
def test_queue_running_and_kv_gauges_follow_a_burst(observed_server: ServerProcess) -> None:
    """What the EPP scores on: during a burst larger than the batch (--max-num-seqs 8) and the KV
    pool (512 tokens), requests wait and run and KV use rises, within 0..1; after it, all is 0."""
    n, tokens = 16, 64
    seen: dict[str, list[float]] = {m.vllm: [] for m in PROTOCOL[:3]}
    with ThreadPoolExecutor(n) as pool:
        futures = [pool.submit(chat, observed_server, i, tokens) for i in range(n)]
        while not all(f.done() for f in futures):
            _, families = scrape(observed_server)
            for m in PROTOCOL[:3]:
                value = protocol_value(families, m.vllm, m)
                assert value == protocol_value(families, m.ours, m), m.name  # one scrape, one value
                seen[m.vllm].append(value)
            time.sleep(0.01)
    assert [f.result() for f in futures] == [200] * n
    waiting, running = seen["vllm:num_requests_waiting"], seen["vllm:num_requests_running"]
    kv = seen["vllm:kv_cache_usage_perc"]
    assert max(waiting) > 0, "no scrape saw a queued request"
    assert 0 < max(running) <= 8, running
    assert all(0.0 <= value <= 1.0 for value in kv) and max(kv) > 0, kv

    deadline, idle = time.monotonic() + 10, None
    while idle is None or (any(idle) and time.monotonic() < deadline):
        _, families = scrape(observed_server)  # the core's last stats reach the API with its last output
        idle = [protocol_value(families, m.vllm, m) for m in PROTOCOL[:3]]
        time.sleep(0.05)
    assert idle == [0, 0, 0]


# ---- deploy/ray/rayservice.yaml ------------------------------------------------------------------


def manifest() -> dict[str, Any]:
    return yaml.safe_load(RAYSERVICE.read_text())


def serve_config() -> dict[str, Any]:
    return yaml.safe_load(manifest()["spec"]["serveConfigV2"])  # KubeRay takes it as a YAML string


def containers(group: dict[str, Any]) -> list[dict[str, Any]]:
    return group["template"]["spec"]["containers"]


def gpus(container: dict[str, Any]) -> int:
    return int(container["resources"].get("limits", {}).get("nvidia.com/gpu", 0))


def test_rayservice_manifest_structure() -> None:
    doc = manifest()
    assert doc["apiVersion"] == "ray.io/v1" and doc["kind"] == "RayService" and doc["metadata"]["name"]
    cluster = doc["spec"]["rayClusterConfig"]
    assert re.fullmatch(r"\d+\.\d+\.\d+", cluster["rayVersion"])
    head, workers = cluster["headGroupSpec"], cluster["workerGroupSpecs"]
    assert head["rayStartParams"]["num-cpus"] == "0"  # no replica lands on the head
    (head_container,) = containers(head)
    ports = {p["name"]: p["containerPort"] for p in head_container["ports"]}
    assert ports["serve"] == 8000  # KubeRay's <name>-serve-svc targets the port named "serve"
    images = {c["image"] for group in (head, *workers) for c in containers(group)}
    assert len(images) == 1, "head and workers must run the same image (the same Ray and vlm-engine)"
    for group in (head, *workers):
        for container in containers(group):
            assert container["resources"]["requests"] and container["resources"]["limits"], container["name"]

    config = serve_config()
    assert config["http_options"]["port"] == 8000
    (app,) = config["applications"]
    assert app["import_path"] == APP_BUILDER and app["route_prefix"] == "/"
    (replica,) = [d for d in app["deployments"] if d["name"] == "ServerReplica"]
    per_replica = replica["ray_actor_options"]["num_gpus"]
    (gpu_group,) = workers
    per_pod = gpus(containers(gpu_group)[0])
    assert per_replica == 1 and per_pod >= per_replica
    # The worker group can hold the replicas: the initial ones at start, the autoscaling maximum at most.
    args = app["args"]
    assert gpu_group["replicas"] * per_pod >= args["ray_replicas"] * per_replica
    assert gpu_group["maxReplicas"] * per_pod >= args["ray_max_replicas"] * per_replica
    assert gpu_group["minReplicas"] <= gpu_group["replicas"] <= gpu_group["maxReplicas"]
    assert cluster["enableInTreeAutoscaling"] is True  # Serve autoscaling needs pods to grow into


def test_rayservice_serve_config_passes_ray_serves_schema() -> None:
    from ray.serve.schema import ServeDeploySchema

    schema = ServeDeploySchema.model_validate(serve_config())
    (app,) = schema.applications
    assert app.import_path == APP_BUILDER


def test_rayservice_import_path_builds_the_application() -> None:
    """The builder that KubeRay's Serve imports exists, and builds the application from the
    manifest's args, with the deployments that its `deployments` entries override."""
    from ray import serve

    module, _, attr = APP_BUILDER.partition(":")
    builder = getattr(importlib.import_module(module), attr)
    assert callable(builder)
    (app_config,) = serve_config()["applications"]
    app = builder(app_config["args"])
    assert isinstance(app, serve.Application)
    assert {d["name"] for d in app_config["deployments"]} <= deployment_names(app)


def deployment_names(app: Any) -> set[str]:
    """The deployments an application binds, its own and those passed to it. Ray has no public
    walk of a built application; these attributes are its bound-deployment graph."""
    bound = app._bound_deployment
    names = {bound.name}
    for arg in (*bound.init_args, *bound.init_kwargs.values()):
        if hasattr(arg, "_bound_deployment"):
            names |= deployment_names(arg)
    return names
