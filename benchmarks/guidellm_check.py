"""Cross-check our harness against guidellm (an independent client): same server, same request
shape (P prompt tokens, O output tokens, closed loop at concurrency C, N requests), run one after
the other, and print TTFT / ITL / throughput side by side with the % difference (target: within 10%).

    python3.11 -m venv benchmarks/.guidellm-venv
    benchmarks/.guidellm-venv/bin/pip install "guidellm[vision]==0.8.1" "torch==2.13.0+cpu"
    .venv/bin/python benchmarks/guidellm_check.py                  # starts our server on SmolLM2
    .venv/bin/python benchmarks/guidellm_check.py --base-url http://127.0.0.1:8000 --model-dir DIR

Metric mapping: guidellm's `inter_token_latency_ms` is per request (last token - first token) /
(output - 1), weighted by output tokens; ours is computed the same way from the chunk arrival
times (`RequestRecord.decode_itl`), with our TPOT and chunk-gap ITL printed beside it. guidellm sends `ignore_eos` (so output
lengths are fixed on servers that honour it); ours does too for vlm-engine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import client as C
import roofline as R
import serve_bench as SB
import servers
import stats as S
import workloads as W

BENCH = Path(__file__).resolve().parent
GUIDELLM = BENCH / ".guidellm-venv" / "bin" / "guidellm"


def run_harness(
    base_url: str, model: str, model_dir: str, args: argparse.Namespace, first_index: int
) -> dict[str, float]:
    # "agent" with the shared prefix removed = one plain user message of ~P tokens, like guidellm's
    # synthetic_text; the fixed instruction head counts towards P.
    spec = W.workload_spec(
        "agent",
        shared_prefix_tokens=0,
        user_tokens=args.prompt_tokens,
        output_tokens=(args.output_tokens, args.output_tokens),
    )
    factory = W.RequestFactory(W.text_only(spec), model, "vlm-engine", args.seed, SB.load_tokenizer(model_dir))
    point = C.LoadPoint("closed", args.concurrency, args.num_requests, args.max_duration, args.request_timeout)
    records, duration = asyncio.run(
        C.run_point(base_url.rstrip("/") + "/v1/chat/completions", factory.build, point, args.seed, first_index)
    )
    s = S.summarize(records, duration)
    itl = S.Dist.of([r.decode_itl for r in records if r.ok])
    return {
        "ttft_mean_ms": 1000 * s.ttft.mean,
        "ttft_p50_ms": 1000 * s.ttft.p50,
        "itl_mean_ms": 1000 * itl.mean,
        "itl_p50_ms": 1000 * itl.p50,
        "tpot_mean_ms": 1000 * s.tpot.mean,
        "tpot_p50_ms": 1000 * s.tpot.p50,
        "chunk_itl_mean_ms": 1000 * s.itl.mean,
        "chunk_itl_p50_ms": 1000 * s.itl.p50,
        "requests_per_s": s.request_throughput,
        "output_tokens_per_s": s.output_throughput,
        "prompt_tokens_mean": s.mean_prompt_tokens,
        "output_tokens_mean": s.mean_output_tokens,
        "errors": s.num_errors,
    }


def run_guidellm(
    base_url: str, model: str, model_dir: str, args: argparse.Namespace, out_json: Path
) -> dict[str, float]:
    cmd = [
        str(args.guidellm),
        "run",
        "--backend",
        f"kind=openai_http,target={base_url},model={model}",
        "--tokenizer",
        f"kind=huggingface_auto,model={model_dir}",
        "--profile",
        f"kind=concurrent,streams={args.concurrency}",
        "--constraint",
        f"kind=max_requests,count={args.num_requests}",
        "--constraint",
        f"kind=max_duration,seconds={args.max_duration}",
        "--data",
        f"kind=synthetic_text,prompt_tokens={args.prompt_tokens},output_tokens={args.output_tokens}",
        "--seed",
        f"kind=static,value={args.seed}",
        "--output",
        f"kind=json,path={out_json}",
        "--disable-console-interactive",
    ]
    print("$ " + " ".join(cmd), flush=True)
    env = {
        # guidellm starts one worker process per concurrent stream by default; on 2 cores those
        # processes compete with the server they measure (measured: ITL +30%, throughput -35%
        # against our one-event-loop client). One worker runs all streams on one asyncio loop.
        "GUIDELLM__MAX_WORKER_PROCESSES": str(args.guidellm_workers),
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "TOKENIZERS_PARALLELISM": "false",
        "PATH": "/usr/bin:/bin",
    }
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False, timeout=args.max_duration + 600)
    if proc.returncode != 0 or not out_json.exists():
        raise RuntimeError(f"guidellm failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return parse_guidellm(json.loads(out_json.read_text()))


def _dist(metrics: dict[str, Any], name: str, stat: str) -> float:
    """guidellm StatusDistributionSummary -> the `successful` requests' statistic."""
    d = (metrics.get(name) or {}).get("successful") or {}
    if stat in d:
        return float(d[stat])
    pct = d.get("percentiles") or {}
    return float(pct.get(stat, math.nan))


def parse_guidellm(report: dict[str, Any]) -> dict[str, float]:
    bench = report["benchmarks"][0]
    m = bench["metrics"]
    totals = m.get("request_totals") or bench.get("request_totals") or {}
    return {
        "ttft_mean_ms": _dist(m, "time_to_first_token_ms", "mean"),
        "ttft_p50_ms": _dist(m, "time_to_first_token_ms", "median"),
        "itl_mean_ms": _dist(m, "inter_token_latency_ms", "mean"),
        "itl_p50_ms": _dist(m, "inter_token_latency_ms", "median"),
        "requests_per_s": _dist(m, "requests_per_second", "mean"),
        "output_tokens_per_s": _dist(m, "output_tokens_per_second", "mean"),
        "prompt_tokens_mean": _dist(m, "prompt_token_count", "mean"),
        "output_tokens_mean": _dist(m, "output_token_count", "mean"),
        "errors": float(totals.get("errored", math.nan)) if isinstance(totals, dict) else math.nan,
    }


def split_cpus(shared: bool) -> tuple[set[int], set[int]]:
    """Why split: on 2 cores guidellm's client used ~12 CPU-s per 24-request run (ours ~0.5 s) and
    the server's own counters showed the same 390 steps taking 48 ms instead of 34 ms. Sharing
    cores then compares two different server speeds, not two clients."""
    cpus = sorted(os.sched_getaffinity(0))
    if shared or len(cpus) < 2:
        return set(cpus), set(cpus)
    half = len(cpus) // 2
    return set(cpus[:half]), set(cpus[half:])


def pct_diff(ours: float, ref: float) -> float:
    return 100.0 * (ours - ref) / ref if ref and math.isfinite(ours) and math.isfinite(ref) else math.nan


COMPARED = (
    "ttft_mean_ms",
    "ttft_p50_ms",
    "itl_mean_ms",
    "itl_p50_ms",
    "requests_per_s",
    "output_tokens_per_s",
    "prompt_tokens_mean",
    "output_tokens_mean",
)


def comparison_table(ours: dict[str, float], ref: dict[str, float]) -> list[str]:
    rows = ["| metric | our harness | guidellm | difference |", "|---|---|---|---|"]
    for key in COMPARED:
        d = pct_diff(ours[key], ref[key])
        flag = "" if not math.isfinite(d) or key.endswith("tokens_mean") else (" ok" if abs(d) <= 10 else " **>10%**")
        rows.append(f"| {key} | {ours[key]:.2f} | {ref[key]:.2f} | {d:+.1f}%{flag} |")
    rows.append(
        f"| (ours: chunk-gap ITL mean / p50, ms) | {ours['chunk_itl_mean_ms']:.2f} / {ours['chunk_itl_p50_ms']:.2f} | | |"
    )
    rows.append(
        f"| (ours: TPOT incl. stream tail, mean / p50, ms) | {ours['tpot_mean_ms']:.2f} / {ours['tpot_p50_ms']:.2f} | | |"
    )
    return rows


def pair_rows(runs: dict[str, list[dict[str, float]]]) -> list[str]:
    keys = ("ttft_p50_ms", "itl_p50_ms", "itl_mean_ms", "requests_per_s", "output_tokens_per_s")
    rows = ["| rep | " + " | ".join(keys) + " |", "|---|" + "---|" * len(keys)]
    for rep, (a, b) in enumerate(zip(runs["harness"], runs["guidellm"])):
        rows.append(f"| {rep} | " + " | ".join(f"{pct_diff(a[k], b[k]):+.1f}%" for k in keys) + " |")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="use this running server instead of starting ours")
    p.add_argument("--model-dir", default="smollm2", help="served checkpoint (alias smollm2 / qwen2-vl-bench or a dir)")
    p.add_argument("--model", default=None, help="request `model` field (default: /v1/models, else the dir)")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--reps", type=int, default=3, help="alternating repetitions (harness, guidellm, ...)")
    p.add_argument("--max-duration", type=float, default=300.0)
    p.add_argument("--request-timeout", type=float, default=300.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--guidellm", type=Path, default=GUIDELLM)
    p.add_argument("--guidellm-workers", type=int, default=1, help="guidellm worker processes")
    p.add_argument(
        "--shared-cores",
        action="store_true",
        help="let the clients share cores with the server (default: the server we start gets the"
        " first half of the CPUs, both clients the rest)",
    )
    p.add_argument(
        "--keep-prefix-cache",
        action="store_true",
        help="leave our server's prefix cache on (off by default: guidellm repeats its prompts in every"
        " repetition while ours sends fresh ones, so cache hits would differ between the clients)",
    )
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not args.guidellm.exists():
        raise SystemExit(f"{args.guidellm} not found; install guidellm as this script's docstring says")
    model_dir = R.resolve_model_dir(args.model_dir)
    out = args.out or BENCH / "results" / f"{time.strftime('%Y%m%d-%H%M%S')}-guidellm"
    out.mkdir(parents=True, exist_ok=True)
    servers.install_signal_handlers()

    def measure(base_url: str) -> dict[str, Any]:
        model = args.model or C.served_model_id(base_url) or model_dir
        run_harness(
            base_url, model, model_dir, argparse.Namespace(**{**vars(args), "num_requests": args.concurrency}), 10_000
        )
        runs: dict[str, list[dict[str, float]]] = {"harness": [], "guidellm": []}
        for rep in range(args.reps):
            runs["harness"].append(run_harness(base_url, model, model_dir, args, 1000 * rep))
            runs["guidellm"].append(run_guidellm(base_url, model, model_dir, args, out / f"guidellm-{rep}.json"))
            (out / "runs.json").write_text(json.dumps(runs, indent=1))  # kept if a later rep times out
        return runs

    if args.base_url:
        runs = measure(args.base_url)
    else:
        extra = () if args.keep_prefix_cache else ("--no-prefix-cache",)
        spec = servers.ServerSpec("ours", model_dir, args.dtype, extra)
        server_cpus, client_cpus = split_cpus(args.shared_cores)
        # Children inherit the CPU mask at start: the server gets its half, then this process
        # (our client) and guidellm (started from it) move to the other half.
        os.sched_setaffinity(0, server_cpus)
        with servers.ManagedServer(spec, out / "logs") as server:
            os.sched_setaffinity(0, client_cpus)
            print(f"server on CPUs {sorted(server_cpus)}, clients on CPUs {sorted(client_cpus)}", flush=True)
            runs = measure(server.base_url)
    # Medians over repetitions, and each repetition's pair (harness, then guidellm right after it)
    # on its own: on a shared machine the load drifts between pairs more than within one.
    ours = {k: statistics.median(r[k] for r in runs["harness"]) for k in runs["harness"][0]}
    ref = {k: statistics.median(r[k] for r in runs["guidellm"]) for k in runs["guidellm"][0]}
    rows = comparison_table(ours, ref) + [
        "",
        "Per repetition (harness vs guidellm run right after it), % difference:",
        "",
    ]
    rows += pair_rows(runs)
    header = (
        f"guidellm check: {Path(model_dir).name}, closed loop concurrency {args.concurrency}, "
        f"{args.num_requests} requests x {args.reps}, ~{args.prompt_tokens} prompt / {args.output_tokens} output tokens"
    )
    text = "\n".join([header, "", *rows]) + "\n"
    (out / "comparison.md").write_text(text)
    (out / "comparison.json").write_text(
        json.dumps(
            {
                "config": {**vars(args), "guidellm": str(args.guidellm), "out": str(out)},
                "runs": runs,
                "harness": ours,
                "guidellm": ref,
            },
            indent=1,
            default=str,
        )
    )
    print(text)
    print(f"wrote {out}/comparison.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
