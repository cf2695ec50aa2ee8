"""Time of all SmolLM2-135M linears of one decode step under the weight-only int4 / int8 kernels
(and the fp32 and bf16 panels for comparison), at a few row counts, with every layer's weights
distinct so that they stream from memory as in a real step.

    .venv/bin/python benchmarks/quant_linears.py                   # rows 1, 2, 4, 16
    .venv/bin/python benchmarks/quant_linears.py --rows 1 --source /tmp/old_fused_ops.cpp   # another kernel build

Prints ms per step and the effective GB/s of weight bytes (codes + scales) per row count.
"""

from __future__ import annotations

import sys

import argparse
import time
from pathlib import Path

import torch


sys.path[:0] = [str(Path(__file__).resolve().parents[1])]  # the repository root: testkit

from vlm_engine.kernels.cpu_isa import tier_description

HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152
# Per layer: fused qkv (9 query + 3 + 3 kv heads of 64), o, fused gate|up, down.
LAYER_SHAPES = [(HIDDEN + 2 * 192, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)]


def load_ops(source: Path | None):
    if source is None:
        from vlm_engine.models.fused_ops import load_fused_ops

        return load_fused_ops()
    from vlm_engine.kernels.build import build_extension

    return build_extension(f"bench_{source.stem}", source)


def step_linears(ops, scheme: str) -> tuple[list, int]:
    """Callables x -> y for every linear of a step (LM head last), and their weight bytes."""
    g = torch.Generator().manual_seed(0)
    calls, nbytes = [], 0
    shapes = LAYER_SHAPES * LAYERS + [(VOCAB, HIDDEN)]
    for i, (n, k) in enumerate(shapes):
        w = torch.randn(n, k, generator=g) * 0.05
        lm_head = i == len(shapes) - 1
        if scheme in ("int4", "int8"):
            bits = 8 if scheme == "int8" or lm_head else 4
            codes, scales = ops.quantize_panels(w, bits)
            calls.append(lambda x, c=codes, s=scales, n=n, b=bits: ops.quant_panel_linear(x, c, s, n, b))
            nbytes += codes.numel() + scales.numel() * 2
        else:
            dtype = torch.float32 if scheme == "fp32" else torch.bfloat16
            panels = ops.pack_panels(w.to(dtype))
            calls.append(lambda x, p=panels, n=n, t=dtype: ops.panel_linear(x.to(t), p, n))
            nbytes += panels.numel() * panels.element_size()
    return calls, nbytes


def time_step(calls, rows: int, repeats: int) -> float:
    xs = {k: torch.randn(rows, k) for k in (HIDDEN, INTERMEDIATE)}
    inputs = [xs[INTERMEDIATE] if i % 4 == 3 and i < len(calls) - 1 else xs[HIDDEN] for i in range(len(calls))]
    for f, x in zip(calls, inputs):  # warm-up
        f(x)
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        for f, x in zip(calls, inputs):
            f(x)
        best = min(best, time.perf_counter() - t)
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--schemes", default="int4,int8,bf16,fp32")
    p.add_argument("--rows", default="1,2,4,16")
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--source", type=Path, help="build the kernels from this fused_ops.cpp instead of the package's")
    args = p.parse_args()
    ops = load_ops(args.source)
    print(f"CPU tier {tier_description()}, {torch.get_num_threads()} threads; best of {args.repeats} steps")
    for scheme in args.schemes.split(","):
        calls, nbytes = step_linears(ops, scheme)
        for rows in (int(r) for r in args.rows.split(",")):
            s = time_step(calls, rows, args.repeats)
            print(
                f"{scheme:5s} rows {rows:3d}: {s * 1e3:7.2f} ms/step  {nbytes / s / 1e9:6.1f} GB/s of weights ({nbytes / 2**20:.0f} MiB)"
            )


if __name__ == "__main__":
    main()
