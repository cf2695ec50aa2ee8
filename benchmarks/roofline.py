"""Roofline: the machine's measured matmul FLOP/s and memory bandwidth (cached per CPU tier; `roofline.py
--refresh` re-measures), and the fraction of each a decode step reaches: benchmarks/README.md, "Metrics"."""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
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

import stats  # noqa: E402 - after the caps

RESULTS = Path(__file__).resolve().parent / "results"
# One cache file per CPU tier, so alternating native and VLM_ENGINE_ISA=avx2 runs keep both.
MACHINE_CACHE = RESULTS / "machine-{tier}.json"

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
    """Best of `repeats` after a warm-up (the first call pays allocation and kernel selection)."""
    return min(stats.timed(fn, repeats)[0])


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
    bf16_flops = measure_matmul(n16, "bfloat16", repeats)
    return MachineCeilings(fp32_flops, bf16_flops, read, copy, torch.get_num_threads(), cpu_name(), torch.__version__,
                           n32, n16 if n16 != n32 else None, isa_tier(), fp32_kernel)  # fmt: skip


def machine_ceilings(refresh: bool = False, path: Path | None = None) -> MachineCeilings:
    """Cached ceilings for this CPU / thread count / torch / tier, measured (a few s) when missing or stale."""
    import torch

    path = path or Path(str(MACHINE_CACHE).format(tier=isa_tier()))
    if not refresh and path.exists():
        try:
            cached = MachineCeilings(**json.loads(path.read_text()))
            here = (cpu_name(), torch.get_num_threads(), torch.__version__, isa_tier())
            if (cached.cpu, cached.threads, cached.torch_version, cached.isa) == here and cached.fp32_kernel:
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
            numel = math.prod(shape)
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
        layers, kv_heads = int(text["num_hidden_layers"]), int(text.get("num_key_value_heads") or heads)
        return cls(decoder, lm_head, embed, vision, layers, heads, kv_heads, head_dim)


def safetensors_shapes(model_dir: Path) -> dict[str, list[int]]:
    from safetensors import safe_open  # reads the headers only

    shapes: dict[str, list[int]] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            shapes |= {name: list(f.get_slice(name).get_shape()) for name in f.keys()}
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
    fractions = flops / machine.matmul_flops(dtype), bytes_s / machine.mem_bytes_s
    return Roofline(batch, context, step_s, dtype, flops, bytes_s, *fractions, basis)


def roofline_line(model_dir: str | Path | None, batch: float, context: float, step_s: float | None, dtype: str,
                  basis: str, machine: MachineCeilings | None = None) -> str:  # fmt: skip
    """The one-line roofline every report prints; says why when it cannot be computed."""
    if model_dir is None or step_s is None or not step_s > 0 or not batch > 0:
        return "roofline: n/a (no model directory or no decode step time measured)"
    try:
        cost = ModelCost.from_dir(model_dir)
    except (FileNotFoundError, KeyError, ValueError) as exc:
        return f"roofline: n/a ({exc})"
    return roofline(cost, machine or machine_ceilings(), batch, context, step_s, dtype, basis).line()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--refresh", action="store_true", help="re-measure the machine ceilings")
    print(machine_ceilings(refresh=p.parse_args(argv).refresh).describe())
    return 0


if __name__ == "__main__":
    sys.exit(main())
