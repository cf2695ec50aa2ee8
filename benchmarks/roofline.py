"""Roofline: the machine's measured matmul FLOP/s and memory bandwidth, and what fraction of each
the engine reaches during decode.

    .venv/bin/python benchmarks/roofline.py                       # measure (or show cached) ceilings
    .venv/bin/python benchmarks/roofline.py --refresh             # re-measure
    .venv/bin/python benchmarks/roofline.py --engine smollm2 --dtype bfloat16 --batch 64 --context 512
        # in-process Engine decode at batch 64: the issue's ">= 60% of matmul FLOP/s" check

Arithmetic (decode, one step at batch B, mean context L):
    FLOPs/token  = 2 * (decoder linear params + LM head params) + 4 * layers * q_heads * head_dim * L
    bytes/step   = (decoder linear + LM head) weight bytes + B * L * KV bytes/token
Embedding lookups and the vision tower are excluded (decode does not run them). The engine's
fraction = (B * FLOPs/token / step time) / matmul FLOP/s, and (bytes/step / step time) / bandwidth.
Other scripts call `roofline_line(...)` so every report carries this line.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import struct
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# VLM_ENGINE_ISA=avx2 (our kernels built and chosen for AVX2 + FMA) caps torch's own libraries
# too, before torch first runs here or in the servers started from here: ATen's dispatch, oneDNN
# and MKL (torch's BLAS, behind the fp32 matmul ceiling). Without the caps an AVX-512 CPU would
# measure (and cache) its AVX-512 ceilings as the AVX2 tier's.
AVX2_CAPS = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"}
if os.environ.get("VLM_ENGINE_ISA") == "avx2":
    for _name, _value in AVX2_CAPS.items():
        os.environ.setdefault(_name, _value)

# Sibling modules and the repository root (testkit) when run by path.
sys.path[:0] = [str(Path(__file__).resolve().parent), str(Path(__file__).resolve().parents[1])]

RESULTS = Path(__file__).resolve().parent / "results"
# One cache file per CPU tier, so alternating native and VLM_ENGINE_ISA=avx2 runs keep both.
MACHINE_CACHE = RESULTS / "machine-{tier}.json"

_DTYPE_BYTES = {"F32": 4, "BF16": 2, "F16": 2, "F64": 8, "I64": 8, "I32": 4, "I8": 1, "U8": 1}


# ---- machine ceilings ------------------------------------------------------------------------------


@dataclass(frozen=True)
class MachineCeilings:
    matmul_fp32_flops: float
    matmul_bf16_flops: float
    mem_read_bytes_s: float  # streaming read (tensor.sum)
    mem_copy_bytes_s: float  # read + write (copy_), counted as 2x bytes
    threads: int
    cpu: str
    torch_version: str
    matmul_n: int  # the fp32 matmul's size
    matmul_bf16_n: int | None = None  # the bf16 one's, when smaller (None: matmul_n; see matmul_size)
    # The CPU tier torch and our kernels ran at (cpu_isa.isa_tier): VLM_ENGINE_ISA=avx2 with
    # ATEN_CPU_CAPABILITY / ONEDNN_MAX_CPU_ISA / MKL_ENABLE_INSTRUCTIONS capped makes an AVX-512
    # CPU an AVX2 one, whose ceilings are its own.
    isa: str = ""
    # Which GEMM gave the fp32 ceiling ("mkl" or "onednn"); empty in caches written before both
    # were measured, which are re-measured.
    fp32_kernel: str = ""

    @property
    def mem_bytes_s(self) -> float:
        """The bandwidth fractions are taken against: the better of the two streaming measures."""
        return max(self.mem_read_bytes_s, self.mem_copy_bytes_s)

    def matmul_flops(self, dtype: str) -> float:
        return self.matmul_bf16_flops if dtype in ("bfloat16", "float16", "bf16") else self.matmul_fp32_flops

    def describe(self) -> str:
        bf16_n = self.matmul_bf16_n or self.matmul_n
        bf16_size = f" ({bf16_n}^3)" if bf16_n != self.matmul_n else ""
        if self.isa and not self.isa.endswith("_bf16"):  # a number, but not one the engine runs at
            bf16_size += ", emulated: no bf16 dot products at this tier"
        return (
            f"machine: matmul {self.matmul_n}^3 {self.matmul_fp32_flops / 1e9:.0f} GFLOP/s fp32 ({self.fp32_kernel or '?'}), "
            f"{self.matmul_bf16_flops / 1e9:.0f} GFLOP/s bf16{bf16_size}; "
            f"memory read {self.mem_read_bytes_s / 1e9:.1f} GB/s, "
            f"copy {self.mem_copy_bytes_s / 1e9:.1f} GB/s ({self.threads} threads, {self.cpu}, tier {self.isa or '?'})"
        )


def isa_tier() -> str:
    from vlm_engine.kernels.cpu_isa import isa_tier as tier

    return tier()


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _best_time(fn: Any, repeats: int) -> float:
    fn()  # warm-up: first call pays allocation and kernel selection
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def matmul_size(n: int = 2048, dtype: str = "float32", max_call_s: float = 1.0, min_n: int = 256) -> int:
    """n, halved (down to min_n) until one n^3 matmul is expected to take at most max_call_s.

    A dtype the CPU has no fast kernel for is orders of magnitude slower than fp32: bf16 on a CPU
    without avx512_bf16/AMX ran at ~0.3-1 GFLOP/s (fp32: ~140) on a 2-core EPYC, so one 2048^3
    bf16 matmul took 20-50 s and the 6 calls of a measurement ~5 minutes. The expectation comes
    from a timed min_n^3 call (after a warm-up one), scaled by n^3.
    """
    import torch

    m = min(n, min_n)
    dt = getattr(torch, dtype)
    a, b = torch.randn(m, m, dtype=dt), torch.randn(m, m, dtype=dt)
    per_flop = _best_time(lambda: torch.matmul(a, b), 1) / m**3
    while n > min_n and per_flop * n**3 > max_call_s:
        n //= 2
    return max(n, m)


def measure_matmul(n: int = 2048, dtype: str = "float32", repeats: int = 5) -> float:
    import torch

    dt = getattr(torch, dtype)
    a, b = torch.randn(n, n, dtype=dt), torch.randn(n, n, dtype=dt)
    out = torch.empty(n, n, dtype=dt)
    return 2 * n**3 / _best_time(lambda: torch.matmul(a, b, out=out), repeats)


def measure_fp32_matmul(n: int = 2048, repeats: int = 5) -> tuple[float, str]:
    """The better of torch.matmul's fp32 GEMM (MKL) and oneDNN's on a prepacked weight, and which.

    MKL's sgemm runs its AVX2 code on AMD CPUs: on the 2-core Zen 5 it made 171 GFLOP/s at 2048^3
    where oneDNN made 416, and our AVX-512 panel kernel ~440 at prefill shapes, so MKL alone put
    the fp32 ceiling below what the engine reaches."""
    import torch

    best, kernel = measure_matmul(n, "float32", repeats), "mkl"
    if torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"):
        a, b = torch.randn(n, n), torch.randn(n, n)
        packed = torch.ops.mkldnn._reorder_linear_weight(b, n)
        onednn = lambda: torch.ops.mkldnn._linear_pointwise(a, packed, None, "none", [], "")
        flops = 2 * n**3 / _best_time(onednn, repeats)
        if flops > best:
            best, kernel = flops, "onednn"
    return best, kernel


def measure_bandwidth(mbytes: int = 512, repeats: int = 5) -> tuple[float, float]:
    """(read bytes/s, copy bytes/s) over a tensor far larger than the last-level cache."""
    import torch

    n = mbytes * 2**20 // 4
    x = torch.ones(n, dtype=torch.float32)
    y = torch.empty_like(x)
    read = x.numel() * 4 / _best_time(lambda: x.sum(), repeats)
    copy = 2 * x.numel() * 4 / _best_time(lambda: y.copy_(x), repeats)
    return read, copy


def measure_machine(n: int = 2048, repeats: int = 5, max_call_s: float = 1.0) -> MachineCeilings:
    """Each matmul size is capped so that one call takes about max_call_s at most (matmul_size)."""
    import torch

    read, copy = measure_bandwidth(repeats=repeats)
    n32, n16 = matmul_size(n, "float32", max_call_s), matmul_size(n, "bfloat16", max_call_s)
    fp32_flops, fp32_kernel = measure_fp32_matmul(n32, repeats)
    return MachineCeilings(
        matmul_fp32_flops=fp32_flops,
        matmul_bf16_flops=measure_matmul(n16, "bfloat16", repeats),
        mem_read_bytes_s=read,
        mem_copy_bytes_s=copy,
        threads=torch.get_num_threads(),
        cpu=cpu_name(),
        torch_version=torch.__version__,
        matmul_n=n32,
        matmul_bf16_n=n16 if n16 != n32 else None,
        isa=isa_tier(),
        fp32_kernel=fp32_kernel,
    )


def machine_ceilings(refresh: bool = False, path: Path | None = None) -> MachineCeilings:
    """Cached ceilings for this CPU / thread count / torch / tier, measured (a few s) when missing or stale."""
    import torch

    path = path or Path(str(MACHINE_CACHE).format(tier=isa_tier()))

    if not refresh and path.exists():
        try:
            cached = MachineCeilings(**json.loads(path.read_text()))
            if (cached.cpu, cached.threads, cached.torch_version, cached.isa) == (
                cpu_name(),
                torch.get_num_threads(),
                torch.__version__,
                isa_tier(),
            ) and cached.fp32_kernel:
                return cached
        except (TypeError, ValueError):
            pass
    ceilings = measure_machine()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(asdict(ceilings), indent=2))
    return ceilings


# ---- model cost --------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelCost:
    """Decode-relevant sizes of a checkpoint, read from config.json and safetensors headers only."""

    decoder_params: int  # linear/norm weights of the text decoder layers
    lm_head_params: int  # vocab x hidden (the tied embedding when there is no separate head)
    embed_params: int
    vision_params: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @property
    def decode_params(self) -> int:
        return self.decoder_params + self.lm_head_params

    def flops_per_token(self, context: float) -> float:
        return 2.0 * self.decode_params + 4.0 * self.num_layers * self.num_heads * self.head_dim * context

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * dtype_bytes

    def bytes_per_step(
        self, batch: int, context: float, dtype_bytes: int, weight_bytes: tuple[float, float] | None = None
    ) -> float:
        """Weights once plus every sequence's KV; `weight_bytes` (decoder, LM head) per weight where
        the weights are stored narrower than the activations, else `dtype_bytes` as the KV."""
        decoder, head = weight_bytes or (dtype_bytes, dtype_bytes)
        weights = self.decoder_params * decoder + self.lm_head_params * head
        return weights + batch * context * self.kv_bytes_per_token(dtype_bytes)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> ModelCost:
        model_dir = Path(model_dir)
        config = json.loads((model_dir / "config.json").read_text())
        text = config.get("text_config") or config
        shapes = safetensors_shapes(model_dir)
        decoder = lm_head = embed = vision = 0
        for name, shape in shapes.items():
            numel = 1
            for d in shape:
                numel *= d
            if "visual" in name or "vision" in name:
                vision += numel
            elif "embed_tokens" in name:
                embed += numel
            elif name.startswith("lm_head"):
                lm_head += numel
            else:
                decoder += numel
        if lm_head == 0:  # tied: the LM head matmul still runs, over the embedding matrix
            lm_head = embed
        heads = int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or text["hidden_size"] // heads)
        return cls(
            decoder,
            lm_head,
            embed,
            vision,
            int(text["num_hidden_layers"]),
            heads,
            int(text.get("num_key_value_heads") or heads),
            head_dim,
        )


def safetensors_shapes(model_dir: Path) -> dict[str, list[int]]:
    shapes: dict[str, list[int]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, info in header.items():
            if name != "__metadata__":
                shapes[name] = list(info["shape"])
    if not shapes:
        raise FileNotFoundError(f"no safetensors files in {model_dir}")
    return shapes


# ---- achieved fraction ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Roofline:
    batch: float
    context: float
    step_s: float
    dtype: str
    achieved_flops: float
    achieved_bytes_s: float
    flops_fraction: float
    bandwidth_fraction: float
    basis: str  # where step_s came from

    def line(self) -> str:
        return (
            f"roofline: {100 * self.flops_fraction:.0f}% of matmul FLOP/s ({self.achieved_flops / 1e9:.1f} GFLOP/s {self.dtype}), "
            f"{100 * self.bandwidth_fraction:.0f}% of memory bandwidth ({self.achieved_bytes_s / 1e9:.1f} GB/s) "
            f"at batch {self.batch:.0f}, context {self.context:.0f}, step {1000 * self.step_s:.1f} ms [{self.basis}]"
            + self.warning
        )

    @property
    def warning(self) -> str:
        # Above a ceiling means the time used is not a real decode step, e.g. a server that
        # delivered most tokens in one burst makes the client-side TPOT near zero.
        if self.flops_fraction > 1 or self.bandwidth_fraction > 1:
            return " (IMPLAUSIBLE: above the machine's ceiling, so this step time is not a decode step)"
        return ""


# Bytes per weight (decoder, LM head) of the runs whose weights are stored narrower than their fp32
# activations: the weight-only schemes (llama.cpp's Q4_1 files and our int4 keep the LM head in
# Q8_0, 34 bytes per 32 weights; Q4_1 20), and BF16_WEIGHTS, what dtype="auto" runs on a CPU
# without bf16 dot products (fp32 activations on bf16 weights). KV counts as fp32, and the FLOP
# share is against the fp32 matmul ceiling (no integer one is measured).
BF16_WEIGHTS = "float32/bf16-weights"
NARROW_WEIGHT_BYTES = {"int4": (20 / 32, 34 / 32), "int8": (34 / 32, 34 / 32), BF16_WEIGHTS: (2, 2)}


def roofline(
    cost: ModelCost, machine: MachineCeilings, batch: float, context: float, step_s: float, dtype: str, basis: str
) -> Roofline:
    narrow = NARROW_WEIGHT_BYTES.get(dtype)
    dtype_bytes = 4 if dtype in ("float32", "fp32") or narrow else 2
    flops = batch * cost.flops_per_token(context) / step_s
    bytes_s = cost.bytes_per_step(round(batch), context, dtype_bytes, narrow) / step_s
    return Roofline(
        batch,
        context,
        step_s,
        dtype,
        flops,
        bytes_s,
        flops / machine.matmul_flops(dtype),
        bytes_s / machine.mem_bytes_s,
        basis,
    )


def roofline_line(
    model_dir: str | Path | None,
    batch: float,
    context: float,
    step_s: float | None,
    dtype: str,
    basis: str,
    machine: MachineCeilings | None = None,
) -> str:
    """The one-line roofline every report prints; says why when it cannot be computed."""
    if model_dir is None or step_s is None or not step_s > 0 or not batch > 0:
        return "roofline: n/a (no model directory or no decode step time measured)"
    try:
        cost = ModelCost.from_dir(model_dir)
    except (FileNotFoundError, KeyError, ValueError) as exc:
        return f"roofline: n/a ({exc})"
    return roofline(cost, machine or machine_ceilings(), batch, context, step_s, dtype, basis).line()


# ---- in-process engine decode -----------------------------------------------------------------------------


def engine_decode_step(
    model: str, dtype: str, batch: int, context: int, steps: int = 8, attention_backend: str = "auto"
) -> dict[str, Any]:
    """Median decode step (whole `engine.step()` and forward alone) at `batch` sequences of about
    `context` tokens, measured in-process after every sequence has finished its prefill."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    from vlm_engine import Engine, SamplingParams

    max_batched = max(2048, context + 16)
    # Early-admitted sequences decode while later ones are still in prefill: give every sequence
    # enough tokens that none finishes during the measured steps (all of them must be full batches).
    prefill_steps = -(-batch * context // max_batched)
    max_tokens = prefill_steps + steps + 8
    engine = Engine(
        model,
        dtype=dtype,
        max_num_seqs=batch,
        max_num_batched_tokens=max_batched,
        kv_cache_tokens=batch * (context + max_tokens) + 1024,
        attention_backend=attention_backend,
    )
    vocab = engine.tokenizer.vocab_size if hasattr(engine.tokenizer, "vocab_size") else 1000
    # Throwaway decode steps first: the first ones pay one-off costs (kernel loading, allocator).
    engine.generate(
        [[5 + j for j in range(32)]] * min(batch, 4), SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    )
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i in range(batch):
        # Distinct token ids per sequence: no prefix-cache sharing, every sequence pays its own KV.
        ids = [(7 + i * 131 + j * 17) % max(vocab - 1, 2) + 1 for j in range(context)]
        engine.add_request(ids, params)
    while (
        any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running) or engine.scheduler.waiting
    ):
        engine.step()
    totals, forwards, batch_sizes = [], [], []
    for _ in range(steps):
        t = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - t)
        forwards.append(engine.last_step.forward_s)
        batch_sizes.append(engine.last_step.num_seqs)
    if any(n != batch for n in batch_sizes):
        raise RuntimeError(f"measured steps ran {batch_sizes} sequences, not {batch} each")
    totals.sort()
    forwards.sort()
    return {
        "model_dir": str(engine.source.directory),
        "dtype": BF16_WEIGHTS if engine.bf16_weights else str(engine.dtype).replace("torch.", ""),
        "batch": batch,
        "context": context + (prefill_steps - 1) / 2 + steps / 2,  # mean KV length while measured
        "step_s": totals[len(totals) // 2],
        "forward_s": forwards[len(forwards) // 2],
        "batch_sizes": batch_sizes,
    }


def resolve_model_dir(name: str) -> str:
    """A models.MODELS alias -> the cached checkpoint directory; else as is."""
    import models

    return str(models.model_dir(name))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--refresh", action="store_true", help="re-measure the machine ceilings")
    p.add_argument(
        "--engine", default=None, help="also time in-process decode: smollm2, qwen2-vl-bench, or a model dir"
    )
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--context", type=int, default=256, help="prompt tokens per sequence before decode")
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--json", type=Path, default=None, help="write the result here")
    args = p.parse_args(argv)

    machine = machine_ceilings(refresh=args.refresh)
    print(machine.describe())
    result: dict[str, Any] = {"machine": asdict(machine)}
    if args.engine:
        model_dir = resolve_model_dir(args.engine)
        m = engine_decode_step(model_dir, args.dtype, args.batch, args.context, args.steps)
        cost = ModelCost.from_dir(m["model_dir"])
        for key in ("step_s", "forward_s"):
            if m[key]:
                r = roofline(cost, machine, m["batch"], m["context"], m[key], m["dtype"], f"in-process engine, {key}")
                print(r.line())
                result[key] = asdict(r)
        result["engine"] = m
        result["cost"] = asdict(cost)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
