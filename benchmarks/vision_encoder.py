"""Our Qwen2.5-VL vision tower (vlm_engine/models/qwen2_5_vl/vision.py) against Transformers' own, on a
Qwen2.5-VL-3B-shaped tower (random weights) and the pixels of Qwen2VLImageProcessor (default
min/max pixels) for a 448x448 and a 1024x768 image.

    .venv/bin/python benchmarks/vision_encoder.py                      # both images, 3 timed runs each
    .venv/bin/python benchmarks/vision_encoder.py --sizes 448x448 --repeats 1 --depth 8   # quick look
    .venv/bin/python benchmarks/vision_encoder.py --no-fp32            # skip the fp32 rows

Rows: ours (plain nn.Linear), ours with the engine's prepacked linears (`prepack_linears`, as
`registry.build_model` applies them), Transformers' tower, in the engine's default CPU dtype
(bfloat16 with avx512_bf16 / AMX, else float32); then Transformers and ours in float32. Median of
`--repeats` runs after one warm-up (and their minimum), the variants taking turns, torch threads =
`--threads` (2). ratio = time / Transformers' time in the same dtype.
"""

from __future__ import annotations

import sys

from pathlib import Path

import argparse
import gc
import statistics
import time
from collections.abc import Callable


sys.path[:0] = [str(Path(__file__).resolve().parents[1])]  # the repository root: testkit

import numpy as np
import torch
from PIL import Image

from vlm_engine.kernels.cpu_isa import has_native_bf16, tier_description

# Qwen/Qwen2.5-VL-3B-Instruct's vision_config.
CONFIG_3B = {
    "depth": 32,
    "hidden_size": 1280,
    "intermediate_size": 3420,
    "num_heads": 16,
    "out_hidden_size": 2048,
    "patch_size": 14,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "window_size": 112,
    "fullatt_block_indexes": [7, 15, 23, 31],
    "hidden_act": "silu",
    "tokens_per_second": 2,
    "in_channels": 3,
}


def vision_config(depth: int):
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    values = dict(CONFIG_3B, depth=depth)
    if depth != CONFIG_3B["depth"]:  # keep the full-attention blocks' share: every 8th block
        values["fullatt_block_indexes"] = [i for i in range(depth) if i % 8 == 7]
    cfg = Qwen2_5_VLVisionConfig(**values)
    cfg._attn_implementation = "sdpa"
    return cfg


def random_state_dict(cfg) -> dict[str, torch.Tensor]:
    """Random fp32 weights with every tensor name of the tower (std 0.02, norms ~1)."""
    from vlm_engine.models.qwen2_5_vl.vision import Qwen25VisionTower

    with torch.device("meta"):
        shapes = {k: v.shape for k, v in Qwen25VisionTower(cfg).state_dict().items()}
    g = torch.Generator().manual_seed(0)
    out = {}
    for name, shape in shapes.items():
        if "norm" in name or "ln_q" in name:
            out[name] = 1.0 + 0.05 * torch.randn(shape, generator=g)
        else:
            out[name] = 0.02 * torch.randn(shape, generator=g)
    return out


def image_inputs(size: str) -> tuple[torch.Tensor, torch.Tensor]:
    from transformers import Qwen2VLImageProcessor

    width, height = (int(v) for v in size.split("x"))
    rng = np.random.RandomState(0)
    image = Image.fromarray(rng.randint(0, 255, (height, width, 3), dtype=np.uint8))
    out = Qwen2VLImageProcessor()(images=[image], return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def theirs_tower(cfg, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.nn.Module:
    from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VisionTransformerPretrainedModel

    model = Qwen2_5_VisionTransformerPretrainedModel._from_config(cfg).eval().requires_grad_(False)
    model.load_state_dict(state, strict=True)
    return model.to(dtype)


def ours_tower(cfg, state: dict[str, torch.Tensor], dtype: torch.dtype) -> torch.nn.Module:
    from vlm_engine.models.qwen2_5_vl.vision import Qwen25VisionTower

    with torch.device("meta"):  # as the engine builds it
        model = Qwen25VisionTower(cfg)
    model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True, assign=True)
    return model.eval().requires_grad_(False)


def prepack(model: torch.nn.Module, dtype: torch.dtype) -> bool:
    """`registry.build_model`'s prepacking of a vision tower (an `encoder_modules` entry): oneDNN's
    blocked layout only, since the tower multiplies prefill-sized row counts."""
    from vlm_engine.models.prepack import prepack_linears, prepack_supported

    if not prepack_supported(torch.device("cpu"), dtype):
        return False
    prepack_linears(model)
    return True


def interleaved_times(calls: dict[str, Callable[[], object]], repeats: int) -> dict[str, tuple[float, float]]:
    """(median, min) seconds of each call, the calls taking turns (one warm-up each first): on a
    machine whose cores are shared, load that comes and goes then slows every variant alike, and
    the minimum is the run least disturbed by it."""
    for fn in calls.values():
        fn()  # warm-up: oneDNN primitives, plan caches
    times: dict[str, list[float]] = {label: [] for label in calls}
    for _ in range(repeats):
        for label, fn in calls.items():
            start = time.perf_counter()
            fn()
            times[label].append(time.perf_counter() - start)
    return {label: (statistics.median(ts), min(ts)) for label, ts in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="+", default=["448x448", "1024x768"], help="WIDTHxHEIGHT images")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--depth", type=int, default=CONFIG_3B["depth"], help="fewer blocks for a quick look")
    parser.add_argument("--no-fp32", action="store_true", help="skip the float32 rows")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    tier = tier_description()
    dtype = torch.bfloat16 if has_native_bf16() else torch.float32
    cfg = vision_config(args.depth)
    state = random_state_dict(cfg)
    inputs = {size: image_inputs(size) for size in args.sizes}
    rows: list[tuple[str, str, str, str, tuple[float, float], tuple[float, float]]] = []

    def call(model: torch.nn.Module, size: str, dt: torch.dtype, ours: bool) -> Callable[[], object]:
        pixels, grid = inputs[size][0].to(dt), inputs[size][1]

        def forward() -> object:
            with torch.inference_mode():
                return model(pixels, grid) if ours else model(pixels, grid).pooler_output

        return forward

    def record(dt: torch.dtype, variants: list[tuple[str, torch.nn.Module, bool]]) -> None:
        name = str(dt).removeprefix("torch.")
        for size in args.sizes:
            patches = f"{size} ({inputs[size][0].shape[0]} patches)"
            calls = {label: call(model, size, dt, ours) for label, model, ours in variants}
            times = interleaved_times(calls, args.repeats)
            base = times["Transformers"]
            for label, (median, least) in times.items():
                rows.append((tier, patches, name, label, (median, least), (median / base[0], least / base[1])))
                print(f"  {patches} {name} {label}: median {median * 1e3:.0f} ms, min {least * 1e3:.0f} ms", flush=True)

    variants = [("Transformers", theirs_tower(cfg, state, dtype), False), ("ours", ours_tower(cfg, state, dtype), True)]
    packed = ours_tower(cfg, state, dtype)
    if prepack(packed, dtype):
        variants.append(("ours, prepacked linears", packed, True))
    record(dtype, variants)
    del variants, packed
    gc.collect()
    if dtype != torch.float32 and not args.no_fp32:
        variants = [
            ("Transformers", theirs_tower(cfg, state, torch.float32), False),
            ("ours (bit-identical)", ours_tower(cfg, state, torch.float32), True),
        ]
        record(torch.float32, variants)

    print(f"\nQwen2.5-VL-3B vision tower (depth {args.depth}), {args.threads} threads, median of {args.repeats}\n")
    print("| CPU tier | image | dtype | tower | median ms | min ms | ratio (median) | ratio (min) |")
    print("|---|---|---|---|---:|---:|---:|---:|")
    for tier_, patches, name, label, (median, least), (ratio, ratio_min) in rows:
        print(
            f"| {tier_} | {patches} | {name} | {label} | {median * 1e3:.0f} | {least * 1e3:.0f} "
            f"| {ratio:.2f} | {ratio_min:.2f} |"
        )


if __name__ == "__main__":
    main()
