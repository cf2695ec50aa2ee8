"""PNG plots of sweep results (matplotlib, headless): latency vs load and throughput vs concurrency.

Input is the `points` list that serve_bench writes: dicts with `server`, `workload`, `mode`,
`value` and `summary` (stats.Summary.to_json()).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any


def _plt() -> Any:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _grid(
    points: Sequence[dict[str, Any]], mode: str
) -> tuple[list[str], list[str], dict[tuple[str, str], list[dict[str, Any]]]]:
    """(workloads, servers, series keyed by (workload, server) sorted by load)."""
    series: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for p in points:
        if p["mode"] == mode:
            series[(p["workload"], p.get("server", "server"))].append(p)
    for pts in series.values():
        pts.sort(key=lambda p: p["value"])
    workloads = sorted({w for w, _ in series})
    servers = sorted({s for _, s in series}, key=lambda s: (s != "ours", s))
    return workloads, servers, series


def _ms(summary: dict[str, Any], metric: str, q: str) -> float:
    v = (summary.get(metric) or {}).get(q)
    return float("nan") if v is None else 1000 * v


def _figure(points: Sequence[dict[str, Any]], mode: str, panels: list[tuple[str, Any]], path: Path) -> Path | None:
    """One row per workload, one column per panel; colour = server, solid = p50, dashed = p95."""
    workloads, servers, series = _grid(points, mode)
    if not series:
        return None
    plt = _plt()
    fig, axes = plt.subplots(
        len(workloads), len(panels), figsize=(5 * len(panels), 3.4 * len(workloads)), squeeze=False
    )
    colors = {s: f"C{i}" for i, s in enumerate(servers)}
    xlabel = "concurrency (closed loop)" if mode == "closed" else "offered rate, req/s (open loop, Poisson)"
    for row, workload in enumerate(workloads):
        for col, (title, draw) in enumerate(panels):
            ax = axes[row][col]
            for server in servers:
                pts = series.get((workload, server))
                if pts:
                    draw(ax, [p["value"] for p in pts], [p["summary"] for p in pts], server, colors[server])
            ax.set_title(f"{workload}: {title}", fontsize=10)
            ax.set_xlabel(xlabel, fontsize=8)
            ax.grid(True, which="both", alpha=0.3)
            if mode == "closed":
                ax.set_xscale("log", base=2)
            ax.legend(fontsize=7)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _latency_panel(metric: str) -> Any:
    def draw(ax: Any, x: list[float], summaries: list[dict[str, Any]], server: str, color: str) -> None:
        for q, style in (("p50", "o-"), ("p95", "x--")):
            y = [_ms(s, metric, q) for s in summaries]
            if any(v > 0 for v in y if math.isfinite(v)):
                ax.plot(x, y, style, color=color, label=f"{server} {q}")
        if ax.get_lines() and all(v > 0 for line in ax.get_lines() for v in line.get_ydata() if math.isfinite(v)):
            ax.set_yscale("log")

    return draw


def _throughput_panel(key: str) -> Any:
    def draw(ax: Any, x: list[float], summaries: list[dict[str, Any]], server: str, color: str) -> None:
        ax.plot(
            x,
            [s.get(key) if s.get(key) is not None else float("nan") for s in summaries],
            "o-",
            color=color,
            label=server,
        )
        ax.set_ylim(bottom=0)

    return draw


def plot_latency(points: Sequence[dict[str, Any]], mode: str, path: Path) -> Path | None:
    """TTFT, inter-token latency and end-to-end latency (p50, p95) against load."""
    panels = [
        ("TTFT, ms", _latency_panel("ttft")),
        ("inter-token latency, ms", _latency_panel("itl")),
        ("end-to-end latency, ms", _latency_panel("e2e")),
    ]
    return _figure(points, mode, panels, path)


def plot_throughput(points: Sequence[dict[str, Any]], mode: str, path: Path) -> Path | None:
    """Request and output-token throughput against concurrency (or offered rate)."""
    panels = [
        ("requests / s", _throughput_panel("request_throughput")),
        ("output tokens / s", _throughput_panel("output_throughput")),
    ]
    return _figure(points, mode, panels, path)


def plot_all(points: Sequence[dict[str, Any]], out_dir: Path, prefix: str = "") -> list[Path]:
    made = [
        plot_latency(points, "closed", out_dir / f"{prefix}latency_vs_concurrency.png"),
        plot_latency(points, "open", out_dir / f"{prefix}latency_vs_rate.png"),
        plot_throughput(points, "closed", out_dir / f"{prefix}throughput_vs_concurrency.png"),
        plot_throughput(points, "open", out_dir / f"{prefix}throughput_vs_rate.png"),
    ]
    return [p for p in made if p is not None]
