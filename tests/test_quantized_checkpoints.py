"""Checkpoints quantized by llm-compressor itself (testkit/quant_makers.py: GPTQ W4A16 g32, GPTQ g128 with act-order,
AWQ asymmetric g32, W8A8 int8 with dynamic per-token activations), made offline from the tiny random Qwen2.5-VL in a
side venv, as a user downloads them: compressed-tensors, the head and the vision tower unquantized (issue 51).

The makers: each checkpoint's config names its scheme, it stores exactly the decoder's linears quantized, and our
Transformers loads it. The engine: greedy tokens in exact numerics equal Transformers' `generate` on the same
checkpoint's weights dequantized to fp32 by compressed-tensors (`dequantize=True`); for W8A8, with the activations
fake-quantized as compressed-tensors' own forward does it (per token, dynamic, in fp32). Fast numerics agree
with exact within the family matrix's tolerance.

Transformers' compressed route (`dequantize=False`) is not the reference: it matches the config's `ignore` names
(written as the checkpoint names them, `visual.blocks.0.attn.qkv`) against its module names (`model.visual...`),
so it wraps the tower's linears too and leaves their weights unloaded; for the asymmetric checkpoint it also sizes
the packed zero points unpacked and refuses to load."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import pytest
import torch

from testkit.quant_makers import RECIPES, cached_quantized, maker_record
from testkit.qwen_vl_checkpoints import QWEN2_5_VL_PRESETS, cached_qwen2_5_vl

pytestmark = pytest.mark.slow

TEXT = QWEN2_5_VL_PRESETS["tiny"]["text"]
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")  # fmt: skip
QUANTIZED = {f"model.layers.{i}.{name}" for i in range(TEXT["num_hidden_layers"]) for name in LINEARS}


def recipes() -> list[Any]:
    return [pytest.param(name, id=name) for name in sorted(RECIPES)]


@functools.cache
def quantized(recipe: str) -> Path:
    return cached_quantized(cached_qwen2_5_vl("tiny"), recipe)


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


# ---- the makers -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("recipe", recipes())
def test_the_config_names_the_scheme(recipe: str) -> None:
    spec, config = RECIPES[recipe], json.loads((quantized(recipe) / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["format"]) == ("compressed-tensors", spec.format)
    (group,) = config["config_groups"].values()
    weights, activations = group["weights"], group["input_activations"]
    strategy = "group" if spec.group_size else "channel"
    assert (weights["num_bits"], weights["strategy"], weights["group_size"], weights["symmetric"]) == (
        spec.weight_bits, strategy, spec.group_size, spec.symmetric)  # fmt: skip
    if spec.actorder:
        assert weights["actorder"] == spec.actorder
    if spec.activation_bits:
        assert (activations["num_bits"], activations["strategy"], activations["dynamic"]) == (8, "token", True)
    else:
        assert activations is None
    # the head and every linear of the tower are named unquantized, as the checkpoint names them
    assert "lm_head" in config["ignore"]
    assert "visual.blocks.0.attn.qkv" in config["ignore"] and "visual.merger.mlp.0" in config["ignore"]
    record = maker_record(quantized(recipe))
    assert record["tools"]["llmcompressor"] == "0.14.0.1" and record["rewritten"] == []


@pytest.mark.parametrize("recipe", recipes())
def test_exactly_the_decoder_linears_are_stored_quantized(recipe: str) -> None:
    spec, tensors = RECIPES[recipe], checkpoint_tensors(quantized(recipe))
    assert {name.removesuffix(".weight_scale") for name in tensors if name.endswith(".weight_scale")} == QUANTIZED
    base = checkpoint_tensors(cached_qwen2_5_vl("tiny"))
    floats = {name for name in tensors if tensors[name].is_floating_point() and not name.endswith("_scale")}
    assert floats == {name for name in base if name.removesuffix(".weight") not in QUANTIZED}
    assert torch.equal(tensors["visual.blocks.0.attn.qkv.weight"], base["visual.blocks.0.attn.qkv.weight"])
    assert torch.equal(tensors["lm_head.weight"], base["lm_head.weight"])
    down = "model.layers.0.mlp.down_proj"
    out_features, in_features = base[f"{down}.weight"].shape
    groups = in_features // spec.group_size if spec.group_size else 1
    assert tensors[f"{down}.weight_scale"].shape == (out_features, groups)
    if spec.format == "pack-quantized":  # eight 4-bit codes an int32
        assert tensors[f"{down}.weight_packed"].shape == (out_features, in_features * spec.weight_bits // 32)
    else:
        assert tensors[f"{down}.weight"].dtype == torch.int8
    assert (f"{down}.weight_zero_point" in tensors) == (not spec.symmetric)


@functools.cache
def reference_model(recipe: str) -> tuple[Any, Any]:
    """Transformers' model of the checkpoint with its weights dequantized to fp32 by compressed-tensors; for W8A8,
    each quantized linear's input fake-quantized by compressed-tensors' own forward (per token, dynamic)."""
    from compressed_tensors.quantization import QuantizationScheme, QuantizationStatus
    from compressed_tensors.quantization.lifecycle.forward import set_forward_quantized
    from transformers import AutoModelForImageTextToText, AutoProcessor, CompressedTensorsConfig

    path = quantized(recipe)
    model, info = AutoModelForImageTextToText.from_pretrained(
        str(path), dtype=torch.float32, quantization_config=CompressedTensorsConfig(dequantize=True),
        output_loading_info=True,
    )  # fmt: skip
    assert not any(info.values()), info  # no tensor missing, unexpected or mismatched
    if RECIPES[recipe].activation_bits:
        (group,) = json.loads((path / "config.json").read_text())["quantization_config"]["config_groups"].values()
        scheme = QuantizationScheme(targets=group["targets"], input_activations=group["input_activations"])
        for name in QUANTIZED:  # checkpoint names; the decoder's modules live under model.language_model
            linear = model.get_submodule(name.replace("model.", "model.language_model.", 1))
            # the weights are already dequantized: only the input is quantized on the fly
            linear.quantization_scheme, linear.quantization_status = scheme, QuantizationStatus.COMPRESSED
            set_forward_quantized(linear)
    return model.eval(), AutoProcessor.from_pretrained(str(path))


@pytest.mark.parametrize("recipe", recipes())
def test_transformers_loads_it_dequantized(recipe: str) -> None:
    """Every decoder linear holds at most 2**bits values per group of inputs: what the codes dequantize to."""
    spec = RECIPES[recipe]
    model, _ = reference_model(recipe)
    weight = model.get_submodule("model.language_model.layers.1.mlp.down_proj").weight.detach()
    per_group = weight.unflatten(1, (-1, spec.group_size or weight.shape[1]))
    distinct = max(len(torch.unique(per_group[row, group])) for row in range(8) for group in range(per_group.shape[1]))
    assert 2 < distinct <= 2**spec.weight_bits


def test_the_w8a8_reference_quantizes_the_activations() -> None:
    """The reference's linears see their input rounded per token to int8, symmetric, the scale its largest magnitude
    over 127.5 (compressed-tensors' calculate_qparams: half the 255-step range); the dequantized weights alone do
    not round it."""
    model, _ = reference_model("w8a8-int8-dynamic")
    linear = model.get_submodule("model.language_model.layers.0.mlp.down_proj")
    x = torch.randn(1, 3, linear.in_features, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        quantized_input = linear(x)
        plain = torch.nn.functional.linear(x, linear.weight, linear.bias)
    assert not torch.equal(quantized_input, plain)
    scale = x.abs().amax(-1, keepdim=True) / 127.5
    rounded = torch.nn.functional.linear((x / scale).round().clamp(-128, 127) * scale, linear.weight, linear.bias)
    torch.testing.assert_close(quantized_input, rounded, rtol=1e-5, atol=1e-5)
