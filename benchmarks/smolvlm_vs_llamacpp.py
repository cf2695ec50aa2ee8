"""Our server against llama.cpp's multimodal `llama-server` on a SmolVLM2-500M-shaped checkpoint (issue 39).

    .venv/bin/python benchmarks/smolvlm_vs_llamacpp.py                  # the timed run
    .venv/bin/python benchmarks/smolvlm_vs_llamacpp.py --smoke          # 1 request per point, 16 tokens
    .venv/bin/python benchmarks/smolvlm_vs_llamacpp.py --prepare-only   # checkpoint + GGUF files, no servers

The checkpoint is `testkit.smolvlm_checkpoints.write_smolvlm(DIR, "bench-500m")`: SmolVLM2-500M-Video-
Instruct's config (text: 32 x 960 Llama layers, 15 heads / 5 KV heads, MLP 2560, untied LM head; vision: 12 x 768
SigLIP layers, 16-px patches on 512-px tiles, pixel shuffle by 4 = 64 tokens a tile) and its processor (longest
edge resized to 2048, then split into 512-px tiles plus the global image), random weights saved in bf16, our small
local tokenizer's vocabulary (2,089 tokens instead of 49,280). Written once to --model-dir.

llama.cpp gets the same weights through its own converter (`llamacpp_convert.py`, the tree beside the llama-server
binary): the text model at `--outtype f32` (and, as other sides, bf16 / Q4_K_M), the SigLIP tower + connector as
an `--mmproj` GGUF (f32 by default: lossless from our bf16). llama.cpp tiles the image as SmolVLM's processor does
(its idefics3 preprocessor reads the longest edge from the mmproj file), so both sides count the same image tokens.

Workloads, requests, timing and the tables are those of qwen2_5_vl_vs_llamacpp.py (imported): every request a
fresh photo-like 640x480 JPEG; *placard* (the data processor: a json_schema answer of at most 64 tokens) and
*imagechat* (a question, 64 tokens, ignore_eos), closed loop at concurrency 1 and 8, each side freshly started.
A 640x480 image is 4 x 3 tiles + the global image = 13 tiles, 832 image tokens. Every row names the CPU tier.
Writes benchmarks/results/smolvlm-vs-llamacpp-<time>/.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import qwen2_5_vl_vs_llamacpp as Q  # first: its imports cap torch's ISA where asked, and it wraps client chunks
import servers
import vs_llamacpp as V

DEFAULT_MODEL_DIR = Path("/tmp/smolvlm2-bench-500m")
DEFAULT_GGUF_DIR = Path("/tmp/smolvlm2-gguf")
TEXT_TYPES = ("f32", "bf16", "Q4_K_M")
SIDE_NAMES = ("ours", *(f"llama.cpp {t} + mmproj" for t in TEXT_TYPES))


def ensure_checkpoint(model_dir: Path) -> Path:
    if not (model_dir / "config.json").exists():
        from testkit.smolvlm_checkpoints import write_smolvlm

        print(f"writing the bench-500m SmolVLM2 checkpoint to {model_dir} ...", flush=True)
        write_smolvlm(model_dir, preset="bench-500m", seed=0)
    return model_dir


def gguf_files(
    server: Path, model_dir: Path, gguf_dir: Path, text_types: list[str], mmproj_type: str
) -> dict[str, Path]:
    tree = V.llama_tree(server)
    name = model_dir.name
    files = {"mmproj": Q.convert(tree, model_dir, gguf_dir / f"{name}-mmproj-{mmproj_type}.gguf", mmproj_type, True)}
    for kind in text_types:
        if kind == "Q4_K_M":  # quantized from the lossless f32 file, as a llama.cpp user would
            f32 = Q.convert(tree, model_dir, gguf_dir / f"{name}-f32.gguf", "f32")
            files[kind] = Q.quantize(server, f32, gguf_dir / f"{name}-Q4_K_M.gguf", "Q4_K_M")
        else:
            files[kind] = Q.convert(tree, model_dir, gguf_dir / f"{name}-{kind}.gguf", kind)
    return files


# ---- the cost of a request ----------------------------------------------------------------------------------


def tile_grid(width: int, height: int, longest_edge: int, tile: int) -> tuple[int, int]:
    """(rows, cols) of SmolVLM's image splitting: the longest edge resized to `longest_edge` (aspect kept, the
    other side rounded up to even), both sides then up to whole tiles."""
    if width >= height:
        w, h = longest_edge, int(longest_edge / (width / height))
        h += h % 2
    else:
        h, w = longest_edge, int(longest_edge * (width / height))
        w += w % 2
    return math.ceil(h / tile), math.ceil(w / tile)


def request_cost(
    model_dir: Path, size: tuple[int, int], prompt_tokens: float, output_tokens: float
) -> dict[str, float]:
    """FLOPs of one request from config.json (linears and attention products; norms and activations ignored)."""
    config = json.loads((model_dir / "config.json").read_text())
    processor = json.loads((model_dir / "processor_config.json").read_text())["image_processor"]
    t, v, s = config["text_config"], config["vision_config"], int(config["scale_factor"])
    rows, cols = tile_grid(*size, processor["size"]["longest_edge"], v["image_size"])
    tiles = rows * cols + 1  # + the global image
    n = (v["image_size"] // v["patch_size"]) ** 2  # patches a tile
    h, inter = v["hidden_size"], v["intermediate_size"]
    layer = 2 * n * (4 * h * h + 2 * h * inter) + 4 * n * n * h  # q/k/v/out + MLP, QK^T and AV
    tile_flops = v["num_hidden_layers"] * layer + 2 * n * 3 * v["patch_size"] ** 2 * h
    tile_flops += 2 * (n // s**2) * (h * s * s) * t["hidden_size"]  # the connector's projection
    d = t["hidden_size"]
    kv_dim = d // t["num_attention_heads"] * t["num_key_value_heads"]
    text_layer = 2 * d * d + 2 * d * kv_dim + 3 * d * t["intermediate_size"]
    linear = t["num_hidden_layers"] * text_layer + t["vocab_size"] * d  # + the LM head
    return {
        "image_patches": tiles * n,
        "image_tokens": tiles * n // s**2,
        "vision_flops": tiles * tile_flops,
        "prefill_flops": 2 * prompt_tokens * linear + 2 * t["num_hidden_layers"] * prompt_tokens**2 * d,
        "decode_flops": 2 * output_tokens * linear,
        "text_weight_bytes_bf16": 2 * linear,
    }


# ---- sides -------------------------------------------------------------------------------------------------


def sides(args: argparse.Namespace, server: Path, files: dict[str, Path]) -> list[Q.Side]:
    slots = max(args.concurrency)
    mmproj = ("--mmproj", str(files["mmproj"]), *args.llama_arg)
    ours = servers.ServerSpec("ours", str(args.model_dir), "auto", tuple(args.server_arg), label="ours", kv_tokens=None)
    out = [Q.Side(ours, "default: 25% of MemAvailable, at most 4 GiB (bf16 K/V)")]
    for kind in TEXT_TYPES:
        if kind in files:
            spec = servers.ServerSpec(
                "llamacpp",
                str(files[kind]),
                label=f"llama.cpp {kind} + mmproj",
                kv_tokens=args.llama_ctx,
                executable=str(server),
                slots=slots,
                extra_args=mmproj,
            )
            out.append(Q.Side(spec, f"-c {args.llama_ctx} (f16 K/V), -np {slots}"))
    return [s for s in out if s.spec.name in args.sides]


# ---- CLI -----------------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="the bench-500m checkpoint")
    p.add_argument("--gguf-dir", type=Path, default=DEFAULT_GGUF_DIR)
    p.add_argument("--llama-server", default=None, help="llama-server (default: vs_llamacpp.find_llama_server)")
    p.add_argument("--mmproj-outtype", default="f32", help="the vision GGUF's --outtype (every llama.cpp side)")
    p.add_argument("--workloads", default=",".join(Q.WORKLOADS))
    p.add_argument("--sides", default=",".join(SIDE_NAMES[:3]), help="comma list of: " + ", ".join(SIDE_NAMES))
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--requests", type=Q._requests, default=None, help="requests per point (default 1:2,8:8)")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--image-size", type=Q._size, default=(640, 480))
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests per workload per server")
    p.add_argument("--warmup-tokens", type=int, default=4)
    p.add_argument(
        "--llama-ctx",
        type=int,
        default=0,
        help="llama-server -c, split over its -np slots (0: the training context, at least 2,048 a slot)",
    )
    Q.add_run_args(p, max_duration=600.0)
    args = Q.parse_lists(p.parse_args(argv))
    args.requests = args.requests or {c: max(2, c) for c in args.concurrency}
    Q.request_cost = request_cost  # the shared tables' cost lines: SmolVLM's arithmetic
    if args.render is not None:
        return Q.render(args)
    servers.install_signal_handlers()

    server = V.find_llama_server(args.llama_server)
    if server is None:
        print("llama-server not found: pass --llama-server or build it (vs_llamacpp.py --build)", file=sys.stderr)
        return 2
    ensure_checkpoint(args.model_dir)
    if args.llama_ctx <= 0:  # 8,192 over 8 slots leaves 1,024 a request: a 959-token prompt + 64 barely fit
        trained = json.loads((args.model_dir / "config.json").read_text())["text_config"]["max_position_embeddings"]
        args.llama_ctx = max(int(trained), 2048 * max(args.concurrency))
    text_types = [t for t in TEXT_TYPES if f"llama.cpp {t} + mmproj" in args.sides]
    files = gguf_files(server, args.model_dir, args.gguf_dir, text_types, args.mmproj_outtype)
    for key, path in files.items():
        print(f"{key}: {path} ({path.stat().st_size / 2**30:.2f} GiB)", flush=True)
    if args.prepare_only:
        return 0

    return Q.run_and_report(
        args,
        argv,
        server,
        files,
        lambda: sides(args, server, files),
        out_pattern="smolvlm-vs-llamacpp-%Y%m%d-%H%M%S",
        title="SmolVLM2-500M-shaped",
        script="benchmarks/smolvlm_vs_llamacpp.py",
    )


if __name__ == "__main__":
    sys.exit(main())
