"""The A/B runner: variants of our server (flags, environment, another worktree's code) up at once, the same fresh
requests to each in turn, the order rotating every round; ratios paired round by round. Sets, flags and what they
measured: benchmarks/README.md ("Speculative decoding", "Metrics overhead")."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shlex
import sys
import time
from dataclasses import asdict, dataclass, is_dataclass, replace
from pathlib import Path
from typing import Any

sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import client as C
import models
import peers
import roofline as R
import stats as S
import workloads as W

RESULTS = Path(__file__).resolve().parent / "results"
SPEC_COUNTERS = {  # vlm-engine's speculative decoding counters
    "drafts": "vlm_engine:spec_decode_num_drafts_total",
    "draft_tokens": "vlm_engine:spec_decode_num_draft_tokens_total",
    "accepted": "vlm_engine:spec_decode_num_accepted_tokens_total",
}


@dataclass(frozen=True)
class Variant:
    name: str
    args: tuple[str, ...] = ()
    min_concurrency: int = 1  # run only at points of at least this concurrency
    scrape_s: float = 0.0  # > 0: GET /metrics this often while its runs go (an open dashboard)
    worktree: str | None = None  # another checkout's code (`git worktree add DIR COMMIT`)


@dataclass(frozen=True)
class VariantSet:
    variants: tuple[Variant, ...]
    workloads: tuple[str, ...]
    concurrency: tuple[int, ...]
    rounds: int
    requests: int  # per point at concurrency 1; waves x concurrency above
    waves: int
    model: str
    kv_tokens: int | None = 16_384
    max_tokens: int | None = None  # None: the workload's


SETS: dict[str, VariantSet] = {
    # Prompt lookup on vs off; 'ngram-forced' drafts at every batch size, to show what the threshold is for.
    "speculative": VariantSet(
        (Variant("off"), Variant("ngram", ("--speculative", "ngram")),
         Variant("ngram-forced", ("--speculative", "ngram", "--speculative-disable-batch-size", "64"), min_concurrency=8)),
        ("extraction", "chat"), (1, 16), rounds=3, requests=6, waves=2, model="smollm2",
    ),  # fmt: skip
    # Metrics on (scraped every second) vs off, and a second identical 'off' server: how far two equal servers
    # measure apart on this machine.
    "metrics": VariantSet(
        (Variant("metrics on", scrape_s=1.0), Variant("metrics off", ("--disable-log-stats",)),
         Variant("off, control", ("--disable-log-stats",))),
        ("textchat",), (16,), rounds=9, requests=48, waves=3, model="smollm2", kv_tokens=None,
    ),  # fmt: skip
    "custom": VariantSet((), ("textchat",), (1, 16), rounds=3, requests=6, waves=2, model="smollm2"),
}


def copied_share(text: str, source: str, window: int = 12) -> float | None:
    """Share of the answer's characters inside some `window`-character span found verbatim in the document:
    ~1 for a copy, ~0 for a refusal or free text."""
    if len(text) < window:
        return None
    covered = [False] * len(text)
    for i in range(len(text) - window + 1):
        if text[i : i + window] in source:
            covered[i : i + window] = [True] * window
    return sum(covered) / len(covered)


def one_run(server: peers.ManagedServer, variant: Variant, requests: list[W.BenchRequest], c: int) -> dict[str, Any]:
    """One variant, one point: the summary, counter deltas, server CPU seconds per 1k output tokens, texts."""
    url = server.base_url + "/v1/chat/completions"
    by_index = {r.index: r for r in requests}
    point = C.LoadPoint("closed", c, len(requests), 3600.0, 300.0)
    assert server.proc is not None
    cpu0, m0 = peers.tree_cpu_seconds(server.proc.pid), C.scrape_metrics(server.base_url)
    with peers.every(variant.scrape_s, lambda: C.scrape_metrics(server.base_url)):
        records, duration = asyncio.run(C.run_point(url, by_index.__getitem__, point, first_index=requests[0].index))
    cpu1, m1 = peers.tree_cpu_seconds(server.proc.pid), C.scrape_metrics(server.base_url)
    summary = S.summarize(records, duration)
    tokens = summary.output_throughput * duration
    copied = [copied_share(r.text, by_index[r.index].source) for r in records if by_index[r.index].source]
    return {
        "summary": summary,  # a Summary until results.json is written
        "spec": {k: m1.get(name, 0.0) - m0.get(name, 0.0) for k, name in SPEC_COUNTERS.items()},
        "cpu_s_per_1k_tokens": {n: 1000 * (cpu1[n] - cpu0.get(n, 0.0)) / tokens for n in cpu1} if tokens else {},
        "copied_share": S.median([x for x in copied if x is not None]) if copied else None,
        "texts": [r.text for r in records],
    }


def run_set(vs: VariantSet, out: Path) -> dict[str, list[dict[str, Any]]]:
    """Every variant up at once; rounds x concurrency x workload; returns runs keyed 'workload/c=N/variant'."""
    hf_dir = str(models.model_dir(vs.model))
    runs: dict[str, list[dict[str, Any]]] = {}
    with contextlib.ExitStack() as stack:
        up = {}
        for v in vs.variants:
            spec = peers.ServerSpec("ours", hf_dir, extra_args=v.args, label=v.name, kv_tokens=vs.kv_tokens, cwd=v.worktree)
            up[v.name] = stack.enter_context(peers.ManagedServer(spec, out / "logs", startup_timeout_s=900))
            print(f"{v.name}: up at {up[v.name].base_url} in {up[v.name].startup_s:.1f} s", flush=True)
        model = C.served_model_id(up[vs.variants[0].name].base_url)
        factories = {w: W.RequestFactory(spec_of(w, vs), model, "vlm-engine") for w in vs.workloads}
        for v in vs.variants:  # warm-up, not measured: one request per workload
            for w, f in factories.items():
                record = asyncio.run(C.probe(up[v.name].base_url + "/v1/chat/completions", f.build(W.WARMUP_INDEX)))
                if not record.ok:
                    raise RuntimeError(f"{v.name}: warm-up request failed: {record.error}")
        for r in range(vs.rounds):
            for c in vs.concurrency:
                here = [v for v in vs.variants if c >= v.min_concurrency]
                order = here[r % len(here) :] + here[: r % len(here)] if len(here) > 2 else here[:: 1 - 2 * (r % 2)]
                n = vs.requests if c == 1 else vs.waves * c
                first = 100_000 * c + r * n  # fresh requests every round and concurrency, the same for every variant
                for w, f in factories.items():
                    requests = [f.build(first + i) for i in range(n)]
                    for v in order:
                        run = one_run(up[v.name], v, requests, c) | {"round": r}
                        runs.setdefault(f"{w}/c={c}/{v.name}", []).append(run)
                        print(f"round {r + 1}/{vs.rounds} {S.one_line(f'{w} c={c} {v.name}', run['summary'])}", flush=True)
    return runs


def spec_of(workload: str, vs: VariantSet) -> W.WorkloadSpec:
    spec = W.text_only(W.workload_spec(workload))
    return replace(spec, output_tokens=(vs.max_tokens, vs.max_tokens)) if vs.max_tokens else spec


def table(vs: VariantSet, runs: dict[str, list[dict[str, Any]]]) -> list[str]:
    base = vs.variants[0].name
    head = ["workload", "c", "variant", "decode tok/s", f"/ {base}", "output tok/s per round", "ITL mean ms", "p50",
            "p99", "TTFT p50 ms", "tokens / req", "tokens / chunk", "server CPU s / 1k tokens", "acceptance length",
            "drafts / req", f"same output as {base}"]  # fmt: skip
    rows = []
    for key, rs in runs.items():
        w, c, name = key.split("/", 2)
        sums = [r["summary"] for r in rs]
        ref = runs.get(f"{w}/{c}/{base}", [])
        spec = {k: sum(r["spec"][k] for r in rs) for k in SPEC_COUNTERS}
        ok = sum(s.num_ok for s in sums)
        same = sum(a == b for r, q in zip(rs, ref) for a, b in zip(r["texts"], q["texts"]))
        rows.append([
            w, c.removeprefix("c="), name, S.fmt(S.median([s.decode_tok_s for s in sums]), 1),
            "—" if name == base else S.fmt_ratio(S.paired_ratio([s.decode_tok_s for s in sums],
                                                                [q["summary"].decode_tok_s for q in ref])),
            ", ".join(S.fmt(s.output_throughput, 1) for s in sums),
            *(S.fmt(S.median([getattr(s.tpot, q) for s in sums]), 1, 1000) for q in ("mean", "p50", "p99")),
            S.fmt(S.median([s.ttft.p50 for s in sums]), 1, 1000), S.fmt(S.median([s.mean_output_tokens for s in sums]), 1),
            S.fmt(S.median([s.tokens_per_chunk for s in sums])),
            S.fmt(S.median([sum(r["cpu_s_per_1k_tokens"].values()) for r in rs]), 3),
            S.fmt(1 + spec["accepted"] / spec["drafts"] if spec["drafts"] else None), S.fmt(spec["drafts"] / max(1, ok), 1),
            "—" if name == base else f"{same}/{sum(len(r['texts']) for r in rs)}",
        ])  # fmt: skip
    return S.md_table(head, rows)


def parse_variant(text: str) -> Variant:
    """NAME=ARGS (server flags) or NAME=@WORKTREE [ARGS]."""
    name, _, rest = text.partition("=")
    words = shlex.split(rest)
    worktree = words.pop(0)[1:] if words and words[0].startswith("@") else None
    return Variant(name, tuple(words), worktree=worktree)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("set", choices=sorted(SETS))
    p.add_argument("--variant", action="append", default=[], help="NAME=ARGS or NAME=@WORKTREE [ARGS] (repeatable)")
    p.add_argument("--model", default=None, help="a models.MODELS alias or a checkpoint directory")
    p.add_argument("--workloads", default=None)
    p.add_argument("--concurrency", default=None)
    p.add_argument("--requests", type=int, default=None, help="requests per point at concurrency 1")
    p.add_argument("--waves", type=int, default=None, help="requests per point above 1 = waves x concurrency")
    p.add_argument("--quick", action="store_true", help="smoke: 1 round, 2 requests per point, 16 tokens, c=1,2")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    vs = SETS[args.set]
    if args.variant:
        vs = replace(vs, variants=tuple(parse_variant(v) for v in args.variant))
    if args.quick:  # the forced variant needs concurrency 8: a smoke run leaves it out
        vs = replace(vs, concurrency=(1, 2), rounds=1, requests=2, waves=1, max_tokens=16,
                     variants=tuple(v for v in vs.variants if v.min_concurrency <= 2))  # fmt: skip
    given = {"model": args.model, "requests": args.requests, "waves": args.waves,
             "workloads": tuple(args.workloads.split(",")) if args.workloads else None,
             "concurrency": tuple(int(c) for c in args.concurrency.split(",")) if args.concurrency else None}  # fmt: skip
    vs = replace(vs, **{k: v for k, v in given.items() if v is not None})
    if not vs.variants:
        raise SystemExit("ab: give at least two --variant")
    out = args.out or RESULTS / time.strftime(f"ab-{args.set}-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    peers.install_signal_handlers()
    from vlm_engine.kernels.cpu_isa import isa_tier

    t0 = time.monotonic()
    runs = run_set(vs, out)
    lines = [
        f"# A/B: {args.set} — {time.strftime('%Y-%m-%d %H:%M')}", "",
        f"Command: `.venv/bin/python benchmarks/ab.py {' '.join(argv)}`", "",
        f"CPU: {R.cpu_name()}, CPU tier **{isa_tier()}**; model `{vs.model}`; {vs.rounds} rounds, order rotating; "
        f"wall {(time.monotonic() - t0) / 60:.1f} min.", "", *table(vs, runs), "",
        "decode tok/s: one request at a time, the mean of 1 / TPOT; above, all tokens after the first over the union "
        "of the decode intervals. ITL = TPOT per request. Medians over rounds; ratios paired round by round. "
        "acceptance length = 1 + accepted / drafts (/metrics counters over all rounds).", "",
    ]  # fmt: skip
    shares = [r["copied_share"] for k, rs in runs.items() if k.startswith("extraction/") for r in rs if r["copied_share"]]
    if shares:
        lines += [f"Extraction answers copied verbatim from their documents (median share): {S.median(shares):.0%}.", ""]
    (out / "table.md").write_text("\n".join(lines))
    as_json = lambda o: asdict(o) if is_dataclass(o) else str(o)  # noqa: E731 - the runs' Summaries
    (out / "results.json").write_text(json.dumps({"set": asdict(vs), "runs": runs}, indent=1, default=as_json))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
