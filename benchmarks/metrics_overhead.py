"""What the metrics cost: our server with its metrics on (the default, with /metrics scraped every
second, as an open dashboard or a Prometheus would) against `--disable-log-stats`, same model,
same client, in one run.

    .venv/bin/python benchmarks/metrics_overhead.py                # SmolLM2, textchat at 16, 3 x 3 rounds
    .venv/bin/python benchmarks/metrics_overhead.py --concurrency 64 --rounds 2

Three servers stay up at once: metrics on, metrics off, and a second identical 'off' server as
the control (how far apart two equal servers measure here). Rounds rotate between them (an idle
server blocks on its sockets and costs the others nothing), so the VM's drift over minutes hits
all alike; three blocks rotate the start order too. Reported per variant: output tokens/s per
round, the round-by-round ratio to 'off', and the CPU seconds the server's processes spent per
1,000 output tokens, by process (vlm-api, vlm-core, ...; psutil). Then the metrics' direct costs
(per step, per token, per scrape), timed on their own.
Writes benchmarks/results/metrics-overhead-<time>/{table.md,results.json}.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil

sys.path.insert(0, str(Path(__file__).resolve().parent))

import roofline as R
import serve_bench as SB
import servers

from vlm_engine.kernels.cpu_isa import isa_tier

RESULTS = Path(__file__).resolve().parent / "results"


class Scraper:
    """GET /metrics every `interval_s` on a thread while a round runs (what a dashboard does)."""

    def __init__(self, base_url: str, interval_s: float) -> None:
        self.url, self.interval_s = base_url + "/metrics", interval_s
        self.scrapes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            httpx.get(self.url, timeout=10.0).raise_for_status()
            self.scrapes += 1

    def __enter__(self) -> Scraper:  # noqa: PYI034 - a plain class, never subclassed
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def cpu_seconds(server: servers.ManagedServer) -> dict[str, float]:
    """User + system CPU seconds so far of the server's processes, by process name (vlm-api, vlm-core, ...)."""
    assert server.proc is not None
    root = psutil.Process(server.proc.pid)
    out: dict[str, float] = {}
    for proc in [root, *root.children(recursive=True)]:
        with contextlib.suppress(psutil.NoSuchProcess):
            times = proc.cpu_times()
            name = proc.name()
            out[name] = out.get(name, 0.0) + times.user + times.system
    return out


def one_round(server: servers.ManagedServer, hf_dir: Path, args: argparse.Namespace, label: str) -> dict[str, Any]:
    cfg = SB.BenchConfig(
        base_url=server.base_url, workloads=["textchat"], concurrency=[args.concurrency],
        num_requests=args.requests, max_duration_s=600.0, warmup=2, model=None, model_dir=str(hf_dir),
        flavor="vllm", text_only=True, server_label=label, dtype=None, overrides={},
    )  # fmt: skip
    before = cpu_seconds(server)
    result = SB.run_bench(cfg, log=lambda line: print(f"  {label:>12} {line}", flush=True))
    after = cpu_seconds(server)
    summary = result["points"][0]["summary"]
    if summary["num_errors"]:
        raise RuntimeError(f"{label}: {summary['num_errors']} requests failed: {summary['errors']}")
    tokens = summary["output_throughput"] * summary["duration_s"]
    cpu = {name: 1000 * (after[name] - before.get(name, 0.0)) / tokens for name in after}
    return {"tok_s": summary["output_throughput"], "cpu_s_per_1k_tokens": cpu}


@dataclass(frozen=True)
class Variant:
    label: str
    extra_args: tuple[str, ...]
    scraped: bool  # GET /metrics every --scrape-interval while its rounds run


ON, OFF, CONTROL = "metrics on", "metrics off", "metrics off (control)"
VARIANTS = [
    Variant(ON, (), True),
    Variant(OFF, ("--disable-log-stats",), False),
    # A second, identical 'off' server: how far apart two equal servers measure on this machine.
    Variant(CONTROL, ("--disable-log-stats",), False),
]


def run_block(order: list[Variant], hf_dir: Path, args: argparse.Namespace, out: Path,
              rounds: dict[str, list[dict[str, Any]]]) -> int:  # fmt: skip
    """Every variant's server up (started in `order`), `args.rounds` rounds each, in an order that
    rotates every round; returns the scrapes made."""
    scrapes = 0
    with contextlib.ExitStack() as stack:
        up = [
            (v, stack.enter_context(servers.ManagedServer(servers.ServerSpec("ours", str(hf_dir), extra_args=v.extra_args,
                                                                             label=v.label), out / "logs")))
            for v in order
        ]  # fmt: skip
        for r in range(args.rounds):
            for variant, server in up[r % len(up) :] + up[: r % len(up)]:
                if variant.scraped:
                    with Scraper(server.base_url, args.scrape_interval) as scraper:
                        rounds[variant.label].append(one_round(server, hf_dir, args, variant.label))
                    scrapes += scraper.scrapes
                else:
                    rounds[variant.label].append(one_round(server, hf_dir, args, variant.label))
    return scrapes


def _per_call_us(fn: Any, n: int) -> float:
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return 1e6 * (time.perf_counter() - t0) / n


def direct_costs() -> list[str]:
    """What the metrics add per engine step, per token and per scrape, measured on their own."""
    from vlm_engine import ipc
    from vlm_engine.server.metrics import ServerMetrics

    stats = ipc.CoreStats(pages_total=4096)

    def step_observations() -> None:  # what engine_core._step adds per step with metrics on
        for hist in (stats.step_schedule_s, stats.step_forward_s, stats.step_update_s):
            hist.observe(0.003)
        for hist in (
            stats.step_batch_size,
            stats.step_prefill_tokens,
            stats.step_cached_tokens,
            stats.step_decode_tokens,
        ):
            hist.observe(16)

    metrics = ServerMetrics("m", "r", lambda: stats, lambda: {"num_requests_inflight": 16, "healthy": 1})
    step_us = _per_call_us(step_observations, 20_000)
    token_us = _per_call_us(lambda: metrics.on_token_gap(0.05, 1), 20_000)
    render_ms = _per_call_us(metrics.render, 200) / 1000
    return [
        f"engine core, per step: {step_us:.1f} µs of histogram observations",
        f"API process, per output token: {token_us:.1f} µs (the inter-token-latency observation)",
        f"API process, per scrape of /metrics: {render_ms:.1f} ms (prometheus_client rendering)",
    ]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=48, help="requests per round")
    p.add_argument("--rounds", type=int, default=3, help="rounds per variant in each block")
    p.add_argument("--scrape-interval", type=float, default=1.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    servers.install_signal_handlers()
    hf_dir = Path(R.resolve_model_dir("smollm2"))
    out = args.out or RESULTS / time.strftime("metrics-overhead-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    tier = isa_tier()
    rounds: dict[str, list[dict[str, Any]]] = {v.label: [] for v in VARIANTS}
    scrapes = 0
    for b in range(len(VARIANTS)):  # each block starts the servers in another order
        scrapes += run_block(VARIANTS[b:] + VARIANTS[:b], hf_dir, args, out, rounds)

    def median_tok_s(label: str) -> float:
        return statistics.median(r["tok_s"] for r in rounds[label])

    def median_cpu(label: str, name: str | None = None) -> float:
        return statistics.median(
            sum(v for k, v in r["cpu_s_per_1k_tokens"].items() if name is None or k == name) for r in rounds[label]
        )

    names = sorted({k for rs in rounds.values() for r in rs for k in r["cpu_s_per_1k_tokens"]})
    lines = [
        f"# Metrics overhead — {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"Command: `.venv/bin/python benchmarks/metrics_overhead.py {' '.join(argv or sys.argv[1:])}`",
        "",
        (
            f"CPU tier **{tier}**; SmolLM2-135M-Instruct, textchat (streaming, greedy, 64 output tokens), "
            f"concurrency {args.concurrency}, {args.requests} requests per round, {len(VARIANTS)} blocks x "
            f"{args.rounds} rounds per variant, rotating; '{ON}' scraped /metrics every {args.scrape_interval:g} s "
            f"({scrapes} scrapes)."
        ),
        "",
        "| variant | output tok/s per round | median tok/s | CPU s / 1k tokens: all | " + " | ".join(names) + " |",
        "|---|---|---|---|" + "---|" * len(names),
    ]
    for label, runs in rounds.items():
        per_round = ", ".join(f"{r['tok_s']:.1f}" for r in runs)
        cpu = " | ".join(f"{median_cpu(label, n):.3f}" for n in names)
        lines.append(f"| {label} | {per_round} | {median_tok_s(label):.1f} | {median_cpu(label):.3f} | {cpu} |")
    lines.append("")
    # Round i of every variant ran back to back: their ratio is free of the VM's slow drift.
    for label in (ON, CONTROL):
        paired = [a["tok_s"] / b["tok_s"] for a, b in zip(rounds[label], rounds[OFF])]
        lines.append(
            f"- tokens/s {label} / {OFF}, round by round: {', '.join(f'{x:.3f}' for x in paired)}; "
            f"median **{statistics.median(paired):.3f}**; server CPU per token "
            f"{median_cpu(label) / median_cpu(OFF):.3f}x"
        )
    lines += ["", "Direct costs, timed in this process:", "", *(f"- {line}" for line in direct_costs()), ""]
    (out / "table.md").write_text("\n".join(lines))
    (out / "results.json").write_text(json.dumps({"tier": tier, "rounds": rounds, "scrapes": scrapes}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
