"""Our client against guidellm on the same server and the same requests (ABBA, or both at once with
--simultaneous), metric by metric with guidellm's definitions, and our server's step counters per run. Install
guidellm as benchmarks/README.md's set-up says; what it found: its section "guidellm agreement"."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# Sibling modules and the repository root (testkit) when run by path.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import client as C
import models
import peers
import serve_bench as SB
import stats as S
import workloads as W

BENCH = Path(__file__).resolve().parent
GUIDELLM = BENCH / ".guidellm-venv" / "bin" / "guidellm"
MAX_DURATION_S = 300.0  # per run, and each request's timeout
COMPARED = ("ttft_mean_ms", "ttft_p50_ms", "itl_mean_ms", "itl_p50_ms", "requests_per_s", "output_tokens_per_s",
            "prompt_tokens_mean", "output_tokens_mean")  # fmt: skip
NORMALIZED = ("itl_mean_per_step", "output_tokens_per_step")


def build_requests(model: str, model_dir: str, args: argparse.Namespace, first_index: int) -> list[W.BenchRequest]:
    # "agent" without its shared prefix: one plain user message of ~P tokens (the instruction head counts).
    spec = W.workload_spec("agent", shared_prefix_tokens=0, user_tokens=args.prompt_tokens, output_tokens=args.output_tokens)
    factory = W.RequestFactory(W.text_only(spec), model, "vlm-engine", 0, SB.load_tokenizer(model_dir))
    return [factory.build(first_index + k) for k in range(args.num_requests)]


def write_guidellm_data(requests: list[W.BenchRequest], path: Path) -> None:
    """guidellm's column names: `prompt` becomes the user message, `output_tokens_count` its
    max_completion_tokens (with ignore_eos)."""
    with path.open("w") as f:
        for r in requests:
            (message,) = r.payload["messages"]
            f.write(json.dumps({"prompt": message["content"], "output_tokens_count": r.output_tokens}) + "\n")


def counter_delta(before: dict[str, float], after: dict[str, float]) -> dict[str, float]:
    """Steps and forward ms per step while one client ran (NaN for servers without our counters)."""
    d = {k: after.get(f"vlm_engine:{k}", math.nan) - before.get(f"vlm_engine:{k}", math.nan)
         for k in ("engine_steps_total", "step_forward_seconds_sum")}  # fmt: skip
    steps = d["engine_steps_total"]
    return {"server_steps": steps, "server_forward_ms_per_step": 1000 * d["step_forward_seconds_sum"] / steps if steps else math.nan}


def normalized(run: dict[str, float]) -> dict[str, float]:
    """Latency and throughput in units of the server's own step time in that run: what is left of a client
    difference once the server's speed during each client's run is taken out."""
    step_ms = run["server_forward_ms_per_step"]
    return {"itl_mean_per_step": run["itl_mean_ms"] / step_ms, "output_tokens_per_step": run["output_tokens_per_s"] * step_ms / 1000}


def with_counters(result: dict[str, float], counters: dict[str, float], client_cpu_s: float) -> dict[str, float]:
    result |= counters | {"client_cpu_s": client_cpu_s}
    return result | normalized(result)


def run_with_counters(base_url: str, run: Callable[[], dict[str, float]]) -> dict[str, float]:
    """One client run plus our server's step counters around it and the client's CPU seconds (this process for
    our client, its finished child for guidellm)."""
    before, cpu_before = C.scrape_metrics(base_url), _client_cpu_s()
    result = run()
    return with_counters(result, counter_delta(before, C.scrape_metrics(base_url)), _client_cpu_s() - cpu_before)


def run_harness(base_url: str, requests: list[W.BenchRequest], args: argparse.Namespace) -> dict[str, float]:
    by_index = {r.index: r for r in requests}
    point = C.LoadPoint("closed", args.concurrency, len(requests), MAX_DURATION_S, MAX_DURATION_S)
    url = base_url.rstrip("/") + "/v1/chat/completions"
    records, duration = asyncio.run(C.run_point(url, by_index.__getitem__, point, 0, requests[0].index))
    s = S.summarize(records, duration)
    ttft_ms = [1000 * r.ttft for r in records if r.ok and r.ttft is not None]
    itl = [(1000 * r.decode_itl, r.output_tokens - 1) for r in records if r.ok and r.decode_itl is not None]
    itl_ms, weights = [v for v, _ in itl], [w for _, w in itl]
    return {
        "ttft_mean_ms": 1000 * s.ttft.mean, "ttft_p50_ms": S.lower_quantile(ttft_ms, [1.0] * len(ttft_ms), 0.5),
        "itl_mean_ms": float(np.average(itl_ms, weights=weights)) if itl else math.nan,
        "itl_p50_ms": S.lower_quantile(itl_ms, weights, 0.5), "tpot_mean_ms": 1000 * s.tpot.mean,
        "tpot_p50_ms": 1000 * s.tpot.p50, "chunk_itl_mean_ms": 1000 * s.itl.mean, "chunk_itl_p50_ms": 1000 * s.itl.p50,
        "requests_per_s": s.request_throughput, "output_tokens_per_s": s.output_throughput,
        "prompt_tokens_mean": s.mean_prompt_tokens, "output_tokens_mean": s.mean_output_tokens, "errors": s.num_errors,
    }  # fmt: skip


def start_guidellm(base_url: str, model: str, model_dir: str, data: Path, args: argparse.Namespace,
                   out_json: Path) -> subprocess.Popen[bytes]:  # fmt: skip
    cmd = [str(GUIDELLM), "run", "--backend", f"kind=openai_http,target={base_url},model={model}",
           "--tokenizer", f"kind=huggingface_auto,model={model_dir}", "--profile", f"kind=concurrent,streams={args.concurrency}",
           "--constraint", f"kind=max_requests,count={args.num_requests}",
           "--constraint", f"kind=max_duration,seconds={MAX_DURATION_S}", "--data", f"kind=json_file,path={data}",
           "--seed", "kind=static,value=0", "--output", f"kind=json,path={out_json}",
           "--disable-console-interactive"]  # fmt: skip
    print("$ " + " ".join(cmd), flush=True)
    # One worker process runs all streams on one asyncio loop: one per stream (guidellm's default) competes with
    # the server on 2 cores (measured: ITL +30%, throughput -35% against our one-loop client).
    env = {"GUIDELLM__MAX_WORKER_PROCESSES": "1", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "PATH": "/usr/bin:/bin"}  # fmt: skip
    out_json.unlink(missing_ok=True)
    log = out_json.with_suffix(".log").open("wb")  # a file, not a pipe: nobody reads it while it runs
    return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)


def finish_guidellm(proc: subprocess.Popen[bytes], out_json: Path, timeout_s: float) -> dict[str, float]:
    try:
        code = proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    if code != 0 or not out_json.exists():
        log = out_json.with_suffix(".log").read_text(errors="replace")
        raise RuntimeError(f"guidellm failed ({code}):\n{log[-4000:]}")
    return parse_guidellm(json.loads(out_json.read_text()))


def run_guidellm(base_url: str, model: str, model_dir: str, data: Path, args: argparse.Namespace,
                 out_json: Path) -> dict[str, float]:  # fmt: skip
    proc = start_guidellm(base_url, model, model_dir, data, args, out_json)
    return finish_guidellm(proc, out_json, MAX_DURATION_S + 600)


def run_simultaneous(base_url: str, model: str, model_dir: str, requests: list[W.BenchRequest], data: Path,
                     args: argparse.Namespace, out_json: Path) -> tuple[dict[str, float], dict[str, float]]:  # fmt: skip
    """Both clients at once, each with the same request list at --concurrency: they measure the very same server
    steps. Ours starts when guidellm's first request is in (its own start-up takes seconds)."""
    before = C.scrape_metrics(base_url)
    proc = start_guidellm(base_url, model, model_dir, data, args, out_json)
    deadline = time.monotonic() + 300
    while C.scrape_metrics(base_url).get("vlm_engine:num_requests_inflight", 0) < 1:
        if proc.poll() is not None or time.monotonic() > deadline:
            finish_guidellm(proc, out_json, 10)  # raises with its log
            raise RuntimeError("guidellm ended before sending a request")
        time.sleep(0.01)
    harness = run_harness(base_url, requests, args)
    reference = finish_guidellm(proc, out_json, MAX_DURATION_S + 600)
    shared = counter_delta(before, C.scrape_metrics(base_url))
    return with_counters(harness, shared, math.nan), with_counters(reference, shared, math.nan)  # CPU: not separable


def parse_guidellm(report: dict[str, Any]) -> dict[str, float]:
    """guidellm's report: each StatusDistributionSummary's `successful` requests."""
    bench = report["benchmarks"][0]
    m = bench["metrics"]
    totals = m.get("request_totals") or bench.get("request_totals") or {}

    def dist(name: str, stat: str) -> float:
        d = (m.get(name) or {}).get("successful") or {}
        return float(d[stat]) if stat in d else float((d.get("percentiles") or {}).get(stat, math.nan))

    return {
        "ttft_mean_ms": dist("time_to_first_token_ms", "mean"), "ttft_p50_ms": dist("time_to_first_token_ms", "median"),
        "itl_mean_ms": dist("inter_token_latency_ms", "mean"), "itl_p50_ms": dist("inter_token_latency_ms", "median"),
        "requests_per_s": dist("requests_per_second", "mean"), "output_tokens_per_s": dist("output_tokens_per_second", "mean"),
        "prompt_tokens_mean": dist("prompt_token_count", "mean"), "output_tokens_mean": dist("output_token_count", "mean"),
        "errors": float(totals.get("errored", math.nan)) if isinstance(totals, dict) else math.nan,
    }  # fmt: skip


def split_cpus() -> tuple[set[int], set[int]]:
    """The server's half of the CPUs and the clients' half. Shared, guidellm's client (~12 CPU-s a run then,
    ours ~0.5 s) took CPU from the server, whose same steps took 48 ms instead of 34: two server speeds, not two
    clients. What remains split is memory-system contention (README)."""
    cpus = sorted(os.sched_getaffinity(0))
    return (set(cpus), set(cpus)) if len(cpus) < 2 else (set(cpus[: len(cpus) // 2]), set(cpus[len(cpus) // 2 :]))


def _client_cpu_s() -> float:
    """User + system CPU seconds of this process and its finished children (guidellm runs)."""
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def pct_diff(ours: float, ref: float) -> float:
    return 100.0 * (ours - ref) / ref if ref and math.isfinite(ours) and math.isfinite(ref) else math.nan


def pair_diffs(runs: dict[str, list[dict[str, float]]], key: str) -> list[float]:
    """% difference harness vs guidellm within each repetition (both sent the same requests)."""
    return [pct_diff(a[key], b[key]) for a, b in zip(runs["harness"], runs["guidellm"])]


def comparison_table(runs: dict[str, list[dict[str, float]]]) -> list[str]:
    """Medians over repetitions; the difference column is the median of the per-repetition
    differences (each pair sent the same request list, so their throughputs are comparable)."""
    med = {c: {k: S.median(r[k] for r in runs[c]) for k in runs[c][0]} for c in runs}
    ours, ref = med["harness"], med["guidellm"]
    rows = ["| metric | our harness | guidellm | difference (median of pairs) |", "|---|---|---|---|"]
    for key in COMPARED:
        d = S.median(pair_diffs(runs, key))
        flag = "" if not math.isfinite(d) or key.endswith("tokens_mean") else (" ok" if abs(d) <= 10 else " **>10%**")
        rows.append(f"| {key} | {ours[key]:.2f} | {ref[key]:.2f} | {d:+.1f}%{flag} |")
    rows += [f"| (ours: chunk-gap ITL mean / p50, ms) | {ours['chunk_itl_mean_ms']:.2f} / {ours['chunk_itl_p50_ms']:.2f} | | |",
             f"| (ours: TPOT incl. stream tail, mean / p50, ms) | {ours['tpot_mean_ms']:.2f} / {ours['tpot_p50_ms']:.2f} | | |",
             f"| (client CPU-s per run; guidellm's includes its start-up) | {ours['client_cpu_s']:.1f} | {ref['client_cpu_s']:.1f} | |",
             f"| server steps per run | {ours['server_steps']:.0f} | {ref['server_steps']:.0f} | |"]  # fmt: skip
    for key in ("server_forward_ms_per_step", *NORMALIZED):
        d = S.median(pair_diffs(runs, key))
        rows.append(f"| {key} | {ours[key]:.3f} | {ref[key]:.3f} | {d:+.1f}% |")
    return rows


def pair_rows(runs: dict[str, list[dict[str, float]]], simultaneous: bool = False) -> list[str]:
    keys = ("ttft_p50_ms", "itl_p50_ms", "itl_mean_ms", "output_tokens_per_s", "server_forward_ms_per_step",
            "itl_mean_per_step")  # fmt: skip
    rows = ["| rep | first | " + " | ".join(keys) + " |", "|---|---|" + "---|" * len(keys)]
    for rep, (a, b) in enumerate(zip(runs["harness"], runs["guidellm"])):
        first = "(together)" if simultaneous else "guidellm" if _guidellm_first(rep) else "harness"
        rows.append(f"| {rep} | {first} | " + " | ".join(f"{pct_diff(a[k], b[k]):+.1f}%" for k in keys) + " |")
    return rows


def _guidellm_first(rep: int) -> bool:
    """ABBA order (harness first in even repetitions, guidellm first in odd ones), so a slow drift
    of the machine's speed over the check does not favour whichever client always runs first."""
    return rep % 2 == 1


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--num-requests", type=int, default=40)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--output-tokens", type=SB.token_range, default=(32, 96),
                   help="N or MIN:MAX, drawn per request (one fixed N runs in lock-step waves: README)")  # fmt: skip
    p.add_argument("--reps", type=int, default=4, help="repetitions, each a harness run and a guidellm run (ABBA)")
    p.add_argument("--simultaneous", action="store_true",
                   help="both clients at once, each with the request list at --concurrency (twice the load)")  # fmt: skip
    args = p.parse_args(argv)
    if not GUIDELLM.exists():
        raise SystemExit(f"{GUIDELLM} not found; install guidellm as benchmarks/README.md's set-up says")
    model_dir = str(models.model_dir("smollm2"))
    out = BENCH / "results" / f"{time.strftime('%Y%m%d-%H%M%S')}-guidellm"
    out.mkdir(parents=True, exist_ok=True)
    peers.install_signal_handlers()

    def measure(base_url: str) -> dict[str, list[dict[str, float]]]:
        model = C.served_model_id(base_url) or model_dir
        run_harness(base_url, build_requests(model, model_dir, argparse.Namespace(**{**vars(args), "num_requests": args.concurrency}), 100_000), args)  # warm-up  # fmt: skip
        runs: dict[str, list[dict[str, float]]] = {"harness": [], "guidellm": []}
        for rep in range(args.reps):
            # One request list per repetition, sent by both clients (the prefix cache is off: no gain from repeats).
            requests = build_requests(model, model_dir, args, 1000 * rep)
            data, guidellm_json = out / f"requests-{rep}.jsonl", out / f"guidellm-{rep}.json"
            write_guidellm_data(requests, data)
            if args.simultaneous:
                harness, reference = run_simultaneous(base_url, model, model_dir, requests, data, args, guidellm_json)
                runs["harness"].append(harness)
                runs["guidellm"].append(reference)
            else:
                clients = {"harness": functools.partial(run_harness, base_url, requests, args),
                           "guidellm": functools.partial(run_guidellm, base_url, model, model_dir, data, args, guidellm_json)}  # fmt: skip
                for name in ("guidellm", "harness") if _guidellm_first(rep) else ("harness", "guidellm"):
                    runs[name].append(run_with_counters(base_url, clients[name]))
            (out / "runs.json").write_text(json.dumps(runs, indent=1))  # kept if a later rep times out
        return runs

    server_cpus, client_cpus = split_cpus()
    # Children inherit the CPU mask at start: the server gets its half, then this process (our client) and
    # guidellm (started from it) move to the other.
    os.sched_setaffinity(0, server_cpus)
    spec = peers.ServerSpec("ours", model_dir, "auto", ("--no-prefix-cache",))
    with peers.ManagedServer(spec, out / "logs") as server:
        os.sched_setaffinity(0, client_cpus)
        print(f"server on CPUs {sorted(server_cpus)}, clients on CPUs {sorted(client_cpus)}", flush=True)
        runs = measure(server.base_url)
    lo, hi = args.output_tokens
    mode = "both clients at once, each at" if args.simultaneous else "one client after the other, at"
    text = "\n".join([
        f"guidellm check: {Path(model_dir).name}, {mode} closed loop concurrency {args.concurrency}, "
        f"{args.num_requests} requests x {args.reps}, ~{args.prompt_tokens} prompt / {lo}-{hi} output tokens", "",
        *comparison_table(runs), "", "Per repetition (harness vs guidellm, same requests), % difference:", "",
        *pair_rows(runs, args.simultaneous)]) + "\n"  # fmt: skip
    (out / "comparison.md").write_text(text)
    (out / "comparison.json").write_text(json.dumps({"config": vars(args), "runs": runs}, indent=1, default=str))
    print(text)
    print(f"wrote {out}/comparison.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
