"""Pre-quantized checkpoints (issue 51): compressed-tensors W4A16 / W8A8 read as the library writes them.

The checkpoints are made here by compressed-tensors' own compressor (`ModelCompressor.compress_model`, the
step llm-compressor ends with) on the tiny random Qwen2.5-VL, with min-max scales from the library's own
`calculate_qparams`; the reference each is held to is the same in-memory model after the library's own
`decompress_model`: Transformers on the dequantized weights, and for W8A8 with the library's run-time
rounding of the activations (its quantized forward).
"""

from __future__ import annotations

import functools
import json
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from testkit.checkpoints import default_cache_root
from testkit.qwen_vl_checkpoints import cached_qwen2_5_vl
from tests.conftest import hf_greedy, make_image, user
from tests.family_table import meta_model
from tests.released_configs import QWEN2_5_VL_RELEASES, released_checkpoint
from vlm_engine import Engine, SamplingParams
from vlm_engine.models import loader
from vlm_engine.models.quant_formats import GroupedWeights, UnsupportedQuantization, checkpoint_format
from vlm_engine.models.quant_formats.compressed_tensors import unpack_int32
from vlm_engine.models.quantized import QuantizedLinear, fake_quantize_per_token, grouped_panels

MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
CONVERSATIONS = [
    [{"role": "user", "content": "Tell me a story about a red fox."}],
    user(make_image(64, 48, 1), "What is in this picture?"),
]
IGNORE = ["lm_head", "re:.*visual.*"]  # the published VLM recipes': head and tower stay in floating point

# name -> (compressed-tensors format, its QuantizationScheme's fields but targets)
SCHEMES: dict[str, tuple[str, dict[str, Any]]] = {
    "w4a16-group32": ("pack-quantized", {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 32}}),
    "w4a16-asym-group64": ("pack-quantized", {"weights": {
        "num_bits": 4, "type": "int", "symmetric": False, "strategy": "group", "group_size": 64, "actorder": "weight"}}),
    "w4a16-channel": ("pack-quantized", {"weights": {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "channel"}}),
    "w8a8": ("int-quantized", {
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel"},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True},
    }),
}  # fmt: skip


# ---- checkpoints written by compressed-tensors ---------------------------------------------------------


def _calibrate(module: Any) -> None:
    """Min-max weight scales (and zero points) by the library's formula."""
    from compressed_tensors.quantization.utils import calculate_qparams

    args = module.quantization_scheme.weights
    weight = module.weight.detach().float()
    out, inputs = weight.shape
    if args.strategy == "group":
        grouped = weight.view(out, inputs // args.group_size, args.group_size)
        low, high = grouped.amin(-1), grouped.amax(-1)
    else:
        low, high = weight.amin(-1, keepdim=True), weight.amax(-1, keepdim=True)
    scale, zero_point = calculate_qparams(low, high, args)
    module.weight_scale.data.copy_(scale.to(module.weight_scale.dtype))
    if getattr(module, "weight_zero_point", None) is not None:
        module.weight_zero_point.data.copy_(zero_point.to(module.weight_zero_point.dtype))


@functools.cache
def quantized(name: str) -> tuple[Path, Any]:
    """(the compressed checkpoint's directory, the in-memory model after compressed-tensors' decompression)."""
    import compressed_tensors
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, QuantizationScheme, apply_quantization_config
    from transformers import AutoModelForImageTextToText, AutoProcessor

    base = cached_qwen2_5_vl("tiny")
    fmt, scheme = SCHEMES[name]
    out = default_cache_root() / f"qwen2.5-vl-tiny-ct{compressed_tensors.__version__}-{name}"
    model = AutoModelForImageTextToText.from_pretrained(str(base), dtype=torch.float32).eval()
    config = QuantizationConfig(
        config_groups={"group_0": QuantizationScheme(targets=["Linear"], **scheme)}, ignore=IGNORE
    )
    apply_quantization_config(model, config)
    for module in model.modules():
        if getattr(module, "quantization_scheme", None) is not None:
            _calibrate(module)
    compressor = ModelCompressor.from_pretrained_model(model, quantization_format=fmt)
    # The library lists every ignored module by its in-memory name ("visual.blocks.0.attn.qkv"), which Transformers 5
    # no longer matches on load ("model.visual..."): the recipes' patterns instead, as published checkpoints carry.
    compressor.quantization_config.ignore = IGNORE
    compressor.compress_model(model)
    if out.exists():
        shutil.rmtree(out)
    model.save_pretrained(str(out))
    compressor.update_config(str(out))
    AutoProcessor.from_pretrained(str(base)).save_pretrained(str(out))
    compressor.decompress_model(model)
    return out, model


def hf_reference(name: str) -> tuple[Any, Any]:
    from transformers import AutoProcessor

    path, model = quantized(name)
    return model, AutoProcessor.from_pretrained(str(path))


def _layer_key(name: str) -> str:
    """'model.language_model.layers.0.mlp.up_proj.weight' -> 'layers.0.mlp.up_proj' (checkpoint and module names)."""
    found = re.search(r"layers\.\d+\..*?(?=\.weight$|$)", name)
    return found.group(0) if found else name


def read_grouped(path: Path) -> Iterator[tuple[str, GroupedWeights]]:
    fmt = checkpoint_format(json.loads((path / "config.json").read_text()))
    assert fmt is not None
    stream = loader.grouped_weights(loader.iter_safetensors(path), fmt, loader.safetensors_names(path))
    yield from ((n, g) for n, g in stream if isinstance(g, GroupedWeights))


@functools.cache
def engine(name: str, numerics: str) -> Engine:
    return Engine(str(quantized(name)[0]), dtype="float32", kv_cache_tokens=2048, numerics=numerics)


# ---- the format -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
def test_unpacking_inverts_compressed_tensors_packing(bits: int) -> None:
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    low, high = -(1 << (bits - 1)), 1 << (bits - 1)
    codes = torch.randint(low, high, (5, 72), generator=torch.Generator().manual_seed(bits), dtype=torch.int8)
    assert torch.equal(unpack_int32(pack_to_int32(codes, bits), bits, 72), codes)


@pytest.mark.slow
@pytest.mark.parametrize("name", sorted(SCHEMES))
def test_dequantized_weights_equal_compressed_tensors_decompression(name: str) -> None:
    """Bit for bit: our reader's fp32 weights and the library's own decompression (fp32 scales)."""
    path, model = quantized(name)
    theirs = {_layer_key(n): m.weight for n, m in model.named_modules() if getattr(m, "quantization_scheme", None)}
    ours = {_layer_key(n): g for n, g in read_grouped(path)}
    assert sorted(ours) == sorted(k for k in theirs if "visual" not in k) and len(ours) == 4 * 7
    for key, grouped in ours.items():
        assert torch.equal(grouped.dequantize(), theirs[key].float()), key
    fmt = checkpoint_format(json.loads((path / "config.json").read_text()))
    assert (fmt.activations is not None) == (name == "w8a8")


def test_act_order_groups_are_read_as_compressed_tensors_dequantizes() -> None:
    """`weight_g_idx` (actorder "group": older compressed-tensors wrote it; 0.20 neither writes nor reads it),
    asymmetric: the components packed by the library's `pack_to_int32`; the reference is its group `dequantize` on
    the inputs sorted by group, put back in order (what its `_process_group` did with a g_idx)."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    g = torch.Generator().manual_seed(5)
    out, inputs, size = 48, 128, 32
    codes = torch.randint(-8, 8, (out, inputs), generator=g, dtype=torch.int8)
    zero_point = torch.randint(-8, 8, (out, inputs // size), generator=g, dtype=torch.int8)
    scale = torch.rand(out, inputs // size, generator=g) * 0.05
    g_idx = torch.empty(inputs, dtype=torch.int32)
    g_idx[torch.randperm(inputs, generator=g)] = (torch.arange(inputs) // size).int()
    linear = "model.layers.0.mlp.up_proj"
    tensors = {
        "weight_packed": pack_to_int32(codes, 4), "weight_scale": scale, "weight_shape": torch.tensor([out, inputs]),
        "weight_zero_point": pack_to_int32(zero_point, 4, packed_dim=0), "weight_g_idx": g_idx,
    }  # fmt: skip
    weights = {
        "num_bits": 4,
        "type": "int",
        "symmetric": False,
        "strategy": "group",
        "group_size": size,
        "actorder": "group",
    }
    fmt = checkpoint_format({"quantization_config": {
        "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights}},
    }})  # fmt: skip
    assert fmt is not None
    named = [(f"{linear}.{k}", t) for k, t in tensors.items()]
    ((name, grouped),) = list(loader.grouped_weights(named, fmt, [n for n, _ in named]))
    assert name == f"{linear}.weight" and grouped.group_of_input is not None
    by_group = torch.argsort(g_idx, stable=True)
    args = QuantizationArgs(**{**weights, "actorder": None})
    sorted_weights = dequantize(x_q=codes[:, by_group], scale=scale, zero_point=zero_point, args=args)
    theirs = sorted_weights.index_select(1, torch.argsort(by_group))
    assert torch.equal(grouped.dequantize(), theirs)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("weights", {"num_bits": 8, "type": "float", "strategy": "channel"}, "weights.type 'float', num_bits 8 (fp8)"),
        ("weights", {"num_bits": 2, "type": "int", "strategy": "group", "group_size": 32}, "num_bits 2"),
        ("format", "nvfp4-pack-quantized", "format 'nvfp4-pack-quantized'"),
        (
            "input_activations",
            {"num_bits": 8, "type": "int", "strategy": "tensor", "dynamic": False},
            "input_activations",
        ),
    ],
)
def test_an_unsupported_scheme_is_refused_before_any_weight_is_read(
    tmp_path: Path, field: str, value: Any, named: str
) -> None:
    """A config.json alone (no weights at all): the engine fails on the scheme's field, not on missing files."""
    config = json.loads((cached_qwen2_5_vl("tiny") / "config.json").read_text())
    group = {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32}}
    group[field] = value
    config["quantization_config"] = {
        "quant_method": "compressed-tensors", "format": "int-quantized" if field == "input_activations" else "pack-quantized",
        "config_groups": {"group_0": group}, "quantization_status": "compressed",
    }  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantization, match=re.escape(named)):
        Engine(str(tmp_path), dtype="float32", kv_cache_tokens=256)


@pytest.mark.parametrize("method", ["fp8", "bitsandbytes", "modelopt", "exl2"])
def test_other_quantization_methods_are_named_in_the_error(method: str) -> None:
    with pytest.raises(UnsupportedQuantization, match=f"quant_method '{method}'"):
        checkpoint_format({"quantization_config": {"quant_method": method}})


def test_an_unquantized_config_has_no_format() -> None:
    assert checkpoint_format(json.loads((cached_qwen2_5_vl("tiny") / "config.json").read_text())) is None


# ---- our panels from the codes ------------------------------------------------------------------------------


def _grouped(bits: int, group_size: int, asymmetric: bool, act_order: bool, seed: int = 0) -> GroupedWeights:
    g = torch.Generator().manual_seed(seed)
    out, inputs = 70, 256  # 70: a partial last panel of 16 rows
    groups = inputs // group_size
    scales = torch.rand(out, groups, generator=g) * 0.02 + 0.001
    if bits == 8:
        codes = torch.randint(-128, 128, (out, inputs), generator=g, dtype=torch.int8)  # -128 included
        zeros = None
    elif asymmetric:
        codes = torch.randint(0, 16, (out, inputs), generator=g, dtype=torch.int16)
        zeros = torch.randint(0, 16, (out, groups), generator=g).float()
    else:
        codes, zeros = torch.randint(-8, 8, (out, inputs), generator=g, dtype=torch.int8), None
    order = None
    if act_order:
        order = torch.empty(inputs, dtype=torch.long)
        order[torch.randperm(inputs, generator=g)] = torch.arange(inputs) // group_size
    return GroupedWeights(codes, scales, zeros, bits, group_size, order)


@pytest.mark.parametrize(
    ("bits", "group_size", "asymmetric", "act_order"),
    [
        (4, 32, False, False),
        (4, 128, True, False),
        (4, 64, True, True),
        (4, 256, False, False),
        (8, 256, False, False),
        (8, 32, False, True),
    ],
)
def test_panels_from_codes_stand_for_the_checkpoint_weights(
    ops: Any, bits: int, group_size: int, asymmetric: bool, act_order: bool
) -> None:
    """The panels' weights are the checkpoint's up to the fp16 rounding of d and m, and the kernel (act-order:
    x's columns permuted first) computes the product of those weights."""
    grouped = _grouped(bits, group_size, asymmetric, act_order)
    layer = QuantizedLinear.from_grouped(grouped, ops)
    assert layer is not None and (layer.input_order is not None) == act_order
    # int4 keeps one (d, m) per checkpoint group; int8 one d per 32 inputs.
    assert layer.scales.shape[1] == grouped.shape[1] // (group_size if bits == 4 else 32)
    want, got = grouped.dequantize(), layer.dequantized_weight()
    # d * q: d's fp16 rounding (2^-11 relative) times the code; m = -d z rounded once more.
    bound = grouped.scales.max() * 2**-11 * (1 << bits) * 2
    assert (got - want).abs().max() <= bound
    x = torch.randn(3, grouped.shape[1], generator=torch.Generator().manual_seed(1))
    # The kernel rounds x to int8 per group of 32: a few steps of max|x|/127 per group.
    torch.testing.assert_close(layer(x), x @ got.T, rtol=0.02, atol=0.05 * float(want.abs().max()) * 32)


def test_groups_our_blocks_cannot_hold_are_left_to_the_fallback() -> None:
    assert grouped_panels(_grouped(4, 16, False, False)) is None  # two scales inside one block of 32
    asym8 = _grouped(8, 32, False, False)
    assert (
        grouped_panels(GroupedWeights(asym8.codes.to(torch.int16) + 128, asym8.scales, asym8.scales * 0 + 120, 8, 32))
        is None
    )


# ---- the engine against the references ----------------------------------------------------------------------


@pytest.mark.slow
def test_exact_w4a16_equals_transformers_on_the_dequantized_weights() -> None:
    """Greedy tokens, text and one image, asymmetric groups of 64: token for token."""
    ours = engine("w4a16-asym-group64", "exact").chat(CONVERSATIONS, GREEDY)
    reference = hf_reference("w4a16-asym-group64")
    assert [o.token_ids for o in ours] == [hf_greedy(reference, c, MAX_TOKENS) for c in CONVERSATIONS]


def _greedy_with_margins(hf: tuple[Any, Any], messages: list[dict[str, Any]]) -> tuple[list[int], list[float]]:
    """Transformers' greedy tokens and, at each, the gap between its two most likely tokens (log-probs)."""
    from tests.conftest import to_hf_messages

    model, processor = hf
    hf_messages, images = to_hf_messages(messages)
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=images or None, return_tensors="pt")
    with torch.inference_mode():
        out = model.generate(
            **inputs, max_new_tokens=MAX_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True
        )
    top2 = [torch.topk(torch.log_softmax(step[0].float(), -1), 2).values for step in out.logits]
    return out.sequences[0, inputs["input_ids"].shape[1] :].tolist(), [float(t[0] - t[1]) for t in top2]


NEAR_TIE = 0.01  # nats between the reference's two best tokens


@pytest.mark.slow
def test_exact_w8a8_follows_the_fake_quantized_reference() -> None:
    """W8A8's reference is compressed-tensors' quantized forward (each token's activations rounded to int8) on the
    dequantized weights. Rounding turns the last-ulp differences of our exact ops (merged q/k/v and gate/up
    products) into whole steps of an element now and then, so tokens are equal up to a near-tie of the reference
    (a divergence only where its two best tokens lie within NEAR_TIE), and each linear is the reference's own
    on the same inputs."""
    ours = engine("w8a8", "exact").chat(CONVERSATIONS, GREEDY)
    reference = hf_reference("w8a8")
    for out, conversation in zip(ours, CONVERSATIONS):
        theirs, margins = _greedy_with_margins(reference, conversation)
        agree = next((i for i, (a, b) in enumerate(zip(out.token_ids, theirs)) if a != b), MAX_TOKENS)
        assert agree >= MAX_TOKENS // 2 and (agree == MAX_TOKENS or margins[agree] < NEAR_TIE), (out.token_ids, theirs)
    modules = dict(engine("w8a8", "exact").model.named_modules())
    x = torch.randn(3, 7, 512, generator=torch.Generator().manual_seed(2)) * 3
    for name, theirs_module in reference[0].named_modules():
        if name.endswith(("o_proj", "down_proj")) and "visual" not in name:
            ours_module = modules[name.replace("model.language_model.", "model.")]
            inputs = x[..., : theirs_module.in_features]
            with torch.no_grad():
                assert torch.equal(ours_module(inputs), theirs_module(inputs)), name


def test_w8a8_activations_are_rounded_as_compressed_tensors_rounds_them() -> None:
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils import compute_dynamic_scales_and_zp

    args = QuantizationArgs(num_bits=8, type="int", symmetric=True, strategy="token", dynamic=True)
    x = torch.randn(1, 9, 128, generator=torch.Generator().manual_seed(3)) * 4
    x[0, 2] = 0.0  # a zero row: the library's eps scale
    scale, zero = compute_dynamic_scales_and_zp(value=x, args=args, module=torch.nn.Module())
    assert torch.equal(fake_quantize_per_token(x[0]), fake_quantize(x, scale, zero, args)[0])


# Fast numerics' tolerance. Per linear: the weights are the checkpoint's up to fp16 d and m (< 2^-8 of the largest
# |w|), the product within PRODUCT_RTOL (relative L2) of the exact one on the same rows: our kernels round x to
# int8 per group of 32 (W8A8 too: finer than the checkpoint's per-token rounding). End to end, the tiny random model
# (init std 0.2) amplifies that rounding: at the first generated position the two runs' top-5 log-probs differ by
# up to ~0.75 nats (our own --quantization int8 / int4 of the unquantized checkpoint: 0.2-0.55), so what is held
# is that fast's greedy token is among exact's five best and their shared top-5 log-probs within FIRST_LOGPROB_ATOL.
PRODUCT_RTOL = 0.06
FIRST_LOGPROB_ATOL = 1.0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["w4a16-group32", "w4a16-asym-group64", "w8a8"])
def test_fast_numerics_serve_the_codes_within_tolerance(name: str) -> None:
    """Fast: every decoder linear on our int4 / int8 kernels from the codes; the tower and head as stored."""
    fast, exact = engine(name, "fast"), engine(name, "exact")
    exact_modules = dict(exact.model.named_modules())
    layers = {p: m for p, m in fast.model.named_modules() if isinstance(m, QuantizedLinear)}
    assert len(layers) == 4 * 4 and {m.bits for m in layers.values()} == {8 if name == "w8a8" else 4}
    g = torch.Generator().manual_seed(4)
    for path, layer in layers.items():
        weight = exact_modules[path].weight.float()
        assert (layer.dequantized_weight() - weight).abs().max() <= 2**-8 * weight.abs().max(), path
        x = torch.randn(6, layer.in_features, generator=g) * 3
        want = x @ weight.T
        assert (layer(x) - want).norm() <= PRODUCT_RTOL * want.norm(), path
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=5)
    for f, e in zip(fast.chat(CONVERSATIONS, params), exact.chat(CONVERSATIONS, params)):
        best = dict(e.logprobs[0].top_logprobs)
        assert f.token_ids[0] in best
        for token, logprob in f.logprobs[0].top_logprobs:
            assert token not in best or abs(best[token] - logprob) < FIRST_LOGPROB_ATOL


@pytest.mark.slow
@pytest.mark.parametrize("name", ["w4a16-group32", "w8a8"])
def test_transformers_loading_the_compressed_checkpoint_agrees(name: str) -> None:
    """Transformers itself reading the compressed files (compressed-tensors installed, CPU): its logits are the
    decompressed reference's."""
    from transformers import AutoModelForImageTextToText

    path, reference = quantized(name)
    theirs = AutoModelForImageTextToText.from_pretrained(str(path), dtype=torch.float32).eval()
    ids = torch.arange(5, 45).unsqueeze(0)
    with torch.inference_mode():
        torch.testing.assert_close(theirs(input_ids=ids).logits, reference(input_ids=ids).logits, rtol=1e-5, atol=1e-5)


def test_quantizing_a_quantized_checkpoint_again_is_refused() -> None:
    with pytest.raises(ValueError, match="already quantized"):
        Engine(str(quantized("w4a16-group32")[0]), dtype="float32", kv_cache_tokens=256, quantization="int4")


# ---- the published checkpoints' names, on the meta device ----------------------------------------------------

# RedHatAI/Qwen2.5-VL-7B-Instruct-quantized.w4a16 (llm-compressor GPTQ, W4A16 group 128): the text decoder's
# linears stored as weight_packed int32 [out, in/8], weight_scale bf16 [out, in/128], weight_shape int64 [2]; the
# vision tower (visual.*) and lm_head as Qwen2.5-VL-7B-Instruct's own bf16 tensors.
PUBLISHED_W4A16 = {
    "quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
    "config_groups": {"group_0": {"targets": ["Linear"], "weights": {
        "num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": 128, "actorder": "weight",
        "dynamic": False, "observer": "minmax"}, "input_activations": None, "output_activations": None}},
    "ignore": ["lm_head", "re:visual.*"], "kv_cache_scheme": None, "sparsity_config": {},
}  # fmt: skip
LINEAR = re.compile(r"model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight")


def test_published_w4a16_names_load_on_meta() -> None:
    config = QWEN2_5_VL_RELEASES["Qwen2.5-VL-7B-Instruct"].config()
    checkpoint: list[tuple[str, torch.Tensor]] = []
    for name, tensor in released_checkpoint(QWEN2_5_VL_RELEASES["Qwen2.5-VL-7B-Instruct"], config):
        if not LINEAR.fullmatch(name):
            checkpoint.append((name, tensor))
            continue
        out, inputs = tensor.shape
        linear = name.removesuffix(".weight")
        checkpoint += [
            (f"{linear}.weight_packed", torch.empty(out, inputs // 8, dtype=torch.int32, device="meta")),
            (f"{linear}.weight_scale", torch.empty(out, inputs // 128, dtype=torch.bfloat16, device="meta")),
            (f"{linear}.weight_shape", torch.tensor([out, inputs])),
        ]
    fmt = checkpoint_format({"quantization_config": PUBLISHED_W4A16})
    assert fmt is not None
    taken: list[tuple[str, str | None, tuple[int, int]]] = []

    def take(path: str, shard: str | None, grouped: GroupedWeights) -> bool:
        taken.append((path, shard, grouped.shape))
        return True

    stream = loader.grouped_weights(checkpoint, fmt, [n for n, _ in checkpoint])
    assert loader.load_weights(meta_model(config), stream, on_grouped=take) == []
    assert len(taken) == 28 * 7  # q, k, v, o, gate, up, down of each layer, each into its (fused) module
    assert ("model.layers.0.self_attn.qkv_proj", "k_proj", (512, 3584)) in taken
