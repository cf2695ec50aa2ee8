"""One server (running, or started with --start) under the workloads, closed loop at fixed concurrencies and open
loop (Poisson) at fixed rates: results.json and PNG plots. `vlm-engine bench ARGS` runs it; side_by_side.py calls
run_bench. Commands: benchmarks/README.md, "Other commands"."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any

# Sibling modules and the repository root (testkit) when run by path.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import roofline as R  # first: with VLM_ENGINE_ISA=avx2 it caps torch's libraries before torch loads
import client as C
import models
import stats as S
import workloads as W

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class BenchConfig:
    base_url: str
    workloads: list[str]
    concurrency: list[int] = field(default_factory=lambda: [1, 4, 16])
    rates: list[float] = field(default_factory=list)
    num_requests: int = 32
    max_duration_s: float = 300.0
    request_timeout_s: float = 600.0
    warmup: int = 2
    model: str | None = None  # request `model` field; None: from /v1/models
    model_dir: str | None = None  # tokenizer + roofline source (the served checkpoint)
    flavor: str = "auto"
    text_only: bool | None = None  # None: from model_dir's config (no vision_config -> text only)
    seed: int = 0
    server_label: str = "server"
    dtype: str | None = None  # served dtype, for the roofline (None: served_dtype's guess)
    overrides: dict[str, Any] = field(default_factory=dict)  # WorkloadSpec fields
    # Index of the first measured request. A caller that runs one point per call passes the
    # requests already sent, so a later point's prompts and images are fresh, not cache hits.
    first_index: int = 0

    @property
    def chat_url(self) -> str:
        return self.base_url.rstrip("/") + "/v1/chat/completions"


def load_tokenizer(model_dir: str | None) -> Any:
    if model_dir is None:
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(model_dir)


def served_dtype(model_dir: str | None, ours: bool) -> str:
    """What the server computes in with its defaults, for the roofline: the checkpoint's dtype, except that our
    `dtype=auto` runs float checkpoints in bf16 where the CPU has bf16 dot products and as fp32 activations on bf16
    weights where it has not (registry.resolve_dtype, cpu_bf16_weights): judged against the bf16 ceiling of an
    AVX2 machine, which has no bf16 arithmetic, its steps would read as thousands of percent."""
    config = json.loads((Path(model_dir) / "config.json").read_text()) if model_dir else {}
    text = config.get("text_config") or {}
    declared = str(config.get("dtype") or config.get("torch_dtype") or text.get("dtype") or "float32")
    if not ours:
        return declared
    import torch

    from vlm_engine.models.registry import cpu_bf16_weights, resolve_dtype

    cpu = torch.device("cpu")
    dtype = resolve_dtype("auto", SimpleNamespace(dtype=declared), cpu, is_gguf=False)
    return R.BF16_WEIGHTS if cpu_bf16_weights("auto", dtype, cpu) else str(dtype).replace("torch.", "")


def detect_flavor(cfg: BenchConfig, model: str | None) -> str:
    """Which length-pinning fields the server accepts, by trying them on a 1-token request."""
    for flavor in ("vlm-engine", "transformers", "openai"):
        payload = W.chat_payload([{"role": "user", "content": "Hi"}], 1, model, flavor)
        record = asyncio.run(C.probe(cfg.chat_url, W.BenchRequest(-1, payload, 1, "none"), 600.0))
        if record.ok:
            return flavor
        if record.status not in (400, 422):
            raise RuntimeError(f"the server failed a 1-token probe request: {record.error}")
    raise RuntimeError("the server rejected even a plain chat request")


def point_roofline(cfg: BenchConfig, point: C.LoadPoint, summary: S.Summary, before: dict[str, float],
                   after: dict[str, float]) -> dict[str, str]:  # fmt: skip
    """Roofline lines: from the server's step counters when it publishes them (ours), and from the client's view
    (TPOT p50 as the decode step at batch ~= concurrency) for any server."""
    dtype = cfg.dtype or served_dtype(cfg.model_dir, ours="vlm_engine:engine_steps_total" in after)
    finite = [x for x in (summary.mean_prompt_tokens, summary.mean_output_tokens / 2) if math.isfinite(x)]
    context, lines = sum(finite), {}
    batch = point.value if point.mode == "closed" else summary.request_throughput * summary.e2e.mean
    # TPOT, not ITL: servers that merge several tokens into one chunk make single gaps ~0.
    if math.isfinite(summary.tpot.p50) and math.isfinite(batch):
        basis = f"client: TPOT p50 as the decode step at batch ~{batch:.1f}"
        lines["client"] = R.roofline_line(cfg.model_dir, batch, context, summary.tpot.p50, dtype, basis)
    if before and after:
        d = {k.removeprefix("vlm_engine:"): after.get(k, 0.0) - before.get(k, 0.0) for k in after}
        steps, fwd = d.get("engine_steps_total", 0.0), d.get("step_forward_seconds_sum", 0.0)
        if steps > 0 and fwd > 0:
            tokens = d.get("generation_tokens_total", 0.0) + d.get("prefill_tokens_total", 0.0)
            host = d.get("step_schedule_seconds_sum", 0.0) + d.get("step_update_seconds_sum", 0.0)
            basis = f"server counters: {steps:.0f} steps, all tokens incl. prefill"
            lines["server"] = R.roofline_line(cfg.model_dir, tokens / steps, context, fwd / steps, dtype, basis)
            lines["host_share"] = f"host overhead: {100 * host / (host + fwd):.1f}% of step time ({1000 * host / steps:.2f} ms/step)"
    return lines


def run_workload(cfg: BenchConfig, name: str, model: str | None, flavor: str, tokenizer: Any,
                 log: Any = print) -> list[dict[str, Any]]:  # fmt: skip
    """All load points of one workload."""
    spec = W.workload_spec(name, **cfg.overrides)
    text_only = cfg.text_only if cfg.text_only is not None else bool(cfg.model_dir) and not models.model_of(cfg.model_dir).vision
    factory = W.RequestFactory(W.text_only(spec) if text_only else spec, model, flavor, cfg.seed, tokenizer)
    probe = lambda i: asyncio.run(C.probe(cfg.chat_url, factory.build(i), cfg.request_timeout_s))  # noqa: E731
    for k in range(cfg.warmup):
        if not (record := probe(W.WARMUP_INDEX + k)).ok:
            log(f"  warm-up request failed: {record.error}")
    points, first_index = [], cfg.first_index
    loads = [("closed", c) for c in cfg.concurrency] + [("open", r) for r in cfg.rates]
    for mode, value in loads:
        point = C.LoadPoint(mode, value, cfg.num_requests, cfg.max_duration_s, cfg.request_timeout_s)
        before = C.scrape_metrics(cfg.base_url)
        run = C.run_point(cfg.chat_url, factory.build, point, cfg.seed, first_index)
        records, duration = asyncio.run(run)
        summary = S.summarize(records, duration)
        roof = point_roofline(cfg, point, summary, before, C.scrape_metrics(cfg.base_url))
        log(S.one_line(f"{name} {point.label}", summary))
        for line in roof.values():
            log(f"{'':>14}{line}")
        points.append({"server": cfg.server_label, "workload": name, "mode": mode, "value": value, "label": point.label,
                       "first_index": first_index, "summary": summary.to_json(), "roofline": roof,
                       "spec": asdict(factory.spec), "records": [r.to_json() for r in records]})  # fmt: skip
        first_index += point.num_requests  # fresh requests (fresh images) for every point
    return points


def run_bench(cfg: BenchConfig, log: Any = print) -> dict[str, Any]:
    started = time.time()
    model = cfg.model or C.served_model_id(cfg.base_url)
    flavor = detect_flavor(cfg, model) if cfg.flavor == "auto" else cfg.flavor
    log(f"{cfg.server_label}: {cfg.base_url} model={model!r} flavor={flavor} fields={W.sent_fields(flavor)}")
    tokenizer, machine = load_tokenizer(cfg.model_dir), R.machine_ceilings()
    points = [p for name in cfg.workloads for p in run_workload(cfg, name, model, flavor, tokenizer, log)]
    return {"config": asdict(cfg), "server": cfg.server_label, "model": model,
            "flavor": flavor, "fields_sent": W.sent_fields(flavor), "machine": asdict(machine), "started": started,
            "finished": time.time(), "points": points}  # fmt: skip


def write_results(result: dict[str, Any], out_dir: Path) -> list[Path]:
    import plots

    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "results.json"
    as_json = lambda x: None if isinstance(x, float) and not math.isfinite(x) else str(x)  # noqa: E731
    path.write_text(json.dumps(result, indent=1, default=as_json))
    return [path] + plots.plot_all(result["points"], out_dir)


# ---- CLI ------------------------------------------------------------------------------------------------


def numbers(kind: type) -> Any:
    return lambda text: [kind(x) for x in text.split(",") if x.strip()]


def token_range(text: str) -> tuple[int, int]:
    """N or MIN:MAX."""
    lo, _, hi = text.partition(":")
    return int(lo), int(hi or lo)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (no /v1)")
    p.add_argument("--workload", default="chatbot,agent,data", help="comma list of: " + ", ".join(W.WORKLOAD_NAMES))
    p.add_argument("--concurrency", type=numbers(int), default=[1, 4, 16], help="closed-loop points, e.g. 1,4,16")
    p.add_argument("--rate", type=numbers(float), default=[], help="open-loop Poisson rates in req/s, e.g. 0.5,1,2")
    p.add_argument("--num-requests", type=int, default=32, help="requests per load point")
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests before each workload")
    p.add_argument("--model-dir", default=None, help="served checkpoint (or a models.MODELS alias): tokenizer, roofline")
    p.add_argument("--out", type=Path, default=None, help="results dir (default benchmarks/results/<time>-serve)")
    p.add_argument("--start", default=None, choices=("ours", "transformers", "vllm"), help="start this on --model-dir")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for --start's server (repeatable)")
    p.add_argument("--shared-prefix-tokens", type=int, default=None, help="chatbot default 2000, agent 3000")
    p.add_argument("--output-tokens", type=token_range, default=None, help="N or MIN:MAX (chatbot 32:200, data 32)")
    args = p.parse_args(argv)
    workloads = [w for w in args.workload.split(",") if w]
    for name in workloads:
        if name not in W.DEFAULT_SPECS:  # fail fast on a typo
            raise SystemExit(f"serve_bench: unknown workload {name!r}; choose from {', '.join(W.WORKLOAD_NAMES)}")
    model_dir = str(models.model_dir(args.model_dir)) if args.model_dir else None
    shape = {"shared_prefix_tokens": args.shared_prefix_tokens, "output_tokens": args.output_tokens}
    cfg = BenchConfig(args.base_url, workloads, args.concurrency, args.rate, args.num_requests, warmup=args.warmup,
                      model_dir=model_dir, overrides={k: v for k, v in shape.items() if v is not None})  # fmt: skip
    out = args.out or RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}-serve"
    if args.start:
        import peers

        if model_dir is None:
            raise SystemExit("--start needs --model-dir")
        peers.install_signal_handlers()
        spec = peers.ServerSpec(args.start, model_dir, extra_args=tuple(args.server_arg))
        with peers.ManagedServer(spec, out / "logs") as server:
            print(f"started {spec.name} at {server.base_url} in {server.startup_s:.0f} s (log {server.log_path})")
            cfg.base_url, cfg.model, cfg.flavor, cfg.server_label = server.base_url, model_dir, spec.flavor, spec.name
            result = run_bench(cfg)
    else:
        result = run_bench(cfg)
    for path in write_results(result, out):
        print(f"wrote {path}")
    print(R.MachineCeilings(**result["machine"]).describe())
    return 1 if any(p["summary"]["num_ok"] == 0 for p in result["points"]) else 0


if __name__ == "__main__":
    sys.exit(main())
