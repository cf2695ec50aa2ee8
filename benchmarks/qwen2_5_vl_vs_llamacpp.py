"""Our server against llama.cpp's multimodal `llama-server` on a Qwen2.5-VL-3B-shaped checkpoint (issue 38).

    .venv/bin/python benchmarks/qwen2_5_vl_vs_llamacpp.py                  # the timed run (~21 min on 2 cores)
    .venv/bin/python benchmarks/qwen2_5_vl_vs_llamacpp.py --smoke          # 1 request per point, short
    .venv/bin/python benchmarks/qwen2_5_vl_vs_llamacpp.py --prepare-only   # checkpoint + GGUF files, no servers

The checkpoint is `testkit.qwen_vl_checkpoints.write_qwen2_5_vl(DIR, "bench-3b")`: Qwen2.5-VL-3B-
Instruct's config (36 x 2048 text layers, GQA 16:2, the 32-block window-attention vision tower) with random
weights saved in bfloat16 and our small local tokenizer's vocabulary (2,048 tokens, so the tied embedding is
~4M parameters instead of ~311M). It is written once to --model-dir (default /tmp/q25vl-bench-3b).

llama.cpp gets the same weights through its own converter (`llamacpp_convert.py`, the tree beside the
llama-server binary that vs_llamacpp.py finds or builds): the text model at `--outtype bf16` (our dtype), the
vision tower + merger as an `--mmproj` GGUF (bf16 too), and the bf16 text GGUF quantized to Q4_K_M with that
tree's `llama-quantize` (what a llama.cpp user runs); both llama.cpp sides load the same mmproj. The GGUF files
are cached in --gguf-dir (default /tmp/q25vl-gguf).

Workloads, each request a FRESH photo-like 640x480 JPEG (smooth gradients, blurred shapes, sensor noise; seeded
by the request index, so every server sees byte-identical requests and no request repeats another's image):

- placard: the data processor — apps/placard's curator prompt and its `response_format` json_schema
  (title / date_or_period / medium / description), 64 output tokens at most, greedy, streamed. A schema's
  grammar may end the answer before 64 tokens: mean output tokens are reported per side.
- imagechat: an image and a question, 64 output tokens (`ignore_eos`), greedy, streamed.

Closed loop at concurrency 1 and 8; every point starts at a fresh request index. Sides, each freshly
started and stopped: ours (`vlm-engine serve --model DIR`, its defaults), llama.cpp bf16 text + mmproj,
llama.cpp Q4_K_M text + mmproj (`-np 8 -t <cores> --cont-batching`, -c --llama-ctx). Reported per point:
requests/s (first send to last completion), TTFT p50, mean prompt/output tokens; per server: RSS after start-up
and the peak RSS of its process tree (sampled every 0.2 s with psutil, and the sum of each process's VmHWM).
Every row names the CPU tier (cpu_isa.isa_tier). Writes benchmarks/results/q25vl-vs-llamacpp-<time>/.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: vs_llamacpp imports roofline, which caps torch's ISA under VLM_ENGINE_ISA=avx2 before torch loads.
import client as C
import roofline as R
import servers
import stats as S
import vs_llamacpp as V
from workloads import BenchRequest, data_uri

from vlm_engine.kernels.cpu_isa import cpu_flags, isa_tier

RESULTS = Path(__file__).resolve().parent / "results"
DEFAULT_MODEL_DIR = Path("/tmp/q25vl-bench-3b")
DEFAULT_GGUF_DIR = Path("/tmp/q25vl-gguf")
WARMUP_INDEX = 900_000  # warm-up requests: their own images, never a measured one
WORKLOADS = ("placard", "imagechat")
SEED_BASE = {"placard": 0, "imagechat": 500_000}  # image seeds: no image is sent by both workloads

# apps/placard/static/placard.js: PLACARD_SCHEMA and PROMPT, as the page sends them.
PLACARD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "date_or_period": {"type": "string", "maxLength": 40},
        "medium": {"type": "string", "maxLength": 40},
        "description": {"type": "string", "maxLength": 240},
    },
    "required": ["title", "date_or_period", "medium", "description"],
    "additionalProperties": False,
}
PLACARD_PROMPT = (
    "You are a museum curator. Write the placard for this picture as JSON: a title of a few words "
    "naming what it shows, a date or period, the medium, and a description of two sentences saying "
    "what the picture shows."
)
QUESTIONS = (
    "What is in this photo? Describe the scene in detail.",
    "Which objects can you see in this picture, and where are they?",
    "Describe the colors and the lighting of this photo.",
    "What is the main subject of this picture, and what is around it?",
)


# ---- requests ----------------------------------------------------------------------------------------------


@lru_cache(maxsize=32)
def photo_jpeg(seed: int, width: int = 640, height: int = 480) -> bytes:
    """A photo-like picture as JPEG bytes (quality 85): a sky-to-ground gradient, low-frequency light,
    blurred shapes and per-pixel sensor noise, so it compresses like a photo (~60-100 KB at 640x480) and
    not like flat synthetic art. Different seed, different picture; same seed, same bytes."""
    import numpy as np
    from PIL import Image, ImageDraw, ImageFilter

    rng = np.random.default_rng(seed)
    y = np.linspace(0.0, 1.0, height)[:, None, None]
    x = np.linspace(0.0, 1.0, width)[None, :, None]
    top, bottom = rng.uniform(60, 230, 3), rng.uniform(20, 200, 3)
    horizon = rng.uniform(0.3, 0.7)
    sky = top + (bottom - top) * np.clip(y / horizon, 0, 1) * 0.5
    ground = bottom * (0.6 + 0.4 * (y - horizon) / (1 - horizon))
    img = np.where(y < horizon, sky, ground) + np.zeros((height, width, 3))
    for _ in range(6):  # soft light and shade
        fx, fy, phase = rng.uniform(0.5, 4.0), rng.uniform(0.5, 4.0), rng.uniform(0, 2 * np.pi)
        img += rng.uniform(5, 20) * np.sin(2 * np.pi * (fx * x + fy * y) + phase) * rng.uniform(0.5, 1.0, 3)
    pic = Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")
    shapes = Image.new("RGBA", (width, height), (0, 0, 0, 0))
    draw = ImageDraw.Draw(shapes)
    for _ in range(int(rng.integers(5, 10))):
        cx, cy = rng.uniform(0, width), rng.uniform(height * 0.2, height)
        w, h = rng.uniform(20, width / 3), rng.uniform(20, height / 3)
        color = (*(int(c) for c in rng.integers(0, 256, 3)), int(rng.integers(160, 256)))
        box = (cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2)
        if rng.random() < 0.5:
            draw.ellipse(box, fill=color)
        else:
            pts = [(cx + w / 2 * math.cos(a), cy + h / 2 * math.sin(a)) for a in np.sort(rng.uniform(0, 6.3, 5))]
            draw.polygon(pts, fill=color)
    shapes = shapes.filter(ImageFilter.GaussianBlur(float(rng.uniform(1.0, 3.0))))
    pic.paste(shapes, (0, 0), shapes)
    arr = np.asarray(pic).astype(np.float64) + rng.normal(0.0, 5.0, (height, width, 3))
    buf = io.BytesIO()
    Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB").save(buf, format="JPEG", quality=85)
    return buf.getvalue()


def build_request(workload: str, index: int, model: str | None, max_tokens: int, size: tuple[int, int]) -> BenchRequest:
    """The index-th request of a workload: a fresh photo, the workload's text, greedy, streamed."""
    seed = SEED_BASE[workload] + index
    image = {"type": "image_url", "image_url": {"url": data_uri(photo_jpeg(seed, *size), "image/jpeg")}}
    payload: dict[str, Any] = {
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if workload == "placard":
        text = PLACARD_PROMPT
        payload["response_format"] = {
            "type": "json_schema",
            "json_schema": {"name": "placard", "strict": True, "schema": PLACARD_SCHEMA},
        }
    else:
        text = QUESTIONS[index % len(QUESTIONS)]
        payload["ignore_eos"] = True  # both servers accept it: exactly max_tokens tokens
    payload["messages"] = [{"role": "user", "content": [image, {"type": "text", "text": text}]}]
    if model is not None:
        payload["model"] = model
    return BenchRequest(index, payload, max_tokens, f"image:{seed}")


# ---- the first chunk of an answer -------------------------------------------------------------------------
#
# TTFT in client.py is the first chunk that carries text. llama-server holds back the whitespace its json_schema
# grammar lets a model emit before and inside the JSON (a random model emits a lot: some answers are 64 tokens of
# blanks), so for the placard that time can be late or missing. Both servers also send a first chunk with
# `delta.role`: ours with the first token, llama-server when the prompt (image included) has been processed,
# one decode step before its first token. That time is recorded too, as `first_chunk_s` on each record.

_apply_chunk = C._apply_chunk


def _apply_chunk_noting_first(record: C.RequestRecord, chunk: dict[str, Any], now: float) -> None:
    if chunk.get("choices") and getattr(record, "first_chunk_s", None) is None:
        record.first_chunk_s = now  # type: ignore[attr-defined]
    if isinstance(chunk.get("timings"), dict):  # llama-server's own: prompt_ms (image included), predicted_ms
        record.server_timings = chunk["timings"]  # type: ignore[attr-defined]
    _apply_chunk(record, chunk, now)


C._apply_chunk = _apply_chunk_noting_first


def first_chunk_latency(record: C.RequestRecord) -> float | None:
    at = getattr(record, "first_chunk_s", None)
    return None if at is None or not record.ok else at - record.start_s


# ---- memory of a server's process tree ---------------------------------------------------------------------


@dataclass
class RssSampler:
    """Samples the RSS of a process and all its descendants every `period_s` in a thread: the peak of their
    sum, and each process's own high-water mark (VmHWM, the kernel's peak RSS of that process)."""

    pid: int
    period_s: float = 0.2
    peak_bytes: int = 0
    hwm_bytes: dict[int, int] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def sample(self) -> int:
        import psutil

        try:
            root = psutil.Process(self.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.Error:
            return 0
        total = 0
        for proc in procs:
            try:
                total += proc.memory_info().rss
                self.hwm_bytes[proc.pid] = max(self.hwm_bytes.get(proc.pid, 0), vm_hwm(proc.pid))
                self.names.setdefault(proc.pid, proc.name())
            except (psutil.Error, OSError):
                continue
        self.peak_bytes = max(self.peak_bytes, total)
        return total

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self.sample()

    def start(self) -> RssSampler:
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self.sample()
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    @property
    def hwm_sum_bytes(self) -> int:
        return sum(self.hwm_bytes.values())


def vm_hwm(pid: int) -> int:
    """/proc/PID/status VmHWM in bytes (0 if the process is gone)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


# ---- the checkpoint and the GGUF files ---------------------------------------------------------------------


def ensure_checkpoint(model_dir: Path) -> Path:
    if not (model_dir / "config.json").exists():
        from testkit.qwen_vl_checkpoints import write_qwen2_5_vl

        print(f"writing the bench-3b Qwen2.5-VL checkpoint to {model_dir} ...", flush=True)
        write_qwen2_5_vl(model_dir, preset="bench-3b", seed=0)
    return model_dir


def convert(tree: Path, model_dir: Path, out: Path, outtype: str, mmproj: bool = False) -> Path:
    """llama.cpp's converter (through llamacpp_convert.py's widenings) into `out`, unless it exists."""
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".partial")
        wrapper = Path(__file__).resolve().parent / "llamacpp_convert.py"
        cmd = [
            sys.executable,
            str(wrapper),
            str(tree),
            "--",
            str(model_dir),
            "--outtype",
            outtype,
            "--outfile",
            str(tmp),
        ]
        t0 = time.monotonic()
        subprocess.run(cmd + (["--mmproj"] if mmproj else []), check=True, stdout=subprocess.DEVNULL)
        tmp.rename(out)
        print(f"converted {out.name} in {time.monotonic() - t0:.0f} s", flush=True)
    return out


def quantize(server: Path, src: Path, out: Path, qtype: str) -> Path:
    """`llama-quantize SRC OUT QTYPE` from the same build as llama-server, unless `out` exists."""
    if not out.exists():
        tool = server.parent / "llama-quantize"
        if not tool.exists():
            raise FileNotFoundError(f"{tool} missing: cmake --build build --target llama-quantize")
        tmp = out.with_suffix(".partial")
        t0 = time.monotonic()
        threads = str(os.cpu_count() or 2)
        subprocess.run([str(tool), str(src), str(tmp), qtype, threads], check=True, stdout=subprocess.DEVNULL)
        tmp.rename(out)
        print(f"quantized {out.name} in {time.monotonic() - t0:.0f} s", flush=True)
    return out


def gguf_files(server: Path, model_dir: Path, gguf_dir: Path, mmproj_type: str) -> dict[str, Path]:
    tree = V.llama_tree(server)
    name = model_dir.name
    bf16 = convert(tree, model_dir, gguf_dir / f"{name}-bf16.gguf", "bf16")
    mmproj = convert(tree, model_dir, gguf_dir / f"{name}-mmproj-{mmproj_type}.gguf", mmproj_type, mmproj=True)
    q4 = quantize(server, bf16, gguf_dir / f"{name}-Q4_K_M.gguf", "Q4_K_M")
    return {"bf16": bf16, "mmproj": mmproj, "Q4_K_M": q4}


# ---- the cost of a request ----------------------------------------------------------------------------------


def smart_resize(height: int, width: int, factor: int = 28) -> tuple[int, int]:
    """Qwen2-VL's image processor rounding (within the bench-3b preset's pixel bounds)."""
    return max(factor, round(height / factor) * factor), max(factor, round(width / factor) * factor)


def request_cost(
    model_dir: Path, size: tuple[int, int], prompt_tokens: float, output_tokens: float
) -> dict[str, float]:
    """FLOPs of one request from config.json: the vision tower (linears, full and windowed attention, the
    merger), the text prefill (linears + causal attention) and the decode's linears; and the bytes of
    bf16 text weights one decode step streams."""
    config = json.loads((model_dir / "config.json").read_text())
    v, t = config["vision_config"], config.get("text_config") or config
    h, inter, merge, patch = v["hidden_size"], v["intermediate_size"], v["spatial_merge_size"], v["patch_size"]
    rh, rw = smart_resize(size[1], size[0], patch * merge)
    n = (rh // patch) * (rw // patch)  # patches of one frame pair
    window = (v["window_size"] // patch) ** 2  # patches per attention window
    full = len(v["fullatt_block_indexes"])
    block = 4 * h * h + 3 * h * inter  # qkv + proj + gated MLP
    merged = h * merge * merge
    vision = 2 * n * (v["depth"] * block + 3 * 2 * patch * patch * h)  # + the 3D patch embedding
    vision += 2 * (n // (merge * merge)) * (merged * merged + merged * v["out_hidden_size"])
    vision += 4 * n * h * (full * n + (v["depth"] - full) * window)
    d, kv_dim = t["hidden_size"], t["hidden_size"] // t["num_attention_heads"] * t["num_key_value_heads"]
    layer = 2 * d * d + 2 * d * kv_dim + 3 * d * t["intermediate_size"]
    linear = t["num_hidden_layers"] * layer + t["vocab_size"] * d
    prefill = 2 * prompt_tokens * linear + 2 * t["num_hidden_layers"] * prompt_tokens**2 * d
    decode = 2 * output_tokens * linear
    return {
        "image_patches": n,
        "image_tokens": n // (merge * merge),
        "vision_flops": vision,
        "prefill_flops": prefill,
        "decode_flops": decode,
        "text_weight_bytes_bf16": 2 * linear,
    }


# ---- running -----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Side:
    spec: servers.ServerSpec
    kv_note: str


def sides(args: argparse.Namespace, server: Path, files: dict[str, Path]) -> list[Side]:
    slots = max(args.concurrency)
    mmproj = ("--mmproj", str(files["mmproj"]), *args.llama_arg)
    ours = servers.ServerSpec("ours", str(args.model_dir), "auto", tuple(args.server_arg), label="ours", kv_tokens=None)
    kv = "default: 25% of MemAvailable, at most 4 GiB (bf16 K/V)"
    out = [Side(ours, kv)]
    for key in ("bf16", "Q4_K_M"):
        spec = servers.ServerSpec(
            "llamacpp",
            str(files[key]),
            label=f"llama.cpp {key} + mmproj",
            kv_tokens=args.llama_ctx,
            executable=str(server),
            slots=slots,
            extra_args=mmproj,
        )
        out.append(Side(spec, f"-c {args.llama_ctx} (f16 K/V), -np {slots}"))
    plain = ("--no-prepack-weights", *args.server_arg)
    unpacked = servers.ServerSpec("ours", str(args.model_dir), "auto", plain, label=SIDE_NAMES[3], kv_tokens=None)
    out.append(Side(unpacked, kv))
    return [s for s in out if s.spec.name in args.sides]


def run_side(side: Side, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """One freshly started server: warm-up, then every workload at every concurrency; RSS throughout."""
    spec = side.spec
    result: dict[str, Any] = {"server": spec.name, "command": None, "kv": side.kv_note, "points": []}
    sent = 0
    try:
        with servers.ManagedServer(spec, out / "logs", startup_timeout_s=args.startup_timeout) as server:
            assert server.proc is not None
            result["command"] = " ".join(spec.command(server.port))
            sampler = RssSampler(server.proc.pid).start()
            result["startup_s"] = server.startup_s
            result["rss_after_start_bytes"] = sampler.sample()
            print(f"{spec.name}: up in {server.startup_s:.0f} s, RSS {result['rss_after_start_bytes'] / 2**30:.2f} GiB")
            model = C.served_model_id(server.base_url)
            url = server.base_url + "/v1/chat/completions"
            try:
                for workload in args.workloads:  # warm-up: each workload's path once (its own images)
                    for k in range(args.warmup):
                        req = build_request(workload, WARMUP_INDEX + k, model, args.warmup_tokens, args.image_size)
                        w = warm_up(url, req, args.request_timeout)
                        result.setdefault("warmup", []).append({"workload": workload, **w})
                        status = f"FAILED: {w['error']}" if w["error"] else f"{w['text']!r}"
                        print(f"  {spec.name:>26} warm-up {workload}: {w['seconds']:.1f} s {status}", flush=True)
                for workload in args.workloads:
                    for c in args.concurrency:
                        n = args.requests[c]
                        point = C.LoadPoint("closed", c, n, args.max_duration, args.request_timeout)

                        def build(i: int, w: str = workload) -> BenchRequest:
                            return build_request(w, i, model, args.output_tokens, args.image_size)

                        records, duration = asyncio.run(C.run_point(url, build, point, first_index=sent))
                        summary = S.summarize(records, duration)
                        first = S.Dist.of([x for x in map(first_chunk_latency, records) if x is not None])
                        print(f"  {spec.name:>26} {S.one_line(f'{workload} c={c}', summary)}", flush=True)
                        timings = [t for r in records if (t := getattr(r, "server_timings", None))]
                        server_line = ""
                        if timings:
                            prompt_ms = sum(t.get("prompt_ms", 0.0) for t in timings) / len(timings)
                            step_ms = sum(t.get("predicted_per_token_ms", 0.0) for t in timings) / len(timings)
                            server_line = f"; server: prompt {prompt_ms:,.0f} ms, {step_ms:,.0f} ms per output token"
                        print(f"  {'':>26} first chunk p50 {S.fmt_ms(first.p50)} ms{server_line}", flush=True)
                        result["points"].append(
                            {
                                "workload": workload,
                                "concurrency": c,
                                "first_index": sent,
                                "summary": {**summary.to_json(), "first_chunk": asdict(first)},
                                "records": [
                                    {
                                        **r.to_json(),
                                        "first_chunk": first_chunk_latency(r),
                                        "server_timings": getattr(r, "server_timings", None),
                                    }
                                    for r in records
                                ],
                            }
                        )
                        sent += n
            finally:
                sampler.stop()
                result["kv_log"] = kv_log_line(server.log_tail(200_000))
                result["peak_rss_bytes"] = sampler.peak_bytes
                result["hwm_sum_bytes"] = sampler.hwm_sum_bytes
                result["processes"] = {
                    f"{sampler.names.get(pid, '?')}[{pid}]": hwm for pid, hwm in sampler.hwm_bytes.items()
                }
    except Exception as exc:  # noqa: BLE001 - one failed server must not lose the others' rows
        print(f"{spec.name} failed: {type(exc).__name__}: {exc}", flush=True)
        result["error"] = f"{type(exc).__name__}: {exc}"[:1000]
    return result


def kv_log_line(log: str) -> str:
    """What the server's log says about its KV cache: ours' `N KV pages x T tokens`, llama.cpp's slots."""
    import re

    found = re.search(r"(\d+) KV pages x (\d+) tokens", log)
    if found:
        return f"{int(found[1]) * int(found[2]):,} tokens"
    found = re.search(r"n_slots = (\d+), n_ctx_slot = (\d+)", log)
    if found:
        return f"{found[1]} slots x {int(found[2]):,} tokens"
    return "?"


def warm_up(url: str, req: BenchRequest, timeout_s: float) -> dict[str, Any]:
    """One unmeasured request, not streamed, so its text is kept (the placard's shows the grammar at work)."""
    import httpx

    payload = {k: v for k, v in req.payload.items() if k not in ("stream", "stream_options")}
    t0 = time.monotonic()
    try:
        r = httpx.post(url, json=payload, timeout=timeout_s)
        body = r.json() if r.headers.get("content-type", "").startswith("application/json") else {}
        text = (body.get("choices") or [{}])[0].get("message", {}).get("content") if r.status_code == 200 else None
        error = None if r.status_code == 200 else f"HTTP {r.status_code}: {r.text[:300]}"
    except (httpx.HTTPError, ValueError) as exc:
        text, error, body = None, f"{type(exc).__name__}: {exc}"[:300], {}
    return {"seconds": time.monotonic() - t0, "text": text, "error": error, "usage": body.get("usage")}


# ---- the tables ----------------------------------------------------------------------------------------------


def _summary(results: list[dict[str, Any]], name: str, workload: str, c: int) -> dict[str, Any] | None:
    for r in results:
        if r["server"] == name:
            for p in r["points"]:
                if p["workload"] == workload and p["concurrency"] == c:
                    return p["summary"]
    return None


def _num(summary: dict[str, Any] | None, *keys: str) -> float:
    tree: Any = summary or {}
    for k in keys:
        tree = tree.get(k) if isinstance(tree, dict) else None
    return float(tree) if isinstance(tree, (int, float)) else float("nan")


def _f(x: float, digits: int = 3, scale: float = 1.0) -> str:
    return "—" if not math.isfinite(x) else f"{x * scale:,.{digits}f}"


def tables(results: list[dict[str, Any]], args: argparse.Namespace, tier: str, machine: R.MachineCeilings) -> list[str]:
    names = [r["server"] for r in results]
    ours, peers = names[0], names[1:]
    head = ["workload", "conc.", "CPU tier", *(f"{n} req/s" for n in names), *(f"{ours} / {p}" for p in peers)]
    head += ["TTFT p50 s (first text)", "first chunk p50 s", "out tokens (mean)", "prompt tokens (mean)", "ok / sent"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for workload in args.workloads:
        for c in args.concurrency:
            got = [_summary(results, n, workload, c) for n in names]
            rps = [_num(g, "request_throughput") for g in got]
            ratios = [rps[0] / x if x > 0 and math.isfinite(rps[0]) else float("nan") for x in rps[1:]]
            cells = [workload, str(c), tier, *(_f(x) for x in rps)]
            cells += ["—" if not math.isfinite(r) else f"**{r:.2f}x**" for r in ratios]
            cells.append(" / ".join(_f(_num(g, "ttft", "p50"), 1) for g in got))
            cells.append(" / ".join(_f(_num(g, "first_chunk", "p50"), 1) for g in got))
            cells.append(" / ".join(_f(_num(g, "mean_output_tokens"), 1) for g in got))
            cells.append(" / ".join(_f(_num(g, "mean_prompt_tokens"), 0) for g in got))
            cells.append(
                " / ".join(f"{int(_num(g, 'num_ok'))}/{int(_num(g, 'num_requests'))}" if g else "—" for g in got)
            )
            rows.append("| " + " | ".join(cells) + " |")
    rows += ["", "| server | CPU tier | KV | start-up s | RSS after start GiB | peak RSS (tree) GiB | Σ VmHWM GiB |"]
    rows.append("|---|---|---|---|---|---|---|")
    for r in results:
        gib = [r.get(k, float("nan")) / 2**30 for k in ("rss_after_start_bytes", "peak_rss_bytes", "hwm_sum_bytes")]
        kv = f"{r['kv']}; log: {r.get('kv_log', '?')}"
        cells = [r["server"], tier, kv, _f(r.get("startup_s", float("nan")), 0), *(_f(g, 2) for g in gib)]
        rows.append("| " + " | ".join(cells) + " |")
    rows += ["", *cost_lines(results, args, machine), ""]
    return rows


def cost_lines(results: list[dict[str, Any]], args: argparse.Namespace, machine: R.MachineCeilings) -> list[str]:
    """What one request of each workload costs, and the measured rates in GFLOP/s against the bf16 ceiling
    (`finished` counts requests that ran to their end with an error event, as llama-server's placard ones can)."""
    names = [r["server"] for r in results]
    flops = machine.matmul_bf16_flops
    rows = [machine.describe() + ".", ""]
    for workload in args.workloads:
        got = [_summary(results, n, workload, c) for n in names for c in args.concurrency]
        p = next((x for x in (_num(g, "mean_prompt_tokens") for g in got) if math.isfinite(x)), float("nan"))
        if not math.isfinite(p):
            continue
        cost = request_cost(args.model_dir, args.image_size, p, args.output_tokens)
        compute = cost["vision_flops"] + cost["prefill_flops"] + cost["decode_flops"]
        rows.append(
            f"- {workload}: {cost['image_patches']:.0f} patches -> {cost['image_tokens']:.0f} image tokens, {p:.0f}"
            f" prompt tokens, {args.output_tokens} output: vision {cost['vision_flops'] / 1e12:.2f} TFLOP"
            f" ({cost['vision_flops'] / flops:.1f} s at the bf16 ceiling), prefill {cost['prefill_flops'] / 1e12:.2f}"
            f" TFLOP ({cost['prefill_flops'] / flops:.1f} s), decode linears {cost['decode_flops'] / 1e12:.2f} TFLOP;"
            f" {compute / 1e12:.2f} TFLOP in all ({compute / flops:.1f} s); batch-1 decode streams"
            f" {cost['text_weight_bytes_bf16'] / 1e9:.2f} GB of bf16 text weights a token"
            f" ({args.output_tokens * cost['text_weight_bytes_bf16'] / machine.mem_read_bytes_s:.1f} s a request at"
            " the measured read bandwidth)."
        )
        for c in args.concurrency:
            cells = []
            for n in names:
                g = _summary(results, n, workload, c)
                rps, duration = _num(g, "request_throughput"), _num(g, "duration_s")
                finished = _num(g, "num_requests") / duration if duration > 0 else float("nan")
                if math.isfinite(rps):
                    extra = f" ({finished * compute / 1e9:.0f} finished)" if finished > rps * 1.001 else ""
                    cells.append(f"{n} {rps * compute / 1e9:.0f}{extra}")
            rows.append(f"  - c={c}, GFLOP/s (req/s x {compute / 1e12:.2f} TFLOP): " + ", ".join(cells))
    return rows


def report(results: list[dict[str, Any]], args: argparse.Namespace, head: list[str], machine: R.MachineCeilings) -> str:
    """table.md: `head` (title, command, machine, files), the tables, the costs and the errors."""
    tier = isa_tier()
    lines = [
        *head,
        (
            f"Requests per point: {args.requests}; {args.output_tokens} output tokens at most; a fresh"
            f" {args.image_size[0]}x{args.image_size[1]} JPEG per request. req/s = ok requests / (first send to last"
            " completion); TTFT = the first chunk with text; first chunk = the first chunk with a delta (ours: with"
            " the first token; llama-server: when the prompt is processed, one decode step before its first token)."
        ),
        "",
        *tables(results, args, tier, machine),
        "",
    ]
    errors = [f"- {r['server']}: {r['error']}" for r in results if "error" in r]
    errors += [
        f"- {r['server']} {p['workload']} c={p['concurrency']}: {p['summary']['errors']}"
        for r in results
        for p in r["points"]
        if p["summary"]["errors"]
    ]
    lines += ["Errors:", *errors, ""] if errors else []
    return "\n".join(lines)


# ---- CLI -------------------------------------------------------------------------------------------------------


def _requests(text: str) -> dict[int, int]:
    """'1:2,8:8' -> {1: 2, 8: 8}: requests per concurrency point."""
    pairs = (item.split(":") for item in text.split(",") if item.strip())
    return {int(c): int(n) for c, n in pairs}


def _size(text: str) -> tuple[int, int]:
    w, _, h = text.lower().partition("x")
    return int(w), int(h)


def add_run_args(p: argparse.ArgumentParser, *, max_duration: float) -> None:
    """The flags after --llama-ctx that every `*_vs_llamacpp` multimodal bench shares."""
    p.add_argument("--llama-arg", action="append", default=[], help="extra llama-server argument (repeatable)")
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for our server (repeatable)")
    p.add_argument(
        "--max-duration", type=float, default=max_duration, help="per point: no new requests after this many s"
    )
    p.add_argument("--request-timeout", type=float, default=900.0)
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--smoke", action="store_true", help="one request per point, 16 output tokens")
    p.add_argument("--prepare-only", action="store_true", help="write the checkpoint and GGUF files, then stop")
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--render", type=Path, default=None, help="rewrite DIR/table.md from DIR/results.json, no run")


def parse_lists(args: argparse.Namespace) -> argparse.Namespace:
    """Split the comma lists; --smoke: one request per point and 16 output tokens unless given."""
    args.workloads = [w for w in args.workloads.split(",") if w]
    args.sides = [s for s in args.sides.split(",") if s]
    args.concurrency = [int(c) for c in args.concurrency.split(",")]
    if args.smoke:
        args.requests = args.requests or {c: 1 for c in args.concurrency}
        args.output_tokens = 16 if args.output_tokens == 64 else args.output_tokens
    return args


def render(args: argparse.Namespace) -> int:
    """--render DIR: rewrite DIR/table.md from DIR/results.json, keeping its head."""
    saved = json.loads((args.render / "results.json").read_text())
    old_head = (args.render / "table.md").read_text().split("\nRequests per point:")[0].splitlines() + [""]
    (args.render / "table.md").write_text(report(saved["results"], args, old_head, R.machine_ceilings()))
    print((args.render / "table.md").read_text())
    return 0


def run_and_report(
    args: argparse.Namespace,
    argv: list[str] | None,
    server: Path,
    files: dict[str, Path],
    make_sides: Callable[[], Iterable[Side]],
    *,
    out_pattern: str,
    title: str,
    script: str,
) -> int:
    """Run every side, write DIR/results.json after each and DIR/table.md at the end; 1 if any request failed."""
    tier = isa_tier()
    machine = R.machine_ceilings()
    out = args.out or RESULTS / time.strftime(out_pattern)
    out.mkdir(parents=True, exist_ok=True)
    print(f"CPU tier {tier}; {machine.describe()}\nllama-server {server}", flush=True)
    started = time.strftime("%Y-%m-%d %H:%M")
    results: list[dict[str, Any]] = []
    for side in make_sides():
        results.append(run_side(side, args, out))
        (out / "results.json").write_text(json.dumps({"results": results}, indent=1))

    flags = " ".join(sorted(cpu_flags() & {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}))
    head = [
        f"# vlm-engine vs llama.cpp, {title} — {started} to {time.strftime('%H:%M')}",
        "",
        f"Command: `.venv/bin/python {script} {' '.join(argv or sys.argv[1:])}`",
        "",
        f"CPU tier **{tier}** (flags: {flags}); llama-server {server}; files: "
        + ", ".join(f"{k} {v.name} ({v.stat().st_size / 2**30:.2f} GiB)" for k, v in files.items()),
        "",
    ]
    text = report(results, args, head, machine)
    (out / "table.md").write_text(text)
    (out / "results.json").write_text(
        json.dumps({"results": results, "tier": tier, "argv": argv or sys.argv[1:]}, indent=1)
    )
    print(text)
    print(f"wrote {out}/table.md and results.json")
    return 1 if "Errors:" in text else 0


# The last is not run by default: ours with plain nn.Linear weights (one copy of each instead of two packed ones).
SIDE_NAMES = ("ours", "llama.cpp bf16 + mmproj", "llama.cpp Q4_K_M + mmproj", "ours no-prepack")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--model-dir", type=Path, default=DEFAULT_MODEL_DIR, help="the bench-3b checkpoint (made if missing)"
    )
    p.add_argument("--gguf-dir", type=Path, default=DEFAULT_GGUF_DIR)
    p.add_argument("--llama-server", default=None, help="llama-server (default: vs_llamacpp.find_llama_server)")
    p.add_argument("--mmproj-outtype", default="bf16", help="the vision GGUF's --outtype (both llama.cpp sides)")
    p.add_argument("--workloads", default=",".join(WORKLOADS))
    p.add_argument("--sides", default=",".join(SIDE_NAMES[:3]), help="comma list of: " + ", ".join(SIDE_NAMES))
    p.add_argument("--concurrency", default="1,8")
    p.add_argument("--requests", type=_requests, default=None, help="requests per point (default 1:1,8:8)")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--image-size", type=_size, default=(640, 480))
    p.add_argument("--warmup", type=int, default=1, help="unmeasured requests per workload per server")
    p.add_argument("--warmup-tokens", type=int, default=4, help="their max_tokens (vision + prefill + grammar)")
    p.add_argument(
        "--llama-ctx",
        type=int,
        default=0,
        help="llama-server -c, split over its -np slots (0: its own default, the model's training context)",
    )
    add_run_args(p, max_duration=400.0)
    args = parse_lists(p.parse_args(argv))
    args.requests = args.requests or {c: c for c in args.concurrency}  # one request per slot: ~25 min in all
    if args.render is not None:
        return render(args)
    servers.install_signal_handlers()

    server = V.find_llama_server(args.llama_server)
    if server is None:
        print("llama-server not found: pass --llama-server or build it (vs_llamacpp.py --build)", file=sys.stderr)
        return 2
    ensure_checkpoint(args.model_dir)
    if args.llama_ctx <= 0:  # what llama-server's -c 0 loads; servers.ServerSpec always passes a number
        config = json.loads((args.model_dir / "config.json").read_text())
        args.llama_ctx = int((config.get("text_config") or config)["max_position_embeddings"])
    files = gguf_files(server, args.model_dir, args.gguf_dir, args.mmproj_outtype)
    for key, path in files.items():
        print(f"{key}: {path} ({path.stat().st_size / 2**30:.2f} GiB)", flush=True)
    if args.prepare_only:
        return 0

    return run_and_report(
        args,
        argv,
        server,
        files,
        lambda: sides(args, server, files),
        out_pattern="q25vl-vs-llamacpp-%Y%m%d-%H%M%S",
        title="Qwen2.5-VL-3B-shaped",
        script="benchmarks/qwen2_5_vl_vs_llamacpp.py",
    )


if __name__ == "__main__":
    sys.exit(main())
