"""PNG plots (matplotlib, headless): latency and throughput against load per workload and server (serve_bench),
and the stacked time per decode step against batch size (inproc.py host)."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

LATENCY = (("TTFT, ms", "ttft"), ("inter-token latency, ms", "itl"), ("end-to-end latency, ms", "e2e"))
THROUGHPUT = (("requests / s", "request_throughput"), ("output tokens / s", "output_throughput"))


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _draw(ax: Any, key: str, x: list[float], summaries: list[dict[str, Any]], server: str, color: str) -> None:
    """A distribution's p50 (solid) and p95 (dashed) in ms, log scale; or a throughput from 0."""
    if key in ("ttft", "itl", "e2e"):
        for q, style in (("p50", "o-"), ("p95", "x--")):
            y = [1000 * ((s.get(key) or {}).get(q) or math.nan) for s in summaries]
            if any(v > 0 for v in y if math.isfinite(v)):
                ax.plot(x, y, style, color=color, label=f"{server} {q}")
                ax.set_yscale("log")
    else:
        ax.plot(x, [s.get(key) if s.get(key) is not None else math.nan for s in summaries], "o-", color=color, label=server)
        ax.set_ylim(bottom=0)


def _figure(points: Sequence[dict[str, Any]], mode: str, panels: Sequence[tuple[str, str]], path: Path) -> Path | None:
    series: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for p in sorted((p for p in points if p["mode"] == mode), key=lambda p: p["value"]):
        series.setdefault((p["workload"], p.get("server", "server")), []).append(p)
    if not series:
        return None
    workloads = sorted({w for w, _ in series})
    servers = sorted({s for _, s in series}, key=lambda s: (s != "ours", s))
    plt = _plt()
    fig, axes = plt.subplots(len(workloads), len(panels), figsize=(5 * len(panels), 3.4 * len(workloads)), squeeze=False)
    for row, workload in enumerate(workloads):
        for col, (title, key) in enumerate(panels):
            ax = axes[row][col]
            for i, server in enumerate(servers):
                if pts := series.get((workload, server)):
                    _draw(ax, key, [p["value"] for p in pts], [p["summary"] for p in pts], server, f"C{i}")
            ax.set_title(f"{workload}: {title}", fontsize=10)
            ax.set_xlabel("concurrency (closed loop)" if mode == "closed" else "offered rate, req/s (Poisson)", fontsize=8)
            ax.grid(True, which="both", alpha=0.3)
            if mode == "closed":
                ax.set_xscale("log", base=2)
            ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_all(points: Sequence[dict[str, Any]], out_dir: Path, prefix: str = "") -> list[Path]:
    """Latency (p50, p95) and throughput against concurrency (closed loop) and offered rate (open loop)."""
    made = [_figure(points, mode, panels, out_dir / f"{prefix}{what}_vs_{x}.png")
            for mode, x in (("closed", "concurrency"), ("open", "rate"))
            for what, panels in (("latency", LATENCY), ("throughput", THROUGHPUT))]  # fmt: skip
    return [p for p in made if p is not None]


def plot_host(rows: Sequence[dict[str, Any]], parts: Sequence[str], path: Path, title: str) -> None:
    """Stacked ms per decode step by part against batch size, and the host's share of the step."""
    plt = _plt()
    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    bottom = [0.0] * len(rows)
    for part, color in zip(parts, ("#d62728", "#ff7f0e", "#1f77b4", "#2ca02c")):
        values = [1000 * r[f"{part}_s"] for r in rows]
        ax.bar(range(len(rows)), values, bottom=bottom, label=part, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set(xticks=range(len(rows)), xticklabels=[str(r["batch"]) for r in rows], xlabel="batch size (decoding requests)",
           ylabel="ms per step", yscale="log", title=title)  # fmt: skip
    ax.legend(fontsize=8)
    ax2.plot([r["batch"] for r in rows], [100 * r["host_s"] / r["total_s"] for r in rows], "o-")
    ax2.set_xscale("log", base=2)
    ax2.set(xlabel="batch size", ylabel="host share of step time, %")
    ax2.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
