"""Native AWQ and GPTQ checkpoints of a tiny random model, packed by AutoAWQ's and GPTQModel's own code (issue 51).

The codes come from each tool's min-max quantizer, transcribed (`_awq_codes`: AutoAWQ's pseudo_quantize_tensor with
zero_point; `_gptq_codes`: GPTQModel's Quantizer.find_params, whose range always holds 0); the packing is the
tools' own, run by `testkit.awq_gptq_packing.run_tool` (AutoAWQ 0.2.9 WQLinear_GEMM.from_linear; GPTQModel 7.7.0
TorchLinear.pack_original, exported to its v1 `gptq` format). Every decoder linear is quantized; the vision tower,
the embeddings, norms, biases and lm_head are stored as the base stores them, under the base's (published) names.

Beside each checkpoint, `fp32-reference/` holds the same model with each packed linear dequantized to fp32 from
the files just written (vLLM's AWQ formula, GPTQModel's v1 -> v2 + dequantize_weight formula, transcribed in
awq_gptq_packing), checked against the tool's own readback (fp16 arithmetic: the fp32 value rounded once).

    NATIVE_RECIPES: name -> NativeRecipe
    cached_native(base, recipe) -> Path      # <checkpoint cache>/<base>-<recipe>-<content key>-...
    reference_dir(checkpoint) -> Path        # its fp32-reference/ (config without quantization_config)
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from testkit.awq_gptq_packing import TOOL_PINS, gptqmodel_dequantize, run_tool, vllm_awq_dequantize
from testkit.checkpoints import cached_checkpoint

MAKER_VERSION = 2  # bump when the quantizer, the packing or the files written change
BITS = 4
MAX_CODE = (1 << BITS) - 1
REFERENCE = "fp32-reference"
WEIGHTS = "model.safetensors"
COMPONENTS = ("qweight", "qzeros", "scales", "g_idx")  # a packed linear's tensors (AWQ stores no g_idx)
# A decoder linear's weight under the published Qwen2.5-VL names (what the released AWQ checkpoint keys too).
DECODER_LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")
# Qwen2.5-VL-7B-Instruct-AWQ's config says ["visual"]; the head is named as well (neither is a decoder linear).
NOT_CONVERTED = ["visual", "lm_head"]


@dataclass(frozen=True)
class NativeRecipe:
    method: str  # "awq" (GEMM packing, zero_point) | "gptq" (v1 checkpoint_format)
    group_size: int
    sym: bool
    desc_act: bool = False  # GPTQ act-order: inputs quantized in order of importance, g_idx stored

    @property
    def tool(self) -> str:
        return "autoawq" if self.method == "awq" else "gptqmodel"


NATIVE_RECIPES: dict[str, NativeRecipe] = {
    "awq-gemm-g32": NativeRecipe("awq", 32, sym=False),
    "gptq-g32-sym": NativeRecipe("gptq", 32, sym=True),
    "gptq-g32-descact-asym": NativeRecipe("gptq", 32, sym=False, desc_act=True),
}


def quantization_config(recipe: NativeRecipe) -> dict[str, Any]:
    """config.json's `quantization_config` as each tool writes it (AutoAWQ's AwqConfig fields; GPTQModel's
    QuantizeConfig fields, its run-time `meta` reduced to the quantizer stamp readers key on)."""
    if recipe.method == "awq":
        return {"quant_method": "awq", "bits": BITS, "group_size": recipe.group_size, "zero_point": not recipe.sym,
                "version": "gemm", "modules_to_not_convert": NOT_CONVERTED}  # fmt: skip
    version = TOOL_PINS["gptqmodel"][0].split("==")[1]
    return {"quant_method": "gptq", "method": "gptq", "bits": BITS, "group_size": recipe.group_size,
            "desc_act": recipe.desc_act, "sym": recipe.sym, "lm_head": False, "format": "gptq",
            "checkpoint_format": "gptq", "pack_dtype": "int32",
            "meta": {"quantizer": [f"gptqmodel:{version}"], "uri": "https://github.com/modelcloud/gptqmodel",
                     "static_groups": False, "true_sequential": True}}  # fmt: skip


# ---- the tools' min-max quantizers ---------------------------------------------------------------------------


def _awq_codes(weight: torch.Tensor, group_size: int) -> dict[str, torch.Tensor]:
    """AutoAWQ pseudo_quantize_tensor, zero_point: per group, scale (max - min) / 15, zero -round(min / scale);
    the codes against the fp16 scale the checkpoint stores."""
    out_features, in_features = weight.shape
    grouped = weight.reshape(out_features, in_features // group_size, group_size)
    low, high = grouped.amin(-1), grouped.amax(-1)
    scales = ((high - low).clamp(min=1e-5) / MAX_CODE).half()
    zeros = (-torch.round(low / scales.float())).clamp(0, MAX_CODE)
    codes = (torch.round(grouped / scales.float()[..., None]) + zeros[..., None]).clamp(0, MAX_CODE)
    return {"q": codes.reshape(out_features, in_features).int(), "z": zeros.int(), "s": scales}


def _gptq_codes(weight: torch.Tensor, recipe: NativeRecipe, importance: torch.Tensor) -> dict[str, torch.Tensor]:
    """GPTQModel Quantizer.find_params per group (min-max, the range widened to hold 0; sym: +-max|w|, zero 8).
    desc_act: the inputs taken in decreasing `importance` (GPTQ's Hessian diagonal, here `_input_importance`),
    group k holding the k-th run of group_size of them, g_idx[input] its group."""
    out_features, in_features = weight.shape
    order = torch.argsort(importance, descending=True, stable=True) if recipe.desc_act else None
    g_idx = torch.arange(in_features, dtype=torch.int32) // recipe.group_size
    if order is not None:
        g_idx = torch.empty_like(g_idx).index_put_((order,), g_idx)
    sorted_weight = weight if order is None else weight[:, order]
    grouped = sorted_weight.reshape(out_features, in_features // recipe.group_size, recipe.group_size)
    low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    if recipe.sym:
        high = torch.maximum(low.abs(), high)
        low = torch.where(low < 0, -high, low)
    empty = (low == 0) & (high == 0)
    low, high = torch.where(empty, -1.0, low), torch.where(empty, 1.0, high)
    scales = ((high - low) / MAX_CODE).half()
    zeros = torch.full_like(low, (MAX_CODE + 1) // 2) if recipe.sym else torch.round(-low / scales.float())
    g = g_idx.long()
    codes = (torch.round(weight / scales.float()[:, g]) + zeros[:, g]).clamp(0, MAX_CODE)
    return {"q": codes.int(), "z": zeros.int(), "s": scales, "g_idx": g_idx,
            "bits": BITS, "sym": recipe.sym, "desc_act": recipe.desc_act, "group_size": recipe.group_size}  # fmt: skip


# q / k / v read the attention's input, gate / up the MLP's: one key for each shared input.
SHARED_INPUT = re.compile(r"\.(q|k|v|gate|up)_proj\.weight$")


def reader_of(name: str) -> str:
    """A decoder linear's weight name -> the name of the input it reads ('...self_attn', '...mlp', or its own)."""
    return SHARED_INPUT.sub("", name) if SHARED_INPUT.search(name) else name


def _input_importance(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Each linear's inputs' importance, the same for the linears reading one input (q / k / v; gate / up), as
    GPTQ's Hessian of that input is: the squared norms of the inputs' columns summed over those linears (no
    calibration data here)."""
    totals: dict[str, torch.Tensor] = {}
    for name, weight in weights.items():
        key = reader_of(name)
        totals[key] = totals.get(key, 0) + weight.square().sum(0)
    return {name: totals[reader_of(name)] for name in weights}


# ---- packing, and the fp32 reference from the packed words ----------------------------------------------------


def _packed(recipe: NativeRecipe, weights: dict[str, torch.Tensor]) -> dict[str, dict[str, torch.Tensor]]:
    """Each linear's components as the tool packs them (int32 words, fp16 scales), keyed by its weight's name;
    the tool's own readback (fp16 arithmetic) is checked against the fp32 dequantization of those words."""
    names = sorted(weights)
    if recipe.method == "awq":
        cases = [{**_awq_codes(weights[n], recipe.group_size), "group_size": recipe.group_size} for n in names]
        made = run_tool("autoawq", cases)
        packed = [m["gemm"] for m in made]
        readback = [m["gemm_dequantized"] for m in made]
    else:
        importance = _input_importance(weights)
        made = run_tool("gptqmodel", [_gptq_codes(weights[n], recipe, importance[n]) for n in names])
        packed = [m["gptq"] for m in made]
        readback = [m["dequantized"] for m in made]
    for name, components, theirs in zip(names, packed, readback):
        ours = dequantized(recipe, components)
        if not torch.equal(theirs.t().half(), ours.half()):
            raise AssertionError(f"{recipe.tool}'s readback of {name} is not its fp32 dequantization rounded")
    return {n: {c: t.contiguous() for c, t in p.items()} for n, p in zip(names, packed)}


def dequantized(recipe: NativeRecipe, components: dict[str, torch.Tensor]) -> torch.Tensor:
    """The stored words -> the fp32 weight [out, in], by the formula of the tool's readers (transcribed)."""
    if recipe.method == "awq":
        return vllm_awq_dequantize(components["qweight"], components["qzeros"], components["scales"]).t()
    return gptqmodel_dequantize(
        components["qweight"], components["qzeros"], components["scales"], components["g_idx"], BITS, v1=True
    ).t()


def make_native(base: Path, recipe: NativeRecipe, out: Path) -> Path:
    """`base` with every decoder linear packed by the tool, plus fp32-reference/ dequantized from what was saved."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(base / WEIGHTS))
    linears = {n: t.float() for n, t in tensors.items() if DECODER_LINEAR.fullmatch(n)}
    stored = {n: t for n, t in tensors.items() if n not in linears}
    for name, components in _packed(recipe, linears).items():
        stored.update({f"{name.removesuffix('.weight')}.{c}": t for c, t in components.items()})
    save_file(stored, str(out / WEIGHTS), metadata={"format": "pt"})

    config = json.loads((base / "config.json").read_text())
    for source in base.iterdir():  # tokenizer, template, processor and generation files as the base has them
        if source.is_file() and not source.name.startswith((".", "model")) and source.name != "config.json":
            shutil.copyfile(source, out / source.name)
    (out / "config.json").write_text(
        json.dumps({**config, "quantization_config": quantization_config(recipe)}, indent=2) + "\n"
    )

    reference = out / REFERENCE
    shutil.copytree(out, reference, ignore=shutil.ignore_patterns(WEIGHTS, "config.json", REFERENCE))
    saved = load_file(str(out / WEIGHTS))  # from the file: the reference is what a reader of it gets
    plain = {n: t for n, t in saved.items() if not n.endswith(COMPONENTS)}
    for name in linears:
        linear = name.removesuffix(".weight")
        parts = {c: saved[f"{linear}.{c}"] for c in COMPONENTS if f"{linear}.{c}" in saved}
        plain[name] = dequantized(recipe, parts).contiguous()
    save_file(plain, str(reference / WEIGHTS), metadata={"format": "pt"})
    (reference / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out


def content_key(base: Path, recipe: NativeRecipe) -> str:
    """What the files depend on: the base's weights and config, the recipe, the tools' pins, this maker."""
    digest = hashlib.sha256()
    for name in (WEIGHTS, "config.json"):
        digest.update((base / name).read_bytes())
    digest.update(json.dumps([dataclasses.asdict(recipe), TOOL_PINS[recipe.tool], MAKER_VERSION]).encode())
    return digest.hexdigest()[:12]


def cached_native(base: Path, recipe: str) -> Path:
    """`base` packed with `NATIVE_RECIPES[recipe]`, made once and cached under the checkpoint cache."""
    spec = NATIVE_RECIPES[recipe]
    name = f"{Path(base).name}-native-{recipe}-{content_key(Path(base), spec)}"
    return cached_checkpoint(name, lambda tmp: make_native(Path(base), spec, tmp))


def reference_dir(checkpoint: Path) -> Path:
    return Path(checkpoint) / REFERENCE
