"""Weight-only int8 / int4 linears for the CPU decoder (`EngineConfig.quantization`).

Decode at low concurrency streams every weight once per token, so bytes per weight decide its
speed: on the 2-core Sapphire Rapids all SmolLM2 linears of a batch-1 step take ~29 ms in fp32,
~17 ms on bf16 panels, ~7 ms int8 and ~4.5 ms int4 (benchmarks/inproc.py linears). The schemes are
llama.cpp's Q8_0 and Q4_1 (groups of 32 inputs, fp16 scale and, for int4, fp16 minimum):
quantizing weights that came from a Q4_1 GGUF file gives back the file's codes, so a llama.cpp
quantized model is served with the numbers llama.cpp uses. The layers take fp32 or bf16 rows (the
model's dtype: bf16 where the CPU has bf16 dot products) and return their dtype, summing in fp32 and
rounding once; inside,
the kernels (the fused-ops extension's `quantize_panels` / `quant_panel_linear`, csrc/fused_ops.cpp)
round each row of x to int8 per group of 32, as llama.cpp's Q8_0 / Q8_1 activations, and run
integer dot products. From `GEMM_MIN_ROWS` rows up the product runs on the int8 GEMM instead
(int8_gemm.py: register-blocked tiles, the same numbers bit for bit): on the 2-core Zen 5, one
thread, the bench Qwen2-VL's (Qwen2-VL-2B's) linears at 16-1024 rows run at ~450-615 GFLOP/s against
~250 for the decode kernel and ~460-520 for the bf16 dot kernel, whose vdpbf16ps issues at twice
vpdpbusd's rate there; the whole step at 8 rows takes 11 ms against 20 (bf16 12.5), and the
in-process engine did 2.38 / 1.59 requests/s at batch 8 / 1 with int8 (1.67 / 1.28 before),
2.45 / 1.94 with int4, 3.03 / 1.42 in bf16 while a quantized model ran everything else in fp32.
In bf16 (issue 49), with the GEMM's next-strip prefetch, by CPU time on the busy machine: int8 3.10
/ 1.77, int4 3.03 / 2.03, bf16 2.81 / 1.32, int8 with fp32 activations 2.28 / 1.43; a quieter rerun
at batch 8: int8 3.16, bf16 2.92, int8 with the tower quantized too 3.15 (docs/ARCHITECTURE.md,
"Weight-only quantization"). A SmolLM2 decode step at batch 16 (1 thread, CPU ms): int8 17.2, int4
16.3, bf16 16.7: at 16 rows the int8 products compute no faster than bf16's here. From `WO_MIN_ROWS`
bf16 rows an int8 layer computes in bf16 (int8_gemm's `wo_gemm`: prefill-sized products at the bf16
dot kernel's speed, where the integer GEMM ran at ~0.75x it), on layers of up to `WO_MAX_WEIGHTS` weights:
with both threads and 7B-sized layers the integer GEMM is the faster one.

A checkpoint's own int4 groups (AWQ, GPTQ, compressed-tensors: 128 inputs, most often) keep one (d, m) per
group, not one per 32 (`grouped_panels`): the kernels read block b's at b >> s, and a weight with its share of
the scales takes 4.25 bits at groups of 128, not 5.

Which linears: the text decoder's (`int4`: 4 bits; `int8`: 8 bits) and the LM head (8 bits in both,
as llama.cpp's Q4 files keep the output projection in Q8_0). The vision encoders stay in the
model's dtype unless `quantize_vision` (8 bits): they run once per image, where compute, not
weight bytes, is the cost.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType

import torch
from torch import nn

from vlm_engine.config import QUANTIZATIONS
from vlm_engine.models.int8_gemm import load_int8_gemm
from vlm_engine.models.prepack import as_rows, shaped_like
from vlm_engine.models.quant_formats.base import GroupedWeights

logger = logging.getLogger(__name__)

__all__ = [
    "QUANTIZATIONS", "QUANTIZED_DTYPES", "InputQuantizedLinear", "Quantization", "QuantizedLinear", "fake_quantize_per_token",
    "grouped_panels", "quantize_linears",
]  # fmt: skip
GROUP = 32  # inputs per scale, as in GGUF's Q8_0 / Q4_1 blocks
QUANTIZED_DTYPES = (torch.float32, torch.bfloat16)  # the activations the layers take, and return in that dtype
# The int8 GEMM from here up: with its next-strip prefetch, weights cycling through memory (1 thread,
# 2-core Zen 5), 3072x576 int8 at 1 / 2 / 3 / 4 rows took 65 / 59 / 52 / 57 us against the decode
# kernel's 63 / 66 / 80 / 92, 1536x8960 418 / 487 / 460 / 525 against 434 / 493 / 664 / 770.
GEMM_MIN_ROWS = 2
# bf16 rows times int8 weights on vdpbf16ps (the GEMM's `wo_gemm`, AVX-512 BF16 builds) from here up:
# SmolLM2's decoder linears, weights cycling through memory, 1 thread, 2-core Zen 5, ms per layer,
# VNNI / bf16 compute / the bf16 dot kernel: 16 rows 0.33 / 0.42 / 0.32, 32 rows 0.66 / 0.66 / 0.56,
# 64 rows 1.38 / 1.19 / 1.08, 256 rows 5.77 / 4.29 / 4.31 (its dequantization, ~20 instructions per
# 64 codes, is shared by a chunk's rows: below ~32 it costs more than vpdpbusd's lower rate).
WO_MIN_ROWS = 48
# ... and only on weights of up to this many (out x in): with the served 2 threads (2-core Zen 5, 430 bf16
# rows, best of 7, ms, integer GEMM / wo_gemm) wo_gemm led on small layers (SmolLM2's 576x960 at 256 rows 0.34 / 0.32,
# Qwen2-VL-2B's 1536x2048 4.2 / 3.0) and trailed on large ones (its 1536x17920 25.3 / 26.4, 8960x1536 12.3 /
# 15.0; Qwen2.5-VL-7B's 3584x3584 10.4 / 12.1, 3584x37888 116 / 136, 18944x3584 53 / 78: 28 layers of
# those took 5.4 s a 430-token prompt against 6.7 s).
WO_MAX_WEIGHTS = 4 << 20


class QuantizedLinear(nn.Module):
    """A frozen nn.Linear stored as grouped int8 / int4 codes in the kernel's panel layout; with `input_order`
    (act-order checkpoints) the kernel sees x's columns in that order, so that each group of 32 is contiguous."""

    def __init__(self, linear: nn.Linear, bits: int, ops: ModuleType) -> None:
        super().__init__()
        codes, scales = ops.quantize_panels(linear.weight.detach().float(), bits)
        bias = None if linear.bias is None else linear.bias.detach().float().clone()
        self._bind(linear.in_features, linear.out_features, bits, ops, codes, scales, bias, None)

    @classmethod
    def from_grouped(
        cls, grouped: GroupedWeights, ops: ModuleType, bias: torch.Tensor | None = None
    ) -> QuantizedLinear | None:
        """A pre-quantized checkpoint's linear straight from its codes (no float weights on the way), or None
        where our panels cannot hold it (`grouped_panels`)."""
        panels = grouped_panels(grouped)
        if panels is None:
            return None
        codes, scales, order = panels
        layer = cls.__new__(cls)
        nn.Module.__init__(layer)
        out, inputs = grouped.shape
        bias = None if bias is None else bias.detach().float().clone()
        layer._bind(inputs, out, grouped.bits, ops, codes, scales, bias, order)
        return layer

    def _bind(
        self,
        in_features: int,
        out_features: int,
        bits: int,
        ops: ModuleType,
        codes: torch.Tensor,
        scales: torch.Tensor,
        bias: torch.Tensor | None,
        input_order: torch.Tensor | None,
    ) -> None:
        self.in_features, self.out_features, self.bits, self._ops = in_features, out_features, bits, ops
        self.codes, self.scales, self.bias, self.input_order = codes, scales, bias, input_order
        rows = _bind_rows(
            ops.quant_panel_linear, load_int8_gemm(), codes, scales, in_features, out_features, bits, bias
        )
        self._rows = rows if input_order is None else _columns_in_order(rows, input_order)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype not in QUANTIZED_DTYPES:
            raise TypeError(f"QuantizedLinear takes float32 or bfloat16 activations, got {x.dtype}")
        flat = as_rows(x, self.in_features)
        if flat.shape[0] == 0:
            return x.new_empty(*x.shape[:-1], self.out_features)
        return shaped_like(self._rows(flat), x)

    def rows_fn(self) -> Callable[[torch.Tensor], torch.Tensor]:
        """forward for contiguous [T >= 1, in] fp32 or bf16 rows, kernel and weights bound (the layer plans')."""
        return self._rows

    def dequantized_weight(self) -> torch.Tensor:
        """The [out, in] fp32 weights the codes stand for."""
        weight = self._ops.dequantize_panels(self.codes, self.scales, self.out_features, self.bits)
        if self.input_order is None:
            return weight
        return weight.index_select(1, torch.argsort(self.input_order))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, int{self.bits}"


def _columns_in_order(
    rows: Callable[[torch.Tensor], torch.Tensor], order: torch.Tensor
) -> Callable[[torch.Tensor], torch.Tensor]:
    """`rows` on x's columns taken in `order` (the act-order permutation the panels were built in)."""
    return lambda x: rows(x.index_select(1, order))


def _bind_rows(
    kernel: Callable[..., torch.Tensor],
    gemm: ModuleType | None,
    codes: torch.Tensor,
    scales: torch.Tensor,
    k: int,
    n: int,
    bits: int,
    bias: torch.Tensor | None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """The product of contiguous [T >= 1, in] rows, weights bound: forward's body, the layer plans'
    linear. From `GEMM_MIN_ROWS` rows the int8 GEMM (the same numbers bit for bit), which takes bf16
    rows and rounds its fp32 sums (bias added) to bf16 once; below, the decode kernel (fp32 only)
    on the rows widened to fp32, its output rounded the same way. int8 weights and bf16 rows from
    `WO_MIN_ROWS` rows, up to `WO_MAX_WEIGHTS` weights: the GEMM's bf16-compute path where the build has it
    (x not rounded to int8: other numbers, closer to the exact product)."""
    big = None if gemm is None else gemm.quant_gemm
    small = bits == 8 and k * n <= WO_MAX_WEIGHTS
    wide = gemm.wo_gemm if gemm is not None and small and gemm.wo_available() else None

    def rows(x: torch.Tensor) -> torch.Tensor:
        if wide is not None and x.shape[0] >= WO_MIN_ROWS and x.dtype == torch.bfloat16:
            return wide(x, codes, scales, n, bias)
        if big is not None and x.shape[0] >= GEMM_MIN_ROWS:
            return big(x, codes, scales, n, bits, bias)
        if x.dtype == torch.float32:
            return kernel(x, codes, scales, n, bits, bias)
        return kernel(x.float(), codes, scales, n, bits, bias).to(x.dtype)

    return rows


@dataclass(frozen=True)
class Quantization:
    """What a model quantizes: `scheme`'s bits for the text decoder's linears, 8 for the LM head
    and, with `vision`, for the media encoders' linears (`encoders`: the model's
    `encoder_modules`, Qwen2-VL's `visual` always), which stay in the model's dtype otherwise."""

    scheme: str
    vision: bool = False
    encoders: tuple[str, ...] = ("visual",)

    @classmethod
    def of(cls, model: nn.Module, scheme: str, vision: bool = False) -> Quantization:
        return cls(scheme, vision, tuple(dict.fromkeys(("visual", *getattr(model, "encoder_modules", ())))))

    def bits(self, module_path: str) -> int | None:
        """Bits for the linear at `module_path`, or None to leave it alone."""
        padded = f".{module_path}."
        if any(f".{name}." in padded for name in self.encoders):
            return 8 if self.vision else None  # a tower is compute-bound: 4 bits would buy accuracy loss only
        if module_path == "lm_head" or module_path.endswith(".lm_head"):
            return 8
        if ".layers." in module_path or module_path.startswith("layers."):
            return 4 if self.scheme == "int4" else 8
        return None

    def weights(self, model: nn.Module) -> frozenset[int]:
        """The ids of the weights of the linears `quantize_child` replaces, for a model still on the
        meta device."""
        return frozenset(
            id(module.weight)
            for path, module in model.named_modules()
            if isinstance(module, nn.Linear) and self.bits(path) is not None and module.in_features % GROUP == 0
        )


def quantize_child(
    parent: nn.Module, name: str, path: str, plan: Quantization, ops: ModuleType
) -> QuantizedLinear | None:
    """Replace `parent`'s nn.Linear `name` (at `path` in the model) by a QuantizedLinear if `plan`
    quantizes it and its inputs divide into groups; None where it stays."""
    child = getattr(parent, name)
    bits = plan.bits(path)
    if bits is None or not isinstance(child, nn.Linear):
        return None
    if child.in_features % GROUP:
        logger.info("%s: %d inputs is not a multiple of %d, left unquantized", path, child.in_features, GROUP)
        return None
    quantized = QuantizedLinear(child, bits, ops)
    setattr(parent, name, quantized)
    return quantized


def quantize_linears(model: nn.Module, scheme: str, ops: ModuleType, vision: bool = False) -> int:
    """Replace the decoder's nn.Linears and the LM head (and with `vision` the media encoders') by
    QuantizedLinears; returns how many (those `prepack.LoadTimePacker` quantized while the weights
    loaded are counted in the log)."""
    if scheme not in QUANTIZATIONS:
        raise ValueError(f"quantization must be one of {QUANTIZATIONS}, got {scheme!r}")
    if not ops.quant_linear_vectorized():
        logger.warning("the int%s kernel has no AVX2 build on this CPU: portable loops, slow", scheme[3:])
    replaced, plan = 0, Quantization.of(model, scheme, vision)
    for path, module in list(model.named_modules()):
        for name, _ in list(module.named_children()):
            child_path = f"{path}.{name}" if path else name
            replaced += quantize_child(module, name, child_path, plan, ops) is not None
    quantized = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    before = sum(m.in_features * m.out_features * 4 for m in quantized)  # their fp32 weights
    after = sum(m.codes.numel() + m.scales.numel() * 2 for m in quantized)
    logger.info(
        "quantized %d linear layers (%s weight-only, lm_head%s int8): %.0f -> %.0f MiB",
        len(quantized),
        scheme,
        " and vision encoders" if vision else "",
        before / 2**20,
        after / 2**20,
    )
    return replaced


# ---- pre-quantized checkpoints (quant_formats): their codes in our panels -------------------------------
PANEL_ROWS = 16  # output rows per panel (csrc/fused_ops.cpp kPanel)


def grouped_panels(grouped: GroupedWeights) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """A checkpoint's codes as `quantize_panels` lays out its own (codes, scales) plus the input order the
    kernel must read x in (act-order; None for column order), or None where the panels cannot hold them.

    Our blocks are llama.cpp's: 32 inputs with one fp16 scale d (and for int4 a minimum m), w = d * q (+ m).
    int4: groups of 32 << s inputs (AWQ's and GPTQ's 128: s = 2; the largest s that fits) keep one (d, m)
    each, which the kernels read at block >> s; int8 repeats a group's scale in each block of 32. Act-order
    inputs are sorted by group first (stable), which makes each group contiguous. int4: q in 0..15, unsigned
    codes q - z -> d = s, m = -s * z (signed codes: z = 8), plus the group's offset where it has one (GGUF's
    Q4_1 / Q4_K minimum); int8: signed codes, no zero point (Q8_0), or unsigned ones whose zero point is 128
    everywhere, and no offset (our int8 kernels apply no minimum). d and m are rounded to fp16: fast mode's
    tolerance.
    """
    bits, inputs = grouped.bits, grouped.shape[1]
    if bits not in (4, 8) or inputs % GROUP:
        return None
    codes, groups, order = grouped.codes, grouped.groups(), None
    if grouped.group_of_input is not None:
        order = torch.argsort(groups, stable=True)
        if bool((order == torch.arange(inputs)).all()):
            order = None
        else:
            codes, groups = codes.index_select(1, order), groups[order]
    span = _scale_span(groups) if bits == 4 else GROUP
    if span is None:
        return None  # a group boundary inside a block of 32
    block_group = groups[::span]
    scale = grouped.scales.float()[:, block_group]
    offset = 1 << (bits - 1)
    signed = grouped.zeros is None
    lowest, highest = (-offset, offset - 1) if signed else (0, (1 << bits) - 1)
    if int(codes.min()) < lowest or int(codes.max()) > highest:
        return None
    zero = None if signed else grouped.zeros.float()[:, block_group]  # type: ignore[union-attr]
    added = None if grouped.offsets is None else grouped.offsets.float()[:, block_group]
    if bits == 8:
        if (zero is not None and not bool((zero == offset).all())) or (added is not None and bool(added.any())):
            return None  # Q8_0 has no minimum (our int8 kernels apply none)
        # Unsigned codes around a zero point of 128 are the signed ones shifted.
        panel_codes = _int8_panels(codes.to(torch.int8) if signed else (codes.to(torch.int16) - offset).to(torch.int8))
        minimum = torch.zeros_like(scale)
    else:
        # Signed codes + 8 in uint8 arithmetic (wrapping) are the unsigned ones, zero point 8.
        panel_codes = _int4_panels(codes.to(torch.int8).view(torch.uint8) + offset if signed else codes.to(torch.uint8))
        minimum = -scale * (offset if zero is None else zero)
        minimum = minimum if added is None else minimum + added
    d, m = scale.half(), minimum.half()
    if not bool(torch.isfinite(d).all() and torch.isfinite(m).all()):
        return None  # beyond fp16's range
    return panel_codes, _panel_scales(d, m), order


def _scale_span(groups: torch.Tensor) -> int | None:
    """The most inputs, 32 << s, whose every run of that length lies in one group: one (d, m) serves each run."""
    span = None
    while (candidate := GROUP if span is None else 2 * span) <= groups.numel() and groups.numel() % candidate == 0:
        runs = groups.view(-1, candidate)
        if not bool((runs == runs[:, :1]).all()):
            break
        span = candidate
    return span


def _padded_panels(values: torch.Tensor) -> torch.Tensor:
    """[out, ...] -> [panels, PANEL_ROWS, ...], zero rows after the last output (as quantize_panels pads)."""
    out = values.shape[0]
    panels = -(-out // PANEL_ROWS)
    if out == panels * PANEL_ROWS:  # no partial panel: a view, not a copy of the codes
        return values.view(panels, PANEL_ROWS, *values.shape[1:])
    padded = values.new_zeros((panels * PANEL_ROWS, *values.shape[1:]))
    padded[:out] = values
    return padded.view(panels, PANEL_ROWS, *values.shape[1:])


def _int8_panels(codes: torch.Tensor) -> torch.Tensor:
    """Signed codes [out, in] -> [P][in/4][64]: byte 4c+j of block b is column c's input 4b+j."""
    panels = _padded_panels(codes.to(torch.int8))  # [P, 16, in]
    p, _, inputs = panels.shape
    return (
        panels.view(p, PANEL_ROWS, inputs // 4, 4)
        .permute(0, 2, 1, 3)
        .reshape(p, inputs // 4, 4 * PANEL_ROWS)
        .contiguous()
    )


def _int4_panels(codes: torch.Tensor) -> torch.Tensor:
    """Codes 0..15 [out, in] -> [P][in/8][64]: byte 4c+j of block b holds column c's input 8b+j in its low nibble
    and 8b+4+j in its high one."""
    panels = _padded_panels(codes.to(torch.uint8))  # [P, 16, in]
    p, _, inputs = panels.shape
    eights = panels.view(p, PANEL_ROWS, inputs // 8, 8)
    packed = eights[..., :4] | (eights[..., 4:] << 4)  # [P, 16, in/8, 4]
    return packed.permute(0, 2, 1, 3).reshape(p, inputs // 8, 4 * PANEL_ROWS).contiguous()


def _panel_scales(d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """fp16 d, m [out, groups] -> int16 bits [P][groups][2][16] (d, then m)."""
    both = torch.stack([_padded_panels(d), _padded_panels(m)], dim=2)  # [P, 16, 2, groups]
    return both.permute(0, 3, 2, 1).contiguous().view(torch.int16)


def fake_quantize_per_token(x: torch.Tensor) -> torch.Tensor:
    """compressed-tensors' dynamic per-token symmetric int8 activations, op for op in x's dtype
    (quantization/lifecycle/forward.py, utils/helpers.py `calculate_qparams`): scale = max(|min|, |max|) / 127.5
    over each row (min clamped to <= 0, max to >= 0; a zero scale becomes the dtype's eps),
    q = round(clamp(x / scale, -128, 127)) (half to even), x' = q * scale."""
    low = torch.clamp(torch.amin(x, dim=-1, keepdim=True), max=0.0)
    high = torch.clamp(torch.amax(x, dim=-1, keepdim=True), min=0.0)
    scale = torch.maximum(low.abs(), high.abs()) / 127.5
    scale = torch.where(scale == 0, torch.finfo(scale.dtype).eps, scale)
    return torch.round(torch.clamp(x / scale, -128.0, 127.0)) * scale


class InputQuantizedLinear(nn.Linear):
    """Exact numerics of a W8A8 checkpoint's linear: its weights dequantized (fp32), each row of x rounded to
    int8 as compressed-tensors does at run time, then the plain product (the format's own reference)."""

    def __init__(self, linear: nn.Linear) -> None:
        nn.Module.__init__(self)
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight, self.bias = linear.weight, linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(fake_quantize_per_token(x), self.weight, self.bias)
