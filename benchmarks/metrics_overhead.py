"""What the metrics cost: our server with its metrics on (the default, with /metrics scraped every
second, as an open dashboard or a Prometheus would) against `--disable-log-stats`, same model,
same client, in one run.

    .venv/bin/python benchmarks/metrics_overhead.py                # SmolLM2, textchat at 16, 5 rounds
    .venv/bin/python benchmarks/metrics_overhead.py --concurrency 64 --rounds 3

Both servers are started first and stay up; the rounds alternate between them (an idle server
blocks on its sockets and costs the other nothing), so the VM's drift over minutes hits both
alike. Reported: output tokens/s per round and the ratio of medians, on this machine's CPU tier.
Writes benchmarks/results/metrics-overhead-<time>/{table.md,results.json}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))

import roofline as R
import serve_bench as SB
import servers

from vlm_engine.models.cpu_isa import isa_tier

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


def one_round(server: servers.ManagedServer, hf_dir: Path, args: argparse.Namespace, label: str) -> float:
    cfg = SB.BenchConfig(
        base_url=server.base_url, workloads=["textchat"], concurrency=[args.concurrency],
        num_requests=args.requests, max_duration_s=600.0, warmup=2, model=None, model_dir=str(hf_dir),
        flavor="vllm", text_only=True, server_label=label, dtype=None, overrides={},
    )  # fmt: skip
    result = SB.run_bench(cfg, log=lambda line: print(f"  {label:>12} {line}", flush=True))
    summary = result["points"][0]["summary"]
    if summary.num_errors:
        raise RuntimeError(f"{label}: {summary.num_errors} requests failed: {summary.errors}")
    return summary.output_throughput


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--requests", type=int, default=64, help="requests per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--scrape-interval", type=float, default=1.0)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    servers.install_signal_handlers()
    hf_dir = Path(R.resolve_model_dir("smollm2"))
    out = args.out or RESULTS / time.strftime("metrics-overhead-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    tier = isa_tier()
    on_spec = servers.ServerSpec("ours", str(hf_dir), label="metrics on")
    off_spec = servers.ServerSpec("ours", str(hf_dir), extra_args=("--disable-log-stats",), label="metrics off")
    rates: dict[str, list[float]] = {"on": [], "off": []}
    scrapes = 0
    with servers.ManagedServer(on_spec, out / "logs") as on, servers.ManagedServer(off_spec, out / "logs") as off:
        for r in range(args.rounds):
            order = [("on", on), ("off", off)] if r % 2 == 0 else [("off", off), ("on", on)]
            for key, server in order:
                if key == "on":
                    with Scraper(server.base_url, args.scrape_interval) as scraper:
                        rates[key].append(one_round(server, hf_dir, args, "metrics on"))
                    scrapes += scraper.scrapes
                else:
                    rates[key].append(one_round(server, hf_dir, args, "metrics off"))
    on_median, off_median = statistics.median(rates["on"]), statistics.median(rates["off"])
    lines = [
        f"# Metrics overhead — {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"Command: `.venv/bin/python benchmarks/metrics_overhead.py {' '.join(argv or sys.argv[1:])}`",
        "",
        (
            f"CPU tier **{tier}**; SmolLM2-135M-Instruct, textchat (streaming, greedy, 64 output tokens), "
            f"concurrency {args.concurrency}, {args.requests} requests per round, {args.rounds} rounds alternating; "
            f"'on' scraped /metrics every {args.scrape_interval:g} s ({scrapes} scrapes)."
        ),
        "",
        "| metrics | output tok/s per round | median |",
        "|---|---|---|",
        f"| on (default) | {', '.join(f'{x:.1f}' for x in rates['on'])} | {on_median:.1f} |",
        f"| off (`--disable-log-stats`) | {', '.join(f'{x:.1f}' for x in rates['off'])} | {off_median:.1f} |",
        "",
        f"on / off = **{on_median / off_median:.3f}** (cost {100 * (1 - on_median / off_median):+.1f}%)",
        "",
    ]
    (out / "table.md").write_text("\n".join(lines))
    (out / "results.json").write_text(json.dumps({"tier": tier, "rates": rates, "scrapes": scrapes}, indent=1))
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
