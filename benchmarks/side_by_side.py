"""The side-by-side runner: our server and its peers on the same weights, requests and client, each server started
fresh, one after the other; medians over repetitions, one markdown table per suite (a row of SUITES).
benchmarks/README.md, "The one command", says how to run it and what it writes."""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

# First: with VLM_ENGINE_ISA=avx2 importing roofline caps torch's libraries to AVX2 before torch loads.
import roofline as R
import models
import peers
import serve_bench as SB
import stats as S

RESULTS = Path(__file__).resolve().parent / "results"
MAX_DURATION_S, REQUEST_TIMEOUT_S, STARTUP_TIMEOUT_S = 240.0, 900.0, 900.0  # per point, per request, per server
SETTLE_S = 5.0  # idle after the last request before the steady RSS sample


@dataclass(frozen=True)
class Plan:
    label: str
    workload: str
    model: str  # a models.MODELS alias or a checkpoint directory
    concurrency: tuple[int, ...]
    rates: tuple[float, ...] = ()
    per_slot: int = 0  # requests per point: max(min_requests, per_slot x concurrency)
    min_requests: int = 8
    overrides: dict[str, Any] = field(default_factory=dict)  # workloads.WorkloadSpec fields

    def requests(self, value: float, mode: str) -> int:
        return max(self.min_requests, self.per_slot * int(value)) if mode == "closed" else self.min_requests


@dataclass(frozen=True)
class Column:
    metric: str  # a Summary field, dotted for a distribution ("ttft.p50"); "ok", "errors"
    head: str
    mode: str = "each"  # each | ratio (each, then first / other) | speedup (each, then other / first) | joined | first


@dataclass(frozen=True)
class Suite:
    plans: tuple[Plan, ...]
    sides: tuple[str, ...]
    columns: tuple[Column, ...]
    ratios: tuple[tuple[str, str], ...] = ()  # (a, b): a / b of the first column's metric; b may be "best <peer>"
    kv_tokens: int | None = 65_536  # ours / transformers; None: their defaults
    memory: bool = False  # the RSS table
    decode_roofline: str | None = None  # a model: the in-process batch-64 decode line under the table
    note: str = ""


TTFT = Column("ttft.p50", "TTFT p50 ms", "joined")
LLAMA_TEXT = ("ours", "llama.cpp F32", "llama.cpp Q4_1", "ours int4")
LLAMA_VLM = ("ours", "llama.cpp F32 + mmproj", "ours int8", "llama.cpp Q8_0 + mmproj")
MULTIMODAL_COLUMNS = (
    Column("request_throughput", "req/s"), TTFT, Column("first_chunk.p50", "first chunk p50 ms", "joined"),
    Column("mean_output_tokens", "out tokens (mean)", "joined"), Column("mean_prompt_tokens", "prompt tokens", "joined"),
    Column("ok", "ok / sent", "joined"),
)  # fmt: skip
# First chunk beside TTFT: a random model's first tokens may decode to no text (special or partial-byte tokens),
# so the first text can come seconds after the prompt is done; the first chunk (ours, llama.cpp and vLLM each send
# one as the first token comes out) times the prompt alone.
QUANTIZED_7B_COLUMNS = (
    Column("request_throughput", "req/s"), Column("output_throughput", "out tok/s"), TTFT,
    Column("first_chunk.p50", "first chunk p50 ms", "joined"), Column("tpot.p50", "TPOT p50 ms", "joined"), Column("mean_prompt_tokens", "prompt tokens", "joined"),
    Column("ok", "ok / sent", "joined"),
)  # fmt: skip


def quantized_7b_plans(fmt: str) -> tuple[Plan, ...]:
    """On `qwen2.5-vl-7b-<fmt>`: image chat (fresh 640x480 photos, 64 tokens) at 1 and 8; decode: text chat pinned
    to 128 tokens at 1 and 16."""
    model = f"qwen2.5-vl-7b-{fmt}"
    return (Plan(f"{fmt} imagechat", "imagechat", model, (1, 8), min_requests=2, per_slot=2),
            Plan(f"{fmt} decode", "textchat", model, (1, 16), min_requests=2, per_slot=1,
                 overrides={"output_tokens": (128, 128)}))  # fmt: skip


IMAGE_PLANS = tuple(Plan(w, w, "qwen2.5-vl-3b", (1, 8), min_requests=1, per_slot=1) for w in ("placard", "imagechat"))

SUITES: dict[str, Suite] = {
    # Ours vs `transformers serve --continuous-batching`, both bf16, the three workloads that shape the engine.
    "transformers": Suite(
        (
            Plan("chatbot", "chatbot", "qwen2-vl-bench", (1, 4, 16), (0.25, 1.0), min_requests=32),
            Plan("agent", "agent", "smollm2", (1, 4, 16), (0.05,), min_requests=16),
            Plan("data", "data", "qwen2-vl-bench", (1, 4, 16), (0.5, 2.0), min_requests=48),
        ),
        ("ours bf16", "transformers bf16"),
        (Column("request_throughput", "req/s", "ratio"), Column("output_throughput", "out tok/s", "ratio"),
         Column("ttft.p50", "TTFT p50 ms", "speedup"), Column("tpot.p50", "TPOT p50 ms", "speedup"),
         Column("e2e.p95", "e2e p95 ms"), Column("cached_token_share", "cached", "first"),
         Column("errors", "errors", "joined")),  # fmt: skip
        decode_roofline="qwen2-vl-bench",
    ),
    # SmolLM2 streaming chat, 64 tokens pinned on every side: the peer at its default dtype and at bf16.
    "transformers-smollm2": Suite(
        (Plan("textchat", "textchat", "smollm2", (1, 16, 64), per_slot=2),),
        ("transformers", "ours", "transformers bf16"),
        (Column("output_throughput", "tok/s"), TTFT, Column("itl.p50", "ITL p50 ms", "joined")),
        ratios=(("ours", "transformers"), ("ours", "transformers bf16")),
    ),
    # llama.cpp on the same SmolLM2 weights converted to F32, on the shipped Q4_1 file, and ours on that file.
    "llamacpp-text": Suite(
        (
            Plan("textchat", "textchat", "smollm2", (1, 16, 64), per_slot=3),
            Plan("chatbot+", "chatbot", "smollm2", (1, 4), per_slot=4,
                 overrides={"shared_prefix_tokens": 1800, "output_tokens": (32, 32)}),
        ),  # fmt: skip
        LLAMA_TEXT,
        (Column("output_throughput", "tok/s"), TTFT),
        ratios=(("ours", "llama.cpp F32"), ("ours", "best llama.cpp"), ("ours int4", "llama.cpp Q4_1")),
        decode_roofline="smollm2",
    ),
    # The data processor on the bench Qwen2-VL: llama-server with its F32 vision projector; the int8 pair.
    "llamacpp-vlm": Suite(
        (Plan("vlm-data", "data", "qwen2-vl-bench", (1, 16), per_slot=3),),
        LLAMA_VLM,
        (Column("request_throughput", "req/s"), TTFT, Column("mean_prompt_tokens", "prompt tokens", "joined")),
        ratios=(("ours", "llama.cpp F32 + mmproj"), ("ours int8", "llama.cpp Q8_0 + mmproj")),
    ),
    # Qwen2.5-VL-3B-shaped: placard and imagechat, fresh 640x480 photos; llama.cpp bf16 and Q4_K_M + bf16 mmproj.
    "llamacpp-qwen2.5-vl": Suite(
        IMAGE_PLANS, ("ours", "llama.cpp BF16 + mmproj", "llama.cpp Q4_K_M + mmproj"), MULTIMODAL_COLUMNS,
        kv_tokens=None, memory=True,
    ),  # fmt: skip
    # SmolVLM2-500M-shaped: the same workloads; llama.cpp f32 and bf16 text + f32 mmproj.
    "llamacpp-smolvlm": Suite(
        tuple(replace(p, model="smolvlm2-500m", min_requests=2) for p in IMAGE_PLANS),
        ("ours", "llama.cpp F32 + mmproj", "llama.cpp BF16 + mmproj"), MULTIMODAL_COLUMNS, kv_tokens=None, memory=True,
    ),  # fmt: skip
    # Memory, not speed (issue 49): per side a fresh server, 4 fresh 640x480 photos at once (16 tokens each), RSS at
    # /health, its peak while answering and idle afterwards; every side holds the same 16,384 KV tokens. The
    # SmolVLM2-500M shape by default; `--model qwen2.5-vl-3b`, `--model qwen2.5-vl-7b --sides ours` for the others.
    "memory": Suite(
        (Plan("imagechat", "imagechat", "smolvlm2-500m", (4,), per_slot=1, min_requests=4,
              overrides={"output_tokens": (16, 16)}),),
        ("ours", "ours two-layouts", "llama.cpp BF16 + mmproj", "vllm bf16"),
        (Column("request_throughput", "req/s"), TTFT, Column("ok", "ok / sent", "joined")),
        kv_tokens=16_384, memory=True,
    ),  # fmt: skip
    # Qwen2.5-VL-7B-shaped (issue 49): image chat and the data processor; 32,768 KV tokens a side (llama.cpp's
    # trained-context default would take 6.8 GiB of KV beside 15.4 GiB of weights on a 24 GiB machine).
    "llamacpp-qwen2.5-vl-7b": Suite(
        tuple(Plan(w, w, "qwen2.5-vl-7b", (1, 8), min_requests=2, per_slot=1) for w in ("imagechat", "data")),
        ("ours", "llama.cpp BF16 + mmproj", "llama.cpp Q4_K_M + mmproj"), MULTIMODAL_COLUMNS,
        kv_tokens=32_768, memory=True,
    ),  # fmt: skip
    # Qwen3.5-shaped hybrid, about 2B (issue 50): the data processor and image chat against llama.cpp (BF16 text +
    # BF16 mmproj) and vLLM's CPU build, all bf16; 32,768 KV tokens a side (the hybrid needs KV for 6 of 24 layers).
    "qwen3.5": Suite(
        tuple(Plan(w, w, "qwen3.5-2b", (1, 8), min_requests=2, per_slot=2) for w in ("data", "imagechat")),
        ("ours", "llama.cpp BF16 + mmproj", "vllm bf16"), MULTIMODAL_COLUMNS,
        ratios=(("ours", "llama.cpp BF16 + mmproj"), ("ours", "vllm bf16")), kv_tokens=32_768, memory=True,
    ),  # fmt: skip
    # LightOnOCR-1B-shaped (issue 52): the data processor and image chat against llama.cpp (BF16 text + BF16 mmproj)
    # and vLLM's CPU build, all bf16, on the same files (the release's config.json form); 32,768 KV tokens a side.
    # llama.cpp's images capped at 400 tokens (models.LIGHTONOCR_400_TOKENS says why).
    "lightonocr": Suite(
        tuple(Plan(w, w, "lightonocr-1b", (1, 8), min_requests=2, per_slot=2) for w in ("data", "imagechat")),
        ("ours", "llama.cpp BF16 + mmproj", "vllm bf16"), MULTIMODAL_COLUMNS,
        ratios=(("ours", "llama.cpp BF16 + mmproj"), ("ours", "vllm bf16")), kv_tokens=32_768, memory=True,
    ),  # fmt: skip
    # Issue 51: the Qwen2.5-VL-7B-shaped weights quantized by the tools (benchmarks/quantized_7b.py makes the files):
    # image chat at concurrency 1 and 8, decode (128 tokens a text request) at batch 1 and 16, RSS; ours and vLLM's
    # CPU build on the same AWQ, then W8A8, directory; llama.cpp on the Q4_K_M GGUF of the bf16 weights beside each
    # (the same server twice). 32,768 KV tokens a side, as the bf16 7B suite.
    "qwen2.5-vl-7b-quantized": Suite(
        quantized_7b_plans("awq") + quantized_7b_plans("w8a8"),
        ("ours", "llama.cpp Q4_K_M + mmproj", "vllm bf16"), QUANTIZED_7B_COLUMNS,
        ratios=(("ours", "llama.cpp Q4_K_M + mmproj"), ("ours", "vllm bf16")), kv_tokens=32_768, memory=True,
    ),  # fmt: skip
    # Gemma-4-E4B-shaped (issue 52): the data processor and image chat against llama.cpp (BF16 text + BF16 mmproj)
    # and vLLM's CPU build, all bf16; 32,768 KV tokens a side.
    "gemma4": Suite(
        tuple(Plan(w, w, "gemma4-e4b", (1, 8), min_requests=2, per_slot=2) for w in ("data", "imagechat")),
        ("ours", "llama.cpp BF16 + mmproj", "vllm bf16"), MULTIMODAL_COLUMNS,
        ratios=(("ours", "llama.cpp BF16 + mmproj"), ("ours", "vllm bf16")), kv_tokens=32_768, memory=True,
    ),  # fmt: skip
    # vLLM's CPU build (PEERS.md: benchmarks/.vllm-venv): SmolLM2 chat and the data processor, bf16.
    "vllm": Suite(
        (Plan("textchat", "textchat", "smollm2", (1, 16, 64), per_slot=3),
         Plan("data", "data", "qwen2-vl-bench", (1, 8), per_slot=3)),  # fmt: skip
        ("ours bf16", "vllm bf16"),
        (Column("request_throughput", "req/s", "ratio"), Column("output_throughput", "out tok/s", "ratio"),
         Column("ttft.p50", "TTFT p50 ms", "speedup"), Column("tpot.p50", "TPOT p50 ms", "speedup")),  # fmt: skip
        kv_tokens=None,
    ),
}

# What a side's weights stream as, for its per-point roofline line (None: our served dtype).
GGUF_DTYPES = {"F32": "float32", "BF16": "bfloat16", "Q8_0": "int8", "Q4_1": "int4", "int4": "int4", "int8": "int8"}


# ---- running ------------------------------------------------------------------------------------------------


def run_server(spec: peers.ServerSpec, plans: list[Plan], hf_dir: Path, vision: bool, args: argparse.Namespace,
               out: Path, rep: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:  # fmt: skip
    """One freshly started server, every point of its plans; one summary per point, and the server's facts."""
    points: list[dict[str, Any]] = []
    info: dict[str, Any] = {"server": spec.name, "rep": rep, "model_dir": str(hf_dir), "kv": spec.kv_tokens}
    sent = 0  # requests so far on this server: every point gets fresh prompts and images
    try:
        with peers.ManagedServer(spec, out / "logs", startup_timeout_s=STARTUP_TIMEOUT_S) as server:
            assert server.proc is not None
            sampler = peers.TreeSampler(server.proc.pid)
            info.update(startup_s=server.startup_s, rss_after_start_bytes=sampler.sample(),
                        pss_after_start_bytes=tree_pss_bytes(server.proc.pid),
                        startup_hwm_bytes=sum(sampler.hwm_bytes.values()), weight_bytes=peers.weight_bytes(spec),
                        command=" ".join([*(f"{k}={v}" for k, v in spec.env), *spec.command(server.port)]))  # fmt: skip
            print(f"[rep {rep}] {spec.name} on {hf_dir.name}: up in {server.startup_s:.0f} s", flush=True)
            with peers.every(0.2, sampler.sample):
                for plan in plans:
                    loads = [("closed", float(c)) for c in plan.concurrency] + [("open", r) for r in plan.rates]
                    for k, (mode, value) in enumerate(loads):
                        n = args.requests or plan.requests(value, mode)
                        cfg = SB.BenchConfig(
                            base_url=server.base_url, workloads=[plan.workload],
                            concurrency=[int(value)] if mode == "closed" else [], rates=[value] if mode == "open" else [],
                            num_requests=n, max_duration_s=MAX_DURATION_S, request_timeout_s=REQUEST_TIMEOUT_S,
                            warmup=1 if k == 0 else 0, model_dir=str(hf_dir), flavor=spec.flavor,
                            text_only=not vision, server_label=spec.name, overrides=plan.overrides,
                            dtype=GGUF_DTYPES.get(spec.label.partition(" + ")[0].rpartition(" ")[2]), first_index=sent,
                        )  # fmt: skip
                        result = SB.run_bench(cfg, log=lambda line: print(f"  {spec.name:>24} {line}", flush=True))
                        for p in result["points"]:
                            points.append({"server": spec.name, "plan": plan.label, "label": p["label"], "rep": rep,
                                           "value": value, "summary": p["summary"], "roofline": p["roofline"]})  # fmt: skip
                        sent += n
            time.sleep(SETTLE_S)
            info.update(rss_steady_bytes=sampler.sample(), pss_steady_bytes=tree_pss_bytes(server.proc.pid),
                        peak_rss_bytes=sampler.peak_bytes,
                        hwm_sum_bytes=sum(sampler.hwm_bytes.values()),
                        kv_log=kv_log_line(server.log_tail(200_000)))  # fmt: skip
    except Exception as exc:  # noqa: BLE001 - one failed server must not lose the others' rows
        print(f"{spec.name} failed: {type(exc).__name__}: {exc}", flush=True)
        info["error"] = f"{type(exc).__name__}: {exc}"[:1000]
    return points, info


def tree_pss_bytes(pid: int) -> int:
    """Σ PSS of a process tree (/proc/<pid>/smaps_rollup): a page shared by n of its processes (a library
    several of them map) counts 1/n in each, where Σ RSS counts it n times over."""
    import psutil

    try:
        pids = [pid, *(child.pid for child in psutil.Process(pid).children(recursive=True))]
    except psutil.Error:
        return 0
    return sum(_pss_bytes(p) for p in pids)


def _pss_bytes(pid: int) -> int:
    try:
        rollup = Path(f"/proc/{pid}/smaps_rollup").read_text()
    except OSError:  # exited meanwhile
        return 0
    return sum(int(line.split()[1]) * 1024 for line in rollup.splitlines() if line.startswith("Pss:"))


def kv_log_line(log: str) -> str:
    """What the server's log says about its KV cache: ours' `N KV pages x T tokens`, llama.cpp's slots."""
    import re

    if found := re.search(r"(\d+) KV pages x (\d+) tokens", log):
        return f"{int(found[1]) * int(found[2]):,} tokens"
    if found := re.search(r"n_slots = (\d+), n_ctx_slot = (\d+)", log):
        return f"{found[1]} slots x {int(found[2]):,} tokens"
    return "?"


def run_suite(suite: Suite, args: argparse.Namespace, out: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    llama = None
    if any(s.startswith("llama.cpp") for s in suite.sides):
        server = peers.find_llama_server(args.llama_server) or (peers.build_llama_server() if args.build else None)
        llama = peers.LlamaCpp(server) if server else None
    by_model: dict[str, list[Plan]] = {}
    for plan in suite.plans:
        by_model.setdefault(plan.model, []).append(plan)
    dirs = {alias: models.model_dir(alias) for alias in by_model}
    points: list[dict[str, Any]] = []
    infos: list[dict[str, Any]] = []
    for rep in range(1, args.reps + 1):
        for side in suite.sides:
            for alias, plans in by_model.items():
                row = models.model_of(alias)
                slots = max(max(p.concurrency, default=1) for p in plans)
                try:
                    spec = peers.side_spec(side, row, dirs[alias], slots=slots, kv_tokens=suite.kv_tokens, llama=llama)
                except (FileNotFoundError, ValueError, OSError) as exc:
                    infos.append({"server": side, "rep": rep, "error": f"{type(exc).__name__}: {exc}"[:1000]})
                    print(f"{side}: {exc}", flush=True)
                    continue
                if args.prepare_only:
                    continue
                got, info = run_server(spec, plans, dirs[alias], row.vision, args, out, rep)
                points += got
                infos.append(info)
                (out / "results.json").write_text(json.dumps({"points": points, "servers": infos}, indent=1))
    return points, infos


# ---- the table ----------------------------------------------------------------------------------------------


def aggregate(points: list[dict[str, Any]]) -> dict[tuple[str, str, str], dict[str, Any]]:
    """(server, plan, load label) -> the median summary over repetitions."""
    groups: dict[tuple[str, str, str], list[dict[str, Any]]] = {}
    for p in points:
        groups.setdefault((p["server"], p["plan"], p["label"]), []).append(p["summary"])
    return {key: S.median_tree(summaries) | {"reps": len(summaries)} for key, summaries in groups.items()}


def value(summary: dict[str, Any] | None, metric: str) -> float:
    tree: Any = summary or {}
    for key in metric.split("."):
        tree = tree.get(key) if isinstance(tree, dict) else None
    return float(tree) if isinstance(tree, (int, float)) else float("nan")


def cell(summary: dict[str, Any] | None, metric: str) -> str:
    if summary is None:
        return "—"
    if metric == "ok":
        return f"{int(value(summary, 'num_ok'))}/{int(value(summary, 'num_requests'))}"
    if metric == "errors":
        return S.fmt(value(summary, "num_errors"), 0)
    x = value(summary, metric)
    if "." in metric and metric.split(".")[0] in ("ttft", "itl", "tpot", "e2e", "first_chunk"):
        return S.fmt(x, 0 if x >= 0.1 else 1, 1000)
    if metric == "cached_token_share":
        return S.fmt(x, 0, 100) + "%" if math.isfinite(x) else "—"
    if metric == "request_throughput":
        return S.fmt(x, 3 if x < 0.1 else 2)
    return S.fmt(x, 1)


def table(suite: Suite, sides: list[str], agg: dict[tuple[str, str, str], dict[str, Any]], tier: str) -> list[str]:
    first = sides[0]
    ratios = [(a, b) for a, b in suite.ratios if a in sides and (b in sides or b.startswith("best "))]
    ratios = ratios if suite.ratios else [(first, s) for s in sides[1:]]
    head = ["plan", "load", "CPU tier"]
    for col in suite.columns:
        if col.mode in ("each", "ratio", "speedup"):
            head += [f"{col.head} {s}" for s in sides]
            head += [f"{first} / {s}" if col.mode == "ratio" else f"speed-up {s}" for s in sides[1:]] if col.mode != "each" else []
        else:
            head.append(f"{col.head} {first}" if col.mode == "first" else f"{col.head} {' / '.join(sides)}")
        if col is suite.columns[0] and suite.ratios:
            head += [f"{a} / {b}" for a, b in ratios]
    rows = []
    labels = list(dict.fromkeys((plan, label) for (_, plan, label) in agg))
    for plan, label in labels:
        got = {s: agg.get((s, plan, label)) for s in sides}
        cells = [plan, label, tier]
        for col in suite.columns:
            if col.mode in ("each", "ratio", "speedup"):
                cells += [cell(got[s], col.metric) for s in sides]
                x = {s: value(got[s], col.metric) for s in sides}
                if col.mode == "ratio":
                    cells += [S.fmt_ratio(S.ratio(x[first], x[s])) for s in sides[1:]]
                elif col.mode == "speedup":
                    cells += [S.fmt_ratio(S.ratio(x[s], x[first])) for s in sides[1:]]
            elif col.mode == "first":
                cells.append(cell(got[first], col.metric))
            else:
                cells.append(" / ".join(cell(got[s], col.metric) for s in sides))
            if col is suite.columns[0] and suite.ratios:
                x = {s: value(got[s], col.metric) for s in sides}
                for a, b in ratios:
                    peer = b.removeprefix("best ")
                    denominator = (max((x[s] for s in sides if s.startswith(peer) and math.isfinite(x[s])),
                                       default=float("nan")) if b.startswith("best ") else x[b])  # fmt: skip
                    cells.append(S.fmt_ratio(S.ratio(x[a], denominator)))
        rows.append(cells)
    return S.md_table(head, rows)


MEMORY_COLUMNS = {"weight_bytes": "weights GiB", "startup_hwm_bytes": "start-up peak GiB (Σ VmHWM at /health)",
                  "rss_after_start_bytes": "RSS idle after start GiB", "peak_rss_bytes": "peak RSS (tree) GiB",
                  "hwm_sum_bytes": "Σ VmHWM GiB", "rss_steady_bytes": f"steady RSS GiB ({SETTLE_S:.0f} s idle after)",
                  "pss_after_start_bytes": "Σ PSS after start GiB", "pss_steady_bytes": "Σ PSS steady GiB"}  # fmt: skip


def memory_table(infos: list[dict[str, Any]], tier: str) -> list[str]:
    """Per server: what it loads, its memory at /health, its peak while answering and its RSS idle afterwards."""
    head = ["server", "CPU tier", "model", "KV", "start-up s", *MEMORY_COLUMNS.values()]
    rows = [[i["server"], tier, Path(i["model_dir"]).name, f"{i.get('kv') or 'default'}; log: {i.get('kv_log', '?')}",
             S.fmt(i.get("startup_s"), 0), *(S.fmt(i.get(k, float("nan")) / 2**30, 2) for k in MEMORY_COLUMNS)]
            for i in infos if "error" not in i]  # fmt: skip
    return S.md_table(head, rows)


def decode_line(model: str, machine: R.MachineCeilings) -> str:
    """In-process decode at batch 64 against the measured matmul ceiling of the dtype it runs in."""
    try:
        from inproc import engine_decode_step

        m = engine_decode_step(model, "auto", 64, 128)
        roof = R.roofline(R.ModelCost.from_dir(m["model_dir"]), machine, 64, m["context"], m["forward_s"], m["dtype"], "forward")
        return f"decode at batch 64 ({model}, {m['dtype']}): {roof.line()}"
    except Exception as exc:  # noqa: BLE001
        return f"decode at batch 64 ({model}): failed: {type(exc).__name__}: {exc}"


def report(suite_name: str, suite: Suite, sides: list[str], points: list[dict[str, Any]], infos: list[dict[str, Any]],
           argv: list[str], decode: str) -> str:  # fmt: skip
    from vlm_engine.kernels.cpu_isa import cpu_flags, isa_tier

    tier = isa_tier()
    flags = " ".join(sorted(cpu_flags() & {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}))
    lines = [f"# side by side: {suite_name} — {time.strftime('%Y-%m-%d %H:%M')}", "",
             f"Command: `.venv/bin/python benchmarks/side_by_side.py {' '.join(argv)}`", "",
             f"CPU tier **{tier}** (flags: {flags}); {R.machine_ceilings().describe()}", "",
             "Medians over repetitions. req/s and tok/s over the whole point (first send to last completion); ratios "
             "a / b of the first column; speed-ups other / first (> 1: the first side is faster); TTFT = first text "
             "chunk, first chunk = the first chunk of any kind.", "", *table(suite, sides, aggregate(points), tier), ""]  # fmt: skip
    if suite.memory:
        lines += [*memory_table(infos, tier), ""]
    errors = [f"- {i['server']} (rep {i['rep']}): {i['error']}" for i in infos if "error" in i]
    errors += [f"- {p['server']} {p['plan']} {p['label']}: {p['summary']['errors']}" for p in points if p["summary"]["errors"]]
    return "\n".join(lines + (["Errors:", *errors, ""] if errors else []) + ([decode, ""] if decode else []))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("suite", choices=sorted(SUITES))
    p.add_argument("--sides", default=None, help="comma list of side names (default: the suite's)")
    p.add_argument("--plans", default=None, help="comma list of the suite's plan labels")
    p.add_argument("--model", default=None, help="serve this models.MODELS alias or directory in every plan")
    p.add_argument("--reps", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="one request per slot (at least 8) per closed-loop point")
    p.add_argument("--smoke", action="store_true", help="one request per point, 16 output tokens, no open loop")
    p.add_argument("--requests", type=int, default=0, help="requests per point (default: the plan's)")
    p.add_argument("--concurrency", default=None, help="comma list: replaces every plan's closed-loop points")
    p.add_argument("--llama-server", default=None)
    p.add_argument("--build", action="store_true", help="build llama-server (~15 min on 2 cores) if none is found")
    p.add_argument("--prepare-only", action="store_true", help="build checkpoints and GGUF files, start nothing")
    p.add_argument("--no-decode-roofline", action="store_true")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    suite = SUITES[args.suite]
    plans = [pl for pl in suite.plans if args.plans is None or pl.label in args.plans.split(",")]
    if args.model:
        plans = [replace(pl, model=args.model) for pl in plans]
    if args.concurrency:
        plans = [replace(pl, concurrency=tuple(int(c) for c in args.concurrency.split(","))) for pl in plans]
    if args.quick:
        plans = [replace(pl, per_slot=1, min_requests=min(pl.min_requests, 8)) for pl in plans]
    if args.smoke:
        plans = [replace(pl, per_slot=1, min_requests=1, rates=(), overrides=pl.overrides | {"output_tokens": (16, 16)})
                 for pl in plans]  # fmt: skip
    suite = replace(suite, plans=tuple(plans), sides=tuple(args.sides.split(",")) if args.sides else suite.sides)
    out = args.out or RESULTS / time.strftime(f"{args.suite}-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    peers.install_signal_handlers()
    points, infos = run_suite(suite, args, out)
    if args.prepare_only:
        return 1 if any("error" in i for i in infos) else 0
    machine = R.machine_ceilings()
    decode = "" if args.no_decode_roofline or not suite.decode_roofline else decode_line(suite.decode_roofline, machine)
    text = report(args.suite, suite, list(suite.sides), points, infos, argv, decode)
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(json.dumps({"points": points, "servers": infos, "argv": argv}, indent=1, default=str))
    print(text)
    print(f"wrote {out}/table.md and results.json")
    return 1 if "\nErrors:" in text else 0


if __name__ == "__main__":
    sys.exit(main())
