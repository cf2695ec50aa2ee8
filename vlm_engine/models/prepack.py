"""Prepacked linear layers on CPU (bf16 and fp32), used in "fast" numerics.

bf16: oneDNN reorders a plain [out, in] weight into its blocked layout on every call; doing it
once at load time made bf16 linears 1.15-2x faster at decode batch sizes on the 2-core Zen 4 EPYC
(576->49,152 at M=16: 6.0 ms -> 3.0 ms; 1,536->8,960 at M=64: 4.9 ms -> 4.3 ms), bit-identical.

bf16 at a few rows (the batch-1 decode) is a pure weight stream, and oneDNN's packed bf16 kernel
streamed SmolLM2's decoder weights at only ~11 GB/s at M=1 on that machine (47 GB/s measured):
up to `BF16_PANEL_MAX_ROWS` rows the fused-ops panel kernel runs instead (bf16 panels widened to
fp32 in registers, fp32 FMAs, one rounding to bf16; AVX2 + FMA, so it needs no bf16 instructions).
With `weight_layouts="two"` such a linear keeps both layouts (twice the bf16 weight memory) and
hands products above those rows to oneDNN; with "one" (the default, see "Weight layouts" below)
the panels take every row count.

bf16 on a CPU with bf16 dot products (AVX-512 BF16): up to `BF16_DOT_MAX_ROWS` rows (AMX: fewer, below) the
vdpbf16ps kernel of `bf16_dot_gemm` runs instead of both: it prefetches the next weights while it
multiplies, where oneDNN's kernel waits for them. All SmolLM2 linears of a step, weights cycling
through memory, on the 2-core Zen 5, ms, oneDNN packed (panels at M <= 4) vs the dot kernel:
M=1 7.2 vs 6.8, M=4 9.9 vs 6.4, M=16 12.7 vs 7.4, M=64 27.6 vs 21.1, M=128 and 256 level, M=512+
oneDNN ~5-9% ahead (it keeps prefill-sized products). Two engines in one process, steps
interleaved: batch 1 level (linears 5.0 ms a step either way), batch 16 19.9 -> 14.2 ms a step.
With AMX (Sapphire Rapids) oneDNN's bf16 GEMM runs on tiles and the dot kernel keeps only the
fewest rows (`bf16_dot_max_rows`): the same step's linears on a 2-core Sapphire Rapids, ms, dot
kernel vs oneDNN (AMX): M=1 10.7 vs 14.5, M=4 12.7 vs 14.9, M=6 13.9 vs 14.8, M=8 15.3 vs 14.8,
M=16 23.4 vs 14.9, M=64 84.3 vs 20.5, M=256 339 vs 42.6 (oneDNN streams the weights up to ~16
rows, then computes at 0.8-1.6 TFLOP/s; the dot kernel tops out at ~200 GFLOP/s). Between the two,
from 7 to `BF16_AMX_MAX_ROWS` rows, the same pairs go through our own AMX tiles (`amx_linear`),
which prefetch the next weights as the dot kernel does: per SmolLM2 decoder layer (its four
linears, weights from memory) on the 2-core Sapphire Rapids, ms, oneDNN vs our tiles: M=8 0.34 vs
0.25, M=16 0.34 vs 0.22, M=64 0.44 vs 0.36, M=128 0.61-0.65 vs 0.53-0.56, M=192 0.69 vs 0.94.
GatedMLP's gate/up projection keeps its pairs in `pack_gate_up`'s order instead, and
`PackedLinear.silu_and_mul` applies SiLU-and-mul in that kernel's epilogue (bit-identical to the
linear and then fused_ops' op; ~1 ms of a batch-64 step: the [T, 2I] product is never written).

fp32: the fused-ops extension's panel kernel (`pack_panels` / `panel_linear`, 16-row panels,
AVX2+FMA) where it is vectorised, else oneDNN's packed fp32 kernel. On Zen 3, all SmolLM2 linears
of a step: F.linear 51 / 118 / 243 ms at M = 1 / 16 / 64, oneDNN packed 31 / 47-56 / 127-153,
panels 21 / 36 / 103. Both sum in another order than Transformers' F.linear (the bf16 panels also
in another order than oneDNN's), so linears are packed only in fast numerics; "exact" keeps
Transformers' ops. On AVX-512 CPUs the panel kernel runs the same sums in 16-lane vectors (bit-
identical to the AVX2 build): on a 2-core Zen 5, the same step at M = 16 / 64 took 20 / 49 ms
against 33 / 93 with 8-lane vectors, and prefill-sized products match oneDNN's AVX-512 kernel.

fp32 with bf16 weights (`bf16_weights`, what `dtype="auto"` runs on a CPU without bf16 dot
products): the fp32 model's linears keep fp32 activations and sums but store their weights as
bf16 panels, rounded once at load: half the bytes to stream. All SmolLM2 linears of a step on the
Sapphire Rapids forced to AVX2, fp32 vs bf16 panels: M=1 24.3 vs 14.8 ms, M=16 47.4 vs 37.2, M=64
110.4 vs 100.8 (benchmarks/inproc.py linears).

Weight layouts (`weight_layouts`, issue 49): by default ("one") every linear is held once, in the
layout of its decode kernel, which then takes every row count: bf16 on the dot kernel's pairs (on
an AMX CPU the dot kernel up to its rows and our AMX tiles above, on the same pairs), bf16 without
bf16 dot products on panels, fp32 on panels or oneDNN's layout (fp32 never kept two). The decode
sizes run exactly the kernels they ran with two layouts; only prefill-sized products change kernel.
On the 2-core Zen 4 (AVX-512 + avx512_bf16, no AMX), the four linears of a Qwen2.5-VL-3B decoder
layer, dot kernel vs oneDNN packed, GFLOP/s: M=512 276-303 vs 283-308, M=1024 284-297 vs 285-309,
M=2048 329-383 vs 309-441 (noisy: a shared machine); SmolLM2's at M=1024 level, M=2048 1.16x.
SmolLM2 bf16 engines, one layout vs two (`benchmarks/inproc.py layouts`: two engines in one
process, steps interleaved, on the busy shared machine): linears hold 256 vs 513 MiB; decode
forward at batch 1 / 16 8.1 / 10.6 ms either way (the same kernels); a 1,024-token prefill 2.83 vs
2.98 s (another run 2.19 vs 2.34). bf16 panels against oneDNN capped to AVX512_CORE (a CPU
without bf16 dot products), SmolLM2's linears: 0.2-0.65x its time up to 256 rows, level at 1,024;
the 3B layer's 0.30-0.58x.
Not measured: AMX above `BF16_AMX_MAX_ROWS` rows, where our tiles (about 1.45 TFLOP/s at 192
rows above) stand in for oneDNN's AMX GEMM (about 2.0): from those numbers prefill-sized products
may take up to ~1.4x as long there; "two" keeps oneDNN's for them, for twice the memory.
Peak RSS of in-process engines at start-up (bf16, KV from the default budget), one layout vs
before: SmolVLM2-500M-shaped 5.56 vs 6.28 GiB, Qwen2.5-VL-3B-shaped 10.47 vs 14.51 GiB (7.37 vs
12.61 without the KV pool); a Qwen2.5-VL-7B-shaped model (15.4 GiB of weights) starts in 17.3 GiB;
SmolLM2 fp32 on bf16 panels (`dtype="auto"` with VLM_ENGINE_CPU_BF16=0) peaks at 1.30 vs 1.72 GiB:
its fp32 weights are freed linear by linear as they are packed.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Callable
from types import ModuleType

import torch
import torch.nn.functional as F
from torch import nn

from vlm_engine.config import WEIGHT_LAYOUTS
from vlm_engine.kernels.cpu_isa import has_amx_bf16, onednn_bf16_packing

logger = logging.getLogger(__name__)

# oneDNN picks the blocked layout for this many rows; decode batches are the case that matters.
# fp32 on Zen 3, all SmolLM2 linears of a step: hint 16 was as fast as 64 at M=64 and 5-15% faster
# at M=1-16. Either hint gives rows that do not depend on the batch (F.linear's do, for M <= 3).
PACK_BATCH_HINT = {torch.bfloat16: 64, torch.float32: 16}

# bf16 linears with at most this many rows take the panel kernel, more rows oneDNN's (which has
# bf16 dot products: twice the FLOP rate once the product is compute-bound). All SmolLM2 decoder
# linears (212 MB of bf16 weights) on the 2-core Zen 4, oneDNN packed vs panels, ms: M=1 19.8 vs
# 9.5, M=2 21.2 vs 12.2, M=3 19.4 vs 14.8, M=4 18.8 vs 16.6, M=6 18.2 vs 21.5, M=8 21.3 vs 27.1.
BF16_PANEL_MAX_ROWS = 4

# bf16 linears with at most this many rows take the vdpbf16ps kernel where the CPU has it (see the
# module docstring), more rows oneDNN's; on a CPU with AMX, oneDNN's from BF16_DOT_MAX_ROWS_AMX + 1.
BF16_DOT_MAX_ROWS = 256
BF16_DOT_MAX_ROWS_AMX = 6
# On a CPU with AMX, bf16 linears above the dot kernel's rows and up to this many take our AMX
# tiles (`amx_linear`, the same pairs), more rows oneDNN's AMX GEMM (see the module docstring).
BF16_AMX_MAX_ROWS = 128
# A kernel's row limit where it takes every row count (one weight layout: nothing to hand larger
# products to).
ALL_ROWS = 2**62


def bf16_dot_max_rows() -> int:
    """The most rows a bf16 linear hands to the vdpbf16ps kernel on this CPU."""
    return BF16_DOT_MAX_ROWS_AMX if has_amx_bf16() else BF16_DOT_MAX_ROWS


def bf16_amx_max_rows(dot_ops: ModuleType | None, in_features: int) -> int:
    """The most rows a bf16 linear of `in_features` inputs hands to `dot_ops`' AMX tiles: 0 unless
    the CPU has AMX that may be used (`has_amx_bf16`), the build and the kernel let this process use
    the tiles, and a tile's 32 inputs divide the features."""
    usable = dot_ops is not None and has_amx_bf16() and in_features % 32 == 0 and dot_ops.amx_available()
    return BF16_AMX_MAX_ROWS if usable else 0


def as_rows(x: torch.Tensor, in_features: int) -> torch.Tensor:
    """x as contiguous [T, in] rows. The decoder already passes those: no reshape, and `shaped_like`
    no view back (~1 us each, 121 linears a step)."""
    return (x if x.dim() == 2 else x.reshape(-1, in_features)).contiguous()


def shaped_like(out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """A linear's [T, n] output in the leading shape of its input x."""
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out.shape[-1])


def prepack_supported(device: torch.device, dtype: torch.dtype) -> bool:
    if device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return False
    if dtype == torch.bfloat16 and not onednn_bf16_packing()[0]:
        return False
    return (
        torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """A frozen nn.Linear whose weight lives in oneDNN's blocked layout, or (fp32 with
    `panel_ops`, the fused-ops extension) in the panel layout of `panel_ops.panel_linear`. bf16
    takes `dot_ops.dot_linear`'s pairs where given, else `panel_ops`' panels; with `layouts="one"`
    (the default) in that layout alone at every row count, with "two" beside oneDNN's layout, which
    then takes the products above `dot_max_rows` (pairs) or BF16_PANEL_MAX_ROWS (panels) rows."""

    def __init__(
        self,
        linear: nn.Linear,
        panel_ops: ModuleType | None = None,
        bf16_weights: bool = False,
        dot_ops: ModuleType | None = None,
        gate_up: bool = False,
        layouts: str = "one",
    ) -> None:
        super().__init__()
        if layouts not in WEIGHT_LAYOUTS:
            raise ValueError(f"layouts must be one of {WEIGHT_LAYOUTS}, got {layouts!r}")
        self.in_features = linear.in_features
        self.out_features = linear.out_features
        weight = linear.weight.detach()
        self.dtype = weight.dtype
        self.bias = None if linear.bias is None else linear.bias.detach().clone()
        self._panel_ops = panel_ops
        # fp32 activations on bf16 panels: only for an fp32 layer, and only on the panel kernel.
        self.bf16_weights = bf16_weights and panel_ops is not None and self.dtype == torch.float32
        # bf16 on the dot kernel: its pairs replace the panels.
        self._dot_ops = dot_ops if self.dtype == torch.bfloat16 else None
        self.amx_max_rows = bf16_amx_max_rows(self._dot_ops, self.in_features)
        self.dot_max_rows = bf16_dot_max_rows()
        one = layouts == "one"
        if one and self._dot_ops is not None:
            # No oneDNN layout to hand large products to: our AMX tiles take every row count above
            # the dot kernel's where the CPU has them, else the dot kernel takes all.
            if self.amx_max_rows:
                self.amx_max_rows = ALL_ROWS
            else:
                self.dot_max_rows = ALL_ROWS
        # A gate/up projection (`gate_up`: gate rows, then as many up rows) whose output only feeds
        # silu(gate) * up keeps its pairs in the order of the kernel that applies that activation
        # in registers (`silu_and_mul`); a plain call on it then takes oneDNN at every size (two
        # layouts), or those pairs with the columns put back in order (one).
        gated = self._dot_ops is not None and gate_up and self.bias is None and self.out_features % 16 == 0
        self._gate_up_pairs = self._dot_ops.pack_gate_up(weight.contiguous()) if gated else None
        self._pairs = None if self._dot_ops is None or gated else self._dot_ops.pack_pairs(weight.contiguous())
        # The dot kernel adds the bias in fp32: converted once here, not on every call.
        self._dot_bias = None if self._pairs is None or self.bias is None else self.bias.float()
        stored = weight.to(torch.bfloat16) if self.bf16_weights else weight
        self._panels = None if panel_ops is None or self._dot_ops is not None else panel_ops.pack_panels(stored)
        del stored
        # fp32, and bf16 in one layout: panels at every size; bf16 in two: panels for the few-row
        # products, oneDNN above.
        self._panel_max_rows = BF16_PANEL_MAX_ROWS if self.dtype == torch.bfloat16 and not one else None
        self.layouts = layouts
        if self._dot_ops is not None and one or self._panels is not None and self._panel_max_rows is None:
            # A storage-free stand-in that reports dtype, device and the logical [out, in] shape.
            self.weight = weight.new_zeros(()).expand(self.out_features, self.in_features)
        else:
            # An opaque oneDNN tensor (it still reports dtype, device and the logical [out, in]
            # shape, which code such as Transformers' vision tower reads); kept out of parameters().
            self.weight = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), PACK_BATCH_HINT[self.dtype])
        self._rows = self._bind_rows_kernel()

    def held_bytes(self) -> int:
        """Bytes of the weight layouts and biases this layer holds (oneDNN's by its logical size)."""
        tensors = (self._pairs, self._gate_up_pairs, self._panels, self.bias, self._dot_bias)
        held = sum(t.numel() * t.element_size() for t in tensors if t is not None)
        if self.weight.stride() != (0, 0):  # oneDNN's layout, not the stand-in
            held += self.weight.numel() * self.weight.element_size()
        return held

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype != self.dtype:  # e.g. a vision block run in fp32 by its own code
            raise TypeError(f"PackedLinear holds {self.dtype} weights, got {x.dtype} input")
        flat = as_rows(x, self.in_features)
        if flat.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        return shaped_like(self._rows(flat), x)

    def rows_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """forward for contiguous [T >= 1, in] rows in this layer's dtype (what the layer plans call)."""
        return self._rows

    def _bind_rows_kernel(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """The product of contiguous [T >= 1, in] rows, with the kernel each row count takes and its
        weights bound: forward's body, and the layer plans' linear."""
        n, bias, onednn_weight = self.out_features, self.bias, self.weight
        linear_pointwise = torch.ops.mkldnn._linear_pointwise

        def onednn(x: torch.Tensor) -> torch.Tensor:
            return linear_pointwise(x, onednn_weight, bias, "none", [], "")

        if self._pairs is not None or self._gate_up_pairs is not None and self.layouts == "one":
            assert self._dot_ops is not None
            dot, dot_rows = self._dot_ops.dot_linear, self.dot_max_rows
            # amx_max_rows 0 (no usable tiles): every row count past the dot kernel's goes to oneDNN
            # (two layouts; with one the dot kernel takes every row count).
            amx, amx_rows = self._dot_ops.amx_linear, self.amx_max_rows
            if self._pairs is not None:
                pairs, dot_bias = self._pairs, self._dot_bias
                return lambda x: (
                    dot(x, pairs, n, dot_bias)
                    if x.shape[0] <= dot_rows
                    else amx(x, pairs, n, dot_bias)
                    if x.shape[0] <= amx_rows
                    else onednn(x)
                )
            # The gate/up pairs alone: panel p holds gate columns 8p..8p+7, then the same up columns.
            gate_up, panels = self._gate_up_pairs, n // 16
            return lambda x: (
                (dot(x, gate_up, n) if x.shape[0] <= dot_rows else amx(x, gate_up, n))
                .view(-1, panels, 2, 8)
                .transpose(1, 2)
                .reshape(-1, n)
            )
        if self._panels is not None:
            assert self._panel_ops is not None
            panel, panels, panel_rows = self._panel_ops.panel_linear, self._panels, self._panel_max_rows
            if panel_rows is None:
                return lambda x: panel(x, panels, n, bias)
            return lambda x: panel(x, panels, n, bias) if x.shape[0] <= panel_rows else onednn(x)
        return onednn

    def silu_and_mul(self, x: torch.Tensor, fused: ModuleType) -> torch.Tensor:
        """silu(gate) * up of this gate/up projection's output ([..., 2I] -> [..., I]): in one
        kernel where it holds gate/up pairs and the rows fit the dot kernel, else the projection
        and then `fused.silu_and_mul`."""
        flat = as_rows(x, self.in_features)
        if flat.shape[0] == 0:
            return fused.silu_and_mul(self.forward(x))
        return shaped_like(self.silu_and_mul_rows_fn(fused)(flat), x)

    def silu_and_mul_rows_fn(self, fused: ModuleType) -> Callable[[torch.Tensor], torch.Tensor]:
        """`silu_and_mul` for contiguous [T >= 1, in] rows, kernel and weights bound."""
        linear = self._rows
        if self._gate_up_pairs is None:
            return lambda x: fused.silu_and_mul(linear(x))
        assert self._dot_ops is not None
        dot_silu_mul, pairs, half, max_rows = (
            self._dot_ops.dot_silu_mul, self._gate_up_pairs, self.out_features // 2, self.dot_max_rows
        )
        amx_silu_mul, amx_rows = self._dot_ops.amx_silu_mul, self.amx_max_rows
        return lambda x: (
            dot_silu_mul(x, pairs, half)
            if x.shape[0] <= max_rows
            else amx_silu_mul(x, pairs, half)
            if x.shape[0] <= amx_rows
            else fused.silu_and_mul(linear(x))
        )

    def extra_repr(self) -> str:
        if self._gate_up_pairs is not None or self._pairs is not None:
            pairs = "bf16 dot pairs with silu(gate) * up" if self._gate_up_pairs is not None else "bf16 dot pairs"
            layout = f"{pairs} {_rows_phrase(self.dot_max_rows, self.amx_max_rows)}"
        elif self._panels is None:
            layout = "oneDNN"
        elif self._panel_max_rows is None:
            layout = "bf16 weight panels" if self.bf16_weights else "panels"
        else:
            layout = f"panels up to {self._panel_max_rows} rows, oneDNN above"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, {layout}"
        )


def gate_up_projection(parent: nn.Module, child: nn.Linear) -> bool:
    """A MergedLinear of exactly gate_proj then up_proj in a SiLU GatedMLP: its output only feeds
    silu(gate) * up, which the layer plans ask of it (`silu_and_mul_rows_fn`). Another activation
    (Gemma's GELU) reads the projection's plain output, so it keeps the plain packing."""
    shards = getattr(child, "shards", {})
    return (
        tuple(shards) == ("gate_proj", "up_proj")
        and shards["gate_proj"][1] == shards["up_proj"][1]
        and getattr(parent, "activation", "silu") == "silu"
    )


def pack_child(
    parent: nn.Module,
    name: str,
    panel_ops: ModuleType | None = None,
    bf16_weights: bool = False,
    dot_ops: ModuleType | None = None,
    layouts: str = "one",
) -> PackedLinear | None:
    """Replace `parent`'s bf16/fp32 nn.Linear `name` by a PackedLinear (None: not such a linear).
    The plain weight is freed with the nn.Linear unless something else holds it (a tied embedding)."""
    child = getattr(parent, name)
    if not isinstance(child, nn.Linear) or child.weight.dtype not in (torch.bfloat16, torch.float32):
        return None
    packed = PackedLinear(child, panel_ops, bf16_weights, dot_ops, gate_up_projection(parent, child), layouts)
    setattr(parent, name, packed)
    return packed


def prepack_linears(
    model: nn.Module,
    panel_ops: ModuleType | None = None,
    bf16_weights: bool = False,
    dot_ops: ModuleType | None = None,
    layouts: str = "one",
) -> int:
    """Replace every bf16/fp32 nn.Linear in `model` by a PackedLinear; returns how many were replaced.

    Subclasses of nn.Linear (MergedLinear keeps its shard map for the loader) are packed too:
    weights are loaded before this runs, so only the matmul is needed afterwards. With `panel_ops`
    (the fused-ops extension, vectorised build) fp32 linears take the panel kernel, on bf16 panels
    with `bf16_weights`; with `dot_ops` (the bf16 dot-product extension) bf16 linears take its kernel
    (see PackedLinear for `layouts`). Linears `LoadTimePacker` packed while the weights loaded are
    checked and counted here too.
    """
    # (parent, name) only: holding the modules would keep every original weight alive until the last
    # one is packed (a bf16 3B model peaked at its weights three times over, 18.6 GB).
    linears = [
        (parent, name)
        for parent in list(model.modules())
        for name, child in list(parent.named_children())
        if isinstance(child, nn.Linear) and child.weight.dtype in (torch.bfloat16, torch.float32)
    ]
    for parent, name in linears:
        pack_child(parent, name, panel_ops, bf16_weights, dot_ops, layouts)
    packed = [m for m in model.modules() if isinstance(m, PackedLinear)]
    dtypes = {m.dtype for m in packed}
    for dtype in dtypes:
        _check_close_to_plain_linear(dtype, panel_ops, bf16_weights, dot_ops, layouts)
    kernels = ", ".join(
        f"{str(d).removeprefix('torch.')}: {_kernel_name(d, panel_ops, bf16_weights, dot_ops, layouts, packed)}"
        for d in sorted(dtypes, key=str)
    )
    held = sum(m.held_bytes() for m in packed)
    logger.info("prepacked %d linear layers, %.0f MiB held (%s)", len(packed), held / 2**20, kernels or "none")
    return len(linears)


def _kernel_name(
    dtype: torch.dtype,
    panel_ops: ModuleType | None,
    bf16_weights: bool,
    dot_ops: ModuleType | None,
    layouts: str,
    packed: list[PackedLinear],
) -> str:
    """What the packed linears of `dtype` run, for the log."""
    if dtype == torch.float32:
        return ("bf16 weight panels" if bf16_weights else "panels") if panel_ops is not None else "oneDNN"
    if dot_ops is not None:
        amx_rows = max((m.amx_max_rows for m in packed if m.dtype == dtype), default=0)
        dot_rows = max((m.dot_max_rows for m in packed if m.dtype == dtype and m._dot_ops is not None), default=0)
        return f"bf16 dot products {_rows_phrase(dot_rows, amx_rows)}"
    if panel_ops is not None:
        return "panels" if layouts == "one" else f"panels up to {BF16_PANEL_MAX_ROWS} rows, oneDNN above"
    return "oneDNN"


def _rows_phrase(dot_rows: int, amx_rows: int) -> str:
    """Which rows the dot kernel, the AMX tiles and oneDNN take."""
    if dot_rows >= ALL_ROWS:
        return "at every row count"
    if amx_rows >= ALL_ROWS:
        return f"up to {dot_rows} rows, AMX tiles above"
    amx = f", AMX tiles up to {amx_rows}" if amx_rows else ""
    return f"up to {dot_rows} rows{amx}, oneDNN above"


class LoadTimePacker:
    """Packs each linear as soon as the loader has filled its weights (`loader.load_weights`'
    `on_filled`), so that a model's plain weights and its packed ones never exist side by side: the
    plain tensor is freed, and its pages handed back to the kernel, before the next one is read.
    `quantize(parent, name, path)` (weight-only quantization) may replace a linear first, from its
    weights as filled (fp32 where build_model kept them so); one it leaves that is not in `dtype`
    is cast; with `pack` the rest become PackedLinears, those under `encoder_paths` (media encoders,
    which only multiply prefill-sized row counts) in oneDNN's layout alone, as
    `build.build_model` packs them. `quantize_linears` and `prepack_linears` afterwards take what is
    left (a linear tied to the embedding), check the kernels and log."""

    def __init__(
        self,
        model: nn.Module,
        panel_ops: ModuleType | None,
        bf16_weights: bool,
        dot_ops: ModuleType | None,
        layouts: str,
        encoder_paths: tuple[str, ...] = (),
        pack: bool = True,
        quantize: Callable[[nn.Module, str, str], nn.Module | None] | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        self._model = model
        self._dtype = dtype
        self._kernels = (panel_ops, bf16_weights, dot_ops, layouts)
        self._encoders = tuple(f"{path}." for path in encoder_paths)
        self._pack = pack
        self._quantize = quantize

    def __call__(self, path: str) -> None:
        parent_path, _, name = path.rpartition(".")
        parent = self._model.get_submodule(parent_path)
        replaced = self._quantize is not None and self._quantize(parent, name, path) is not None  # from any dtype
        child = getattr(parent, name)
        weight = None if replaced or self._dtype is None else child.weight
        if weight is not None and weight.dtype != self._dtype and weight.is_floating_point():
            # Built outside the meta device in another dtype (Transformers' Qwen2-VL tower): cast as
            # build_model's `model.to(dtype)` would have before packing.
            child.to(self._dtype)
        del child, weight
        if not replaced and self._pack:
            encoder = (path + ".").startswith(self._encoders) if self._encoders else False
            replaced = pack_child(parent, name, *(() if encoder else self._kernels)) is not None
        if replaced:
            release_freed_memory()


def release_freed_memory() -> None:
    """Hand freed heap pages back to the kernel (glibc's malloc_trim): the engine keeps freed memory
    in the process (`host_memory`), so without this each replaced plain weight would stay resident."""
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def _malloc_trim() -> Callable[[int], int] | None:
    try:
        trim = ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc: nothing to hand back this way
        return None
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


_MALLOC_TRIM = _malloc_trim()


def _check_close_to_plain_linear(
    dtype: torch.dtype,
    panel_ops: ModuleType | None,
    bf16_weights: bool = False,
    dot_ops: ModuleType | None = None,
    layouts: str = "one",
) -> None:
    """Fail loudly at start-up if this build's packed op disagrees with F.linear (on the weights
    rounded to bf16, where the panels hold those)."""
    gen = torch.Generator().manual_seed(0)
    linear = nn.Linear(96, 48, bias=True).requires_grad_(False)
    with torch.no_grad():
        linear.weight.copy_(torch.randn(48, 96, generator=gen))
        linear.bias.copy_(torch.randn(48, generator=gen))
    linear = linear.to(dtype)
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-4
    packed = PackedLinear(linear, panel_ops, bf16_weights, dot_ops, layouts=layouts)
    if packed.bf16_weights:
        with torch.no_grad():
            linear.weight.copy_(linear.weight.to(torch.bfloat16).float())
    thresholds = {r + 1 for r in (packed.dot_max_rows, packed.amx_max_rows) if r < ALL_ROWS}
    for rows in sorted({1, 5, 70, 300} | thresholds):  # every kernel rows can pick
        x = torch.randn(rows, 96, generator=gen).to(dtype)
        got, want = packed(x).float(), linear(x).float()
        if not torch.allclose(got, want, rtol=tol, atol=tol):
            raise RuntimeError(f"packed {dtype} linear ({packed.extra_repr()}) disagrees with F.linear at {rows} rows")
    if dot_ops is not None and dtype == torch.bfloat16:
        plain = nn.Linear(96, 48, bias=False, dtype=dtype).requires_grad_(False)  # gate 24, up 24
        with torch.no_grad():
            plain.weight.copy_(linear.weight)
        gated = PackedLinear(plain, dot_ops=dot_ops, gate_up=True, layouts=layouts)
        # The kernels' epilogue only: the dot kernel's rows and the AMX tiles'.
        for rows in (r for r in (1, 5, 70) if r <= max(gated.dot_max_rows, gated.amx_max_rows)):
            x = torch.randn(rows, 96, generator=gen).to(dtype)
            gate, up = plain(x).float().split(24, dim=-1)
            got, want = gated.silu_and_mul(x, fused=None).float(), F.silu(gate) * up  # type: ignore[arg-type]
            if not torch.allclose(got, want, rtol=tol, atol=tol):
                raise RuntimeError(f"the bf16 dot kernel's silu(gate) * up disagrees with F.silu at {rows} rows")
            if not torch.allclose(gated(x).float(), torch.cat([gate, up], dim=-1), rtol=tol, atol=tol):
                raise RuntimeError(f"the bf16 gate/up projection ({gated.extra_repr()}) disagrees at {rows} rows")
