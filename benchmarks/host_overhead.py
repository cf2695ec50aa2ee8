"""Host overhead per scheduler step against batch size, with the model forward timed separately,
so "the scheduler is the bottleneck" can be checked, not guessed.

    .venv/bin/python benchmarks/host_overhead.py                         # SmolLM2, bf16, batch 1..256
    .venv/bin/python benchmarks/host_overhead.py --model qwen2-vl-bench --max-batch 64 --steps 5
    .venv/bin/python benchmarks/host_overhead.py --schema nested_invoice --batches 1,32,64   # + grammar masks

For each batch size B (1, 2, 4, ... --max-batch) it admits B requests, runs their prefill, then
times decode steps split into: `scheduler.schedule()`, `runner.prepare_inputs()` (host-side input
building, timed on its own), the forward (`runner.execute()` minus input building: embeddings,
decoder, LM head, sampling), token application (`scheduler.update()`, grammar matchers) and output
building (detokenisation). With `--schema NAME` (from testkit.json_schemas) every
request is constrained by that JSON schema and two more columns appear: the grammar-mask time
per step (built on a host thread while the forward runs) and the part of it the step waited for
after the forward (the only part on the critical path). Writes JSON and a PNG (stacked time per
step vs batch size) to benchmarks/results/<time>-host/.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Sibling modules and the repository root (testkit) when run by path.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

import roofline as R

RESULTS = Path(__file__).resolve().parent / "results"
PARTS = ("schedule_s", "prepare_s", "forward_s", "update_s", "outputs_s")
MASK_PARTS = ("mask_s", "mask_wait_s")


@dataclass(frozen=True)
class StepTiming:
    batch: int
    schedule_s: float
    prepare_s: float
    forward_s: float  # execute() minus prepare_inputs(): model forward + sampling
    update_s: float
    outputs_s: float
    mask_s: float = 0.0  # grammar masks, on their own thread during the forward (not added to total)
    mask_wait_s: float = 0.0  # of forward_s: waiting for the masks after the forward

    @property
    def host_s(self) -> float:
        return self.schedule_s + self.prepare_s + self.update_s + self.outputs_s

    @property
    def total_s(self) -> float:
        return self.host_s + self.forward_s


def batch_sizes(max_batch: int) -> list[int]:
    sizes, b = [], 1
    while b <= max_batch:
        sizes.append(b)
        b *= 2
    if sizes[-1] != max_batch:
        sizes.append(max_batch)
    return sizes


def timed_step(engine: Any) -> StepTiming | None:
    """One `Engine.step()`: the engine's own step clock, with input building split out of the forward."""
    step = engine.step_tokens()
    if step is None:
        return None
    t0 = time.perf_counter()
    for request, tokens in step.tokens:
        engine._on_tokens(request, tokens)
    outputs = time.perf_counter() - t0
    s = step.stats
    prepare = engine.runner.last_prepare_s
    forward = max(s.forward_s - prepare, 0.0)
    return StepTiming(len(step.plan.chunks), s.schedule_s, prepare, forward, s.update_s, outputs, s.mask_s, s.mask_wait_s)


def measure_batch(
    engine: Any, batch: int, prompt_tokens: int, steps: int, warmup: int, schema: dict[str, Any] | None = None
) -> list[StepTiming]:
    from vlm_engine import SamplingParams

    vocab = max(int(getattr(engine.tokenizer, "vocab_size", 1000)) - 1, 2)
    if schema is None:
        params = SamplingParams(max_tokens=warmup + steps + 8, temperature=0.0, ignore_eos=True)
    else:
        # A budget far beyond the measured steps keeps the closer (which forces the JSON to finish
        # near max_tokens) out of the measurement: this measures plain masked decoding.
        params = SamplingParams(max_tokens=2048, temperature=0.0, ignore_eos=True, json_schema=schema)
    ids = []
    for i in range(batch):
        # Distinct prompts: no prefix-cache sharing between requests.
        ids.append(engine.add_request([(11 + 7919 * i + 31 * j) % vocab + 1 for j in range(prompt_tokens)], params))
    while engine.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running
    ):
        timed_step(engine)
    timings = []
    for k in range(warmup + steps):
        t = timed_step(engine)
        if t is not None and k >= warmup and t.batch == batch:
            timings.append(t)
    for rid in ids:
        engine.abort(rid)
    return timings


def median_timing(batch: int, timings: list[StepTiming]) -> StepTiming:
    return StepTiming(batch, *(statistics.median(getattr(t, p) for t in timings) for p in PARTS + MASK_PARTS))


def plot(rows: list[StepTiming], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax2) = plt.subplots(1, 2, figsize=(12, 4.2))
    x = list(range(len(rows)))
    bottom = [0.0] * len(rows)
    for part, color in zip(PARTS, ("#d62728", "#ff7f0e", "#1f77b4", "#2ca02c", "#9467bd")):
        vals = [1000 * getattr(r, part) for r in rows]
        ax.bar(x, vals, bottom=bottom, label=part.removesuffix("_s"), color=color)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_xticks(x, [str(r.batch) for r in rows])
    ax.set_xlabel("batch size (decoding requests)")
    ax.set_ylabel("ms per step")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend(fontsize=8)
    ax2.plot([r.batch for r in rows], [100 * r.host_s / r.total_s for r in rows], "o-")
    ax2.set_xscale("log", base=2)
    ax2.set_xlabel("batch size")
    ax2.set_ylabel("host share of step time, %")
    ax2.grid(True, alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2", help="smollm2, qwen2-vl-bench, qwen2-vl-tiny or a model dir")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--max-batch", type=int, default=256)
    p.add_argument("--batches", default=None, help="comma-separated batch sizes instead of 1, 2, 4 ... --max-batch")
    p.add_argument("--schema", default=None, help="constrain every request by this schema from json_schemas.SCHEMAS")
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--steps", type=int, default=5, help="timed decode steps per batch size (median reported)")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--attention-backend", default="auto")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)

    from vlm_engine import Engine

    model_dir = R.resolve_model_dir(args.model)
    sizes = [int(b) for b in args.batches.split(",")] if args.batches else batch_sizes(args.max_batch)
    args.max_batch = max(sizes)
    schema = None
    if args.schema:
        from testkit.json_schemas import SCHEMAS

        schema = SCHEMAS[args.schema]
    engine = Engine(
        model_dir,
        dtype=args.dtype,
        max_num_seqs=args.max_batch,
        max_num_batched_tokens=max(2048, args.prompt_tokens * 16),
        kv_cache_tokens=args.max_batch * (args.prompt_tokens + args.warmup + args.steps + 64) + 4096,
        attention_backend=args.attention_backend,
    )
    machine = R.machine_ceilings()
    dtype = str(engine.dtype).replace("torch.", "")
    rows: list[StepTiming] = []
    lines = []
    # Throwaway pass: the first steps pay one-off costs (kernel JIT/loading, allocator growth).
    measure_batch(engine, min(4, args.max_batch), args.prompt_tokens, 2, 1, schema)
    mask_head = f" {'mask':>9} {'mask wait':>9} {'mask %':>7}" if schema else ""
    print(
        f"{'batch':>5} {'schedule':>9} {'prepare':>9} {'forward':>9} {'update':>9} {'outputs':>9} {'host %':>7}"
        f"{mask_head}  (ms per step)"
    )
    for b in sizes:
        timings = measure_batch(engine, b, args.prompt_tokens, args.steps, args.warmup, schema)
        if not timings:
            print(f"{b:>5}  no full-batch decode step measured (KV pool too small?)")
            continue
        m = median_timing(b, timings)
        rows.append(m)
        context = args.prompt_tokens + args.warmup + args.steps / 2
        line = R.roofline_line(model_dir, b, context, m.forward_s, dtype, "forward only", machine)
        lines.append(line)
        print(
            f"{b:>5} "
            + " ".join(f"{1000 * getattr(m, k):9.3f}" for k in PARTS)
            + f" {100 * m.host_s / m.total_s:6.1f}%"
            + (f" {1000 * m.mask_s:9.3f} {1000 * m.mask_wait_s:9.3f} {100 * m.mask_s / m.total_s:6.1f}%" if schema else "")
        )
        print(f"{'':>6}{line}")
    out = args.out or RESULTS / f"{time.strftime('%Y%m%d-%H%M%S')}-host"
    out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {
        "config": {**vars(args), "out": str(out), "model_dir": model_dir, "dtype": dtype},
        "machine": asdict(machine),
        "rows": [{**asdict(r), "host_s": r.host_s, "total_s": r.total_s} for r in rows],
        "roofline": lines,
    }
    (out / "host_overhead.json").write_text(json.dumps(result, indent=1))
    if rows:
        plot(rows, out / "host_overhead.png", f"{Path(model_dir).name} {dtype}: time per decode step")
    print(machine.describe())
    print(f"wrote {out}/host_overhead.json and host_overhead.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
