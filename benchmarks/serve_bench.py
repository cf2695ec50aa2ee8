"""Drive any OpenAI-compatible chat endpoint with the workloads (workloads.py), closed loop at fixed
concurrencies and open loop (Poisson) at fixed rates, and write JSON (config, per-request records, summaries)
plus PNG plots. `vlm-engine bench ARGS` runs this script.

    # a server already running on :8000 (ours: `vlm-engine serve --model DIR --port 8000`)
    .venv/bin/python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000 --model-dir DIR \\
        --workload data --concurrency 1,4,16 --rate 0.5,1 --num-requests 32
    # or let it start one (ours | transformers | vllm | sglang) on --model-dir and stop it afterwards
    .venv/bin/python benchmarks/serve_bench.py --start ours --model-dir DIR --workload data --concurrency 16

Payloads are deterministic, so two servers see byte-identical requests. `--flavor` (auto-detected by default)
decides which non-standard fields pin output lengths: `ignore_eos` for vlm-engine/vLLM/SGLang, a
`generation_config` with min_new_tokens for `transformers serve` (which answers 422 to unknown fields); the JSON
records what was sent.
"""

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
WARMUP_INDEX = 900_000  # warm-up requests use their own indices: no image repeats a measured one
SPEC_FIELDS = ("shared_prefix_tokens", "user_tokens", "output_tokens", "image_size", "shared_image_prob", "video_frames")


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
    api_key: str | None = None
    overrides: dict[str, Any] = field(default_factory=dict)  # WorkloadSpec fields
    # Index of the first measured request. A caller that runs one point per call passes the
    # requests already sent, so a later point's prompts and images are fresh, not cache hits.
    first_index: int = 0

    @property
    def chat_url(self) -> str:
        return self.base_url.rstrip("/") + "/v1/chat/completions"

    @property
    def headers(self) -> dict[str, str] | None:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else None


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
        record = asyncio.run(C.probe(cfg.chat_url, W.BenchRequest(-1, payload, 1, "none"), 600.0, cfg.headers))
        if record.ok:
            return flavor
        if record.status not in (400, 422):
            raise RuntimeError(f"the server failed a 1-token probe request: {record.error}")
    raise RuntimeError("the server rejected even a plain chat request")


def point_roofline(cfg: BenchConfig, point: C.LoadPoint, summary: S.Summary, before: dict[str, float] | None,
                   after: dict[str, float] | None) -> dict[str, str]:  # fmt: skip
    """Roofline lines: from the server's step counters when it publishes them (ours), and from the client's view
    (TPOT p50 as the decode step at batch ~= concurrency) for any server."""
    dtype = cfg.dtype or served_dtype(cfg.model_dir, ours="vlm_engine:engine_steps_total" in (after or {}))
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
                 log: Any = print) -> tuple[list[dict[str, Any]], str | None]:  # fmt: skip
    """All load points of one workload; returns (points, skip reason)."""
    spec = W.workload_spec(name, **cfg.overrides)
    text_only = cfg.text_only if cfg.text_only is not None else bool(cfg.model_dir) and not models.model_of(cfg.model_dir).vision
    factory = W.RequestFactory(W.text_only(spec) if text_only else spec, model, flavor, cfg.seed, tokenizer)
    probe = lambda i: asyncio.run(C.probe(cfg.chat_url, factory.build(i), cfg.request_timeout_s, cfg.headers))  # noqa: E731
    if factory.spec.video_frames > 0 and not (record := probe(WARMUP_INDEX - 1)).ok:
        return [], f"video unsupported by this server: {record.error}"
    for k in range(cfg.warmup):
        if not (record := probe(WARMUP_INDEX + k)).ok:
            log(f"  warm-up request failed: {record.error}")
    points, first_index = [], cfg.first_index
    loads = [("closed", c) for c in cfg.concurrency] + [("open", r) for r in cfg.rates]
    for mode, value in loads:
        point = C.LoadPoint(mode, value, cfg.num_requests, cfg.max_duration_s, cfg.request_timeout_s)
        before = C.scrape_metrics(cfg.base_url)
        run = C.run_point(cfg.chat_url, factory.build, point, cfg.seed, first_index, cfg.headers)
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
    return points, None


def run_bench(cfg: BenchConfig, log: Any = print) -> dict[str, Any]:
    started = time.time()
    model = cfg.model or C.served_model_id(cfg.base_url, cfg.headers)
    flavor = detect_flavor(cfg, model) if cfg.flavor == "auto" else cfg.flavor
    log(f"{cfg.server_label}: {cfg.base_url} model={model!r} flavor={flavor} fields={W.sent_fields(flavor)}")
    tokenizer, machine = load_tokenizer(cfg.model_dir), R.machine_ceilings()
    points: list[dict[str, Any]] = []
    skipped = []
    for name in cfg.workloads:
        pts, reason = run_workload(cfg, name, model, flavor, tokenizer, log)
        points += pts
        if reason:
            log(f"{name}: skipped ({reason})")
            skipped.append({"workload": name, "reason": reason})
    return {"config": {**asdict(cfg), "api_key": bool(cfg.api_key)}, "server": cfg.server_label, "model": model,
            "flavor": flavor, "fields_sent": W.sent_fields(flavor), "machine": asdict(machine), "started": started,
            "finished": time.time(), "points": points, "skipped": skipped}  # fmt: skip


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
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (no /v1)")
    p.add_argument("--workload", default="chatbot,agent,data", help="comma list of: " + ", ".join(W.WORKLOAD_NAMES))
    p.add_argument("--concurrency", type=numbers(int), default=[1, 4, 16], help="closed-loop points, e.g. 1,4,16")
    p.add_argument("--rate", type=numbers(float), default=[], help="open-loop Poisson rates in req/s, e.g. 0.5,1,2")
    p.add_argument("--num-requests", type=int, default=32, help="requests per load point")
    p.add_argument("--max-duration", type=float, default=300.0, help="per point: no new requests after this many s")
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--warmup", type=int, default=2, help="unmeasured requests before each workload")
    p.add_argument("--model", default=None, help="the request's `model` field (default: first id of /v1/models)")
    p.add_argument("--model-dir", default=None, help="served checkpoint (or a models.MODELS alias): tokenizer, roofline")
    p.add_argument("--flavor", default="auto", choices=("auto",) + W.FLAVORS, help="which length-pinning fields to send")
    p.add_argument("--text-only", action="store_true", default=None, help="no media (default: from --model-dir's config)")
    p.add_argument("--dtype", default=None, help="served dtype, for the roofline line (default: the checkpoint's)")
    p.add_argument("--api-key", default=None)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="server", help="name of this server in results and plots")
    p.add_argument("--out", type=Path, default=None, help="results dir (default benchmarks/results/<time>-serve)")
    p.add_argument("--start", default=None, choices=("ours", "transformers", "vllm", "sglang"),
                   help="start this server on --model-dir (free port, stopped afterwards) instead of --base-url")  # fmt: skip
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for --start's server (repeatable)")
    g = p.add_argument_group("workload shape (overrides the chosen workloads' defaults)")
    g.add_argument("--shared-prefix-tokens", type=int, default=None, help="chatbot default 2000, agent 3000")
    g.add_argument("--user-tokens", type=int, default=None)
    g.add_argument("--output-tokens", type=token_range, default=None, help="N or MIN:MAX (chatbot 32:200, data 32)")
    g.add_argument("--image-size", type=lambda t: tuple(int(x) for x in t.lower().split("x")), default=None, help="WxH")
    g.add_argument("--shared-image-prob", type=float, default=None, help="chatbot: share of requests with the common image")
    g.add_argument("--video-frames", type=int, default=None, help="data: an N-frame clip instead of an image")
    args = p.parse_args(argv)
    workloads = [w for w in args.workload.split(",") if w]
    for name in workloads:
        if name not in W.DEFAULT_SPECS:  # fail fast on a typo
            raise SystemExit(f"serve_bench: unknown workload {name!r}; choose from {', '.join(W.WORKLOAD_NAMES)}")
    model_dir = str(models.model_dir(args.model_dir)) if args.model_dir else None
    cfg = BenchConfig(args.base_url, workloads, args.concurrency, args.rate, args.num_requests, args.max_duration,
                      args.request_timeout, args.warmup, args.model, model_dir, args.flavor, args.text_only, args.seed,
                      args.label, args.dtype, args.api_key,
                      {k: getattr(args, k) for k in SPEC_FIELDS if getattr(args, k) is not None})  # fmt: skip
    out = args.out or RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}-serve"
    if args.start:
        import peers

        if model_dir is None:
            raise SystemExit("--start needs --model-dir")
        peers.install_signal_handlers()
        spec = peers.ServerSpec(args.start, model_dir, args.dtype or "auto", tuple(args.server_arg))
        with peers.ManagedServer(spec, out / "logs") as server:
            print(f"started {spec.name} at {server.base_url} in {server.startup_s:.0f} s (log {server.log_path})")
            cfg.base_url, cfg.model = server.base_url, cfg.model or model_dir
            cfg.flavor = spec.flavor if cfg.flavor == "auto" else cfg.flavor
            cfg.server_label = spec.name if cfg.server_label == "server" else cfg.server_label
            result = run_bench(cfg)
    else:
        result = run_bench(cfg)
    for path in write_results(result, out):
        print(f"wrote {path}")
    print(R.MachineCeilings(**result["machine"]).describe())
    return 1 if any(p["summary"]["num_ok"] == 0 for p in result["points"]) else 0


if __name__ == "__main__":
    sys.exit(main())
