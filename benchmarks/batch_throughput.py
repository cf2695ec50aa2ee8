"""`vlm-engine batch` throughput: items/s for 100 images in-process, through one server, and a plain
Transformers loop (processor + `generate`, one image at a time) over the same files and model.

The model is the tiny random Qwen2-VL test checkpoint (fp32), every answer exactly 32 tokens
(`ignore_eos` here, `min_new_tokens` there), a free-text prompt. The in-process and server runs use
`--concurrency 32`. Each time is the run alone: model loading and server start are not counted.

    .venv/bin/python benchmarks/batch_throughput.py [--images 100] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import httpx

from vlm_engine.batch import BatchOptions, run_batch
from vlm_engine.kernels.cpu_isa import cpu_flags
from testkit.checkpoints import cached_qwen2_vl
from testkit.videos import pattern

TOKENS = 32
PROMPT = "Describe this picture."


def make_images(folder: Path, n: int) -> list[Path]:
    paths = []
    for i in range(n):
        path = folder / f"img{i:03d}.png"
        pattern(64 + 8 * (i % 5), 48 + 8 * (i % 3), seed=i).save(path)
        paths.append(path)
    return paths


def in_process(model: Path, folder: Path, out: Path) -> float:
    """The run alone: the engine is built first (as the server is started first)."""
    from vlm_engine.batch.backends import EngineBackend

    backend = EngineBackend(str(model), 32, dtype="float32")
    options = BatchOptions(
        inputs=[str(folder)],
        out=str(out),
        prompt=PROMPT,
        model=str(model),
        concurrency=32,
        max_tokens=TOKENS,
        extra_body={"ignore_eos": True},
        progress=False,
    )
    start = time.perf_counter()
    run_batch(options, backend)
    return time.perf_counter() - start


def through_server(model: Path, folder: Path, out: Path, port: int = 8431) -> float:
    cmd = [
        sys.executable,
        "-m",
        "vlm_engine.cli",
        "serve",
        "--model",
        str(model),
        "--port",
        str(port),
        "--dtype",
        "float32",
    ]
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        start = time.perf_counter()
        run_batch(
            BatchOptions(
                inputs=[str(folder)],
                out=str(out),
                prompt=PROMPT,
                servers=[f"http://127.0.0.1:{port}"],
                concurrency=32,
                max_tokens=TOKENS,
                extra_body={"ignore_eos": True},
                progress=False,
            )
        )
        return time.perf_counter() - start
    finally:
        server.terminate()
        server.wait(timeout=60)


def transformers_loop(model_dir: Path, paths: list[Path]) -> float:
    import torch
    from PIL import Image
    from transformers import AutoProcessor, Qwen2VLForConditionalGeneration

    model = Qwen2VLForConditionalGeneration.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    processor = AutoProcessor.from_pretrained(str(model_dir))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": PROMPT}]}]
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    start = time.perf_counter()
    for path in paths:
        inputs = processor(text=[text], images=[Image.open(path).convert("RGB")], return_tensors="pt")
        with torch.inference_mode():
            model.generate(**inputs, max_new_tokens=TOKENS, min_new_tokens=TOKENS, do_sample=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--images", type=int, default=100)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = cached_qwen2_vl("tiny")
    isa = "avx512" if "avx512f" in cpu_flags() else "avx2"
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "images"
        folder.mkdir()
        paths = make_images(folder, args.images)
        times = {
            "in_process": in_process(model, folder, Path(tmp) / "a.jsonl"),
            "one_server": through_server(model, folder, Path(tmp) / "b.jsonl"),
            "transformers_loop": transformers_loop(model, paths),
        }
    rates = {name: args.images / seconds for name, seconds in times.items()}
    print(f"CPU {isa}, {os.cpu_count()} cores; {args.images} images, {TOKENS} tokens each, tiny Qwen2-VL fp32")
    for name, rate in rates.items():
        print(f"  {name:18s} {rate:7.2f} items/s ({times[name]:.1f} s)")
    print(f"  in-process / Transformers loop: {rates['in_process'] / rates['transformers_loop']:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"isa": isa, "seconds": times, "items_per_s": rates}, indent=2))


if __name__ == "__main__":
    main()
