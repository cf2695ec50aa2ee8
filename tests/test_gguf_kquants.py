"""A quantized GGUF's linears served from their codes on our int4 / int8 kernels (quant_formats/gguf_blocks.py).

Blocks: Q4_0, Q4_1 (int4) and Q8_0, Q5_0 (int8) give back gguf-py's dequantized values exactly; Q4_K's codes go to
int4 with its sub-block scale and minimum rounded to fp16; Q5_1, Q5_K, Q6_K are re-rounded to int8 per block of 32
(llama.cpp's Q8_0), as is an LM head of 4 bits. Engines on llama-quantize's files (testkit/gguf_makers.py) hold
int4 / int8 QuantizedLinears as the file's types say, the codes' bytes instead of bf16 weights, and stay within a
stated KL of exact numerics (gguf-py's fp32 values)."""

from __future__ import annotations

import functools
import itertools
from collections import Counter
from typing import Any

import numpy as np
import pytest
import torch

from testkit import gguf_makers
from tests.conftest import make_image, user
from vlm_engine import Engine, SamplingParams
from vlm_engine.models import loader, registry
from vlm_engine.models.build import concat_outputs
from vlm_engine.models.quant_formats import gguf_blocks
from vlm_engine.models.quantized import PANEL_ROWS, QuantizedLinear, grouped_panels

EXACT = {"Q4_0": 4, "Q4_1": 4, "Q5_0": 8, "Q8_0": 8}  # gguf-py quantizes these; our panels hold them exactly
TEXT = (
    "Tell me a story about a red fox who lived in a forest near the river, and the bird that visited "
    "him every morning. The fox was clever and the bird was kind, so they became friends for life."
)


def random_weights(out: int = 40, inputs: int = 256, seed: int = 0) -> np.ndarray:
    """Normal weights with a constant block (a zero scale: the block is its minimum) and a zero one; 40 outputs
    leave the last panel of 16 partial."""
    rng = np.random.default_rng(seed)
    weights = rng.normal(0.0, 0.05, size=(out, inputs)).astype(np.float32)
    weights[3, 32:64] = 0.0371
    weights[5, :32] = 0.0
    return weights


def reference(type_name: str, data: np.ndarray, shape: tuple[int, int]) -> torch.Tensor:
    return gguf_blocks.dequantized(type_name, data, shape)


def q8_0_bound(values: torch.Tensor) -> torch.Tensor:
    """Per weight, how far Q8_0 of `values` may land: half a step d = amax / 127 per block of 32, plus d's
    fp16 rounding times the largest code, plus fp32 rounding."""
    out, inputs = values.shape
    d = values.abs().reshape(out, inputs // 32, 32).amax(-1) / 127
    bound = d / 2 + 127 * (d.half().float() - d).abs() + 1e-6 * 127 * d
    return bound.repeat_interleave(32, dim=1)


def fp16_bound(grouped: Any) -> torch.Tensor:
    """Per weight, how far int4 panels with fp16 d = scale and m = offset - scale * zero may land from the fp32
    d * q + m: the codes are exact, d's rounding times the largest code plus m's, plus fp32 rounding."""
    d = grouped.scales.float()
    m = grouped.offsets.float() - d * grouped.zeros.float()
    bound = 15 * (d.half().float() - d).abs() + (m.half().float() - m).abs() + 1e-6 * (15 * d.abs() + m.abs())
    return bound.repeat_interleave(32, dim=1)


@pytest.mark.parametrize("type_name", [*EXACT, "Q5_1"])
def test_gguf_py_blocks_on_our_panels(type_name: str, ops: Any) -> None:
    """gguf-py's own blocks of random weights: Q4_0 / Q4_1 go to int4 and Q8_0 / Q5_0 to int8 with the panels'
    weights equal to gguf-py's dequantized ones bit for bit; Q5_1 (a minimum our int8 blocks do not hold) is
    re-rounded to int8 within Q8_0's error of those values. As an LM head, Q4_1 is int8 too."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    weights = random_weights()
    data = quantize(weights, GGMLQuantizationType[type_name])
    want = reference(type_name, data, weights.shape)
    grouped = gguf_blocks.grouped_of(type_name, data, weights.shape)
    assert grouped is not None
    layer = QuantizedLinear.from_grouped(grouped, ops)
    assert layer is not None and layer.bits == EXACT.get(type_name, 8)
    served = layer.dequantized_weight()
    if type_name in EXACT:
        assert torch.equal(grouped.dequantize(), want)
        assert torch.equal(served, want)
    else:
        assert bool(((served - want).abs() <= q8_0_bound(want)).all())
    if type_name == "Q4_1":
        head = QuantizedLinear.from_grouped(gguf_blocks.grouped_of(type_name, data, weights.shape, lm_head=True), ops)
        assert head is not None and head.bits == 8
        assert bool(((head.dequantized_weight() - want).abs() <= q8_0_bound(want)).all())


def test_re_rounding_goes_by_row_blocks_with_the_whole_tensors_result() -> None:
    """Re-rounding reads 1024 output rows at a time (a 7B's LM head never sits in memory as fp32 at once): the same
    codes and scales as Q8_0 of the whole tensor's values."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize

    weights = random_weights(out=1100, inputs=64, seed=1)
    data = quantize(weights, GGMLQuantizationType.Q5_1)
    grouped = gguf_blocks.grouped_of("Q5_1", data, weights.shape)
    whole = gguf_blocks.round_to_q8_0(reference("Q5_1", data, weights.shape))
    assert grouped is not None and grouped.bits == 8
    assert torch.equal(grouped.codes, whole.codes) and torch.equal(grouped.scales, whole.scales)


def test_dense_types_are_left_to_the_dequantizer() -> None:
    weights = random_weights()
    assert gguf_blocks.grouped_of("F32", weights, weights.shape) is None
    assert gguf_blocks.grouped_of("F16", weights.astype(np.float16), weights.shape) is None


@functools.cache
def text_tensors(text_type: str) -> list[Any]:
    """The 2-D tensors of the qwen2.5-vl text file llama-quantize wrote as `text_type`."""
    path = gguf_makers.text_file(gguf_makers.gguf_vlm_dir("qwen2.5-vl", text_type))
    return [t for t in loader.gguf_reader(path).tensors if len(t.shape) == 2]


def shape_of(tensor: Any) -> tuple[int, int]:
    inputs, out = (int(n) for n in tensor.shape)
    return out, inputs


@pytest.mark.slow  # llama-quantize's files are made once, then cached
@pytest.mark.parametrize(
    ("text_type", "type_name", "bits"), [("Q4_K_M", "Q4_K", 4), ("Q6_K", "Q6_K", 8), ("Q5_K_M", "Q5_K", 8)]
)
def test_k_quant_blocks_on_our_panels(text_type: str, type_name: str, bits: int, ops: Any) -> None:
    """Every tensor of a K-quant type in llama-quantize's file: Q4_K's codes with scale d * sc and offset
    -dmin * min per 32 are gguf-py's values bit for bit, and int4 panels hold them within the fp16 rounding of
    those two; Q5_K and Q6_K are int8, within Q8_0's error of gguf-py's values."""
    tensors = [t for t in text_tensors(text_type) if t.tensor_type.name == type_name]
    assert tensors, f"{text_type} has no {type_name} tensor"
    for tensor in tensors:
        shape = shape_of(tensor)
        want = reference(type_name, tensor.data, shape)
        grouped = gguf_blocks.grouped_of(type_name, tensor.data, shape)
        assert grouped is not None and grouped.bits == bits, tensor.name
        layer = QuantizedLinear.from_grouped(grouped, ops)
        assert layer is not None
        error = (layer.dequantized_weight() - want).abs()
        if type_name == "Q4_K":
            assert torch.equal(grouped.dequantize(), want), tensor.name
            assert bool((error <= fp16_bound(grouped)).all()), tensor.name
            assert float(error.max()) > 0  # the scales' fp16 rounding is real: not an exact mapping
        else:
            assert bool((error <= q8_0_bound(want)).all()), tensor.name


@pytest.mark.slow
def test_a_fused_linear_of_q4_k_and_q6_k_shards_is_int8(ops: Any) -> None:
    """Q4_K_M keeps some attn_v in Q6_K beside Q4_K q and k: the fused q/k/v is all int8, its Q4_K shards
    re-rounded to Q8_0 from their values (a panel has one bit width)."""
    tensors = {t.name: t for t in text_tensors("Q4_K_M")}
    layer = next(
        name.split(".")[1]
        for name, t in tensors.items()
        if name.endswith("attn_v.weight") and t.tensor_type.name == "Q6_K"
    )
    parts, values = [], []
    for projection in ("attn_q", "attn_k", "attn_v"):
        tensor = tensors[f"blk.{layer}.{projection}.weight"]
        shape = shape_of(tensor)
        parts.append(gguf_blocks.grouped_of(tensor.tensor_type.name, tensor.data, shape))
        values.append(reference(tensor.tensor_type.name, tensor.data, shape))
    assert [p.bits for p in parts] == [4, 4, 8]
    fused = concat_outputs(parts)
    assert fused is not None and fused.bits == 8
    q_rows = values[0].shape[0]
    assert torch.equal(fused.rows(slice(0, q_rows)).dequantize(), gguf_blocks.round_to_q8_0(values[0]).dequantize())
    served = QuantizedLinear.from_grouped(fused, ops)
    assert served is not None and served.bits == 8
    want = torch.cat(values)
    assert bool(((served.dequantized_weight() - want).abs() <= q8_0_bound(want)).all())


@pytest.mark.slow  # two passes over SmolLM2's embedding table
def test_llama_text_codes_are_its_values_with_the_rope_rows_undone(ops: Any) -> None:
    """SmolLM2's Q4_1 file through loader.iter_gguf with codes (the stream build_model reads for a GGUFCodes llama
    file; wiring leaves SmolLM2 dequantized by default): its first layer's linears (q and k rows permuted back from
    llama.cpp's RoPE order) are GroupedWeights whose values are the fp32 stream's bit for bit, and whose panels are
    the very ones `--quantization int4` makes from those values (Q4_1 is our int4 block)."""
    source = registry.resolve_model("SmolLM2-135M-Instruct")
    config = registry.load_config(source)
    count = 1 + 9 + 2  # the embedding, layer 0's nine tensors, layer 1's first two
    dense = dict(itertools.islice(loader.iter_gguf(source.gguf_path, config), count))
    coded = dict(itertools.islice(loader.iter_gguf(source.gguf_path, config, codes=True), count))
    assert coded.keys() == dense.keys()
    grouped = {name: t for name, t in coded.items() if isinstance(t, gguf_blocks.GroupedWeights)}
    assert {n.rsplit(".", 2)[-2] for n in grouped} >= {"q_proj", "k_proj", "v_proj", "o_proj", "up_proj"}
    assert all(g.bits == 4 for g in grouped.values())
    for name, tensor in coded.items():
        assert torch.equal(tensor.dequantize() if name in grouped else tensor, dense[name]), name
    for name, weights in grouped.items():
        panels = grouped_panels(weights)
        assert panels is not None
        codes, scales = ops.quantize_panels(dense[name], 4)
        assert torch.equal(panels[0], codes) and torch.equal(panels[1], scales), name


# ---- engines on llama-quantize's files ------------------------------------------------------------------------------


@functools.cache
def exact_logprobs(text_type: str) -> torch.Tensor:
    from tests.test_fast_numerics import prefill_logprobs

    engine = exact_engine(text_type)
    return prefill_logprobs(engine, engine.tokenizer(TEXT)["input_ids"])


@functools.cache
def exact_engine(text_type: str) -> Engine:
    directory = str(gguf_makers.gguf_vlm_dir("qwen2.5-vl", text_type))
    return Engine(directory, dtype="float32", kv_cache_tokens=1024, numerics="exact")


def expected_bits(text_type: str) -> dict[str, int]:
    """Our module -> its bits, from the file's types: int4 where every shard is Q4_K, else int8."""
    shards = {"qkv_proj": ("attn_q", "attn_k", "attn_v"), "o_proj": ("attn_output",),
              "gate_up_proj": ("ffn_gate", "ffn_up"), "down_proj": ("ffn_down",)}  # fmt: skip
    types = {t.name: t.tensor_type.name for t in text_tensors(text_type)}
    layers = {int(name.split(".")[1]) for name in types if name.startswith("blk.")}
    bits = {"lm_head": 8}
    for layer, (module, parts) in itertools.product(sorted(layers), shards.items()):
        attention = "self_attn" if module in ("qkv_proj", "o_proj") else "mlp"
        four = all(types[f"blk.{layer}.{p}.weight"] == "Q4_K" for p in parts)
        bits[f"model.layers.{layer}.{attention}.{module}"] = 4 if four else 8
    return bits


@pytest.mark.slow
@pytest.mark.parametrize(
    ("text_type", "max_kl", "min_top1"), [("Q8_0", 0.05, 0.75), ("Q6_K", 0.15, 0.7), ("Q4_K_M", 0.8, 0.4)]
)
def test_engine_serves_the_files_codes_within_tolerance_of_exact(
    text_type: str, max_kl: float, min_top1: float
) -> None:
    """Fast numerics (the default) on a quantized pair: every decoder linear and the LM head is a QuantizedLinear
    of the bits the file's types give, its weights within the mapping's error of exact numerics' (gguf-py's fp32
    values; Q8_0's equal), holding the codes' bytes (int4: 0.625, int8: 1.125 per weight against bf16's 2).
    Teacher-forced over one 54-token text, mean KL(exact || fast) and top-1 agreement, measured on the 2-core
    Zen 5 (AVX-512 VNNI + avx512_bf16, no AMX), 2 threads, fp32 activations (bf16 in brackets):
    Q8_0 0.012 / 89% (0.017 / 85%), Q6_K 0.063 / 80% (0.064 / 81%), Q4_K_M 0.38 / 61% (0.41 / 52%). This tiny
    random model is far more sensitive than a trained one: our own int4 of its F32 file gives KL 2.1 (int8 0.07),
    and Q4_K's int4 kernel rounds the activations to int8 per 32 (as llama.cpp's Q8_1 / Q8_K), whose error the
    large Q4_K minimum (m * sum(x) against d * sum(q * x)) amplifies."""
    from tests.test_fast_numerics import prefill_logprobs

    directory = str(gguf_makers.gguf_vlm_dir("qwen2.5-vl", text_type))
    engine = Engine(directory, dtype="float32", kv_cache_tokens=1024)
    served = {name: m for name, m in engine.model.named_modules() if isinstance(m, QuantizedLinear)}
    assert {name: m.bits for name, m in served.items()} == expected_bits(text_type)
    exact = dict(exact_engine(text_type).model.named_modules())
    codes_bytes = weights = 0
    for name, layer in served.items():
        want, got = exact[name].weight.float(), layer.dequantized_weight()
        if text_type == "Q8_0":
            assert torch.equal(got, want), name
        elif layer.bits == 8:
            assert bool(((got - want).abs() <= q8_0_bound(want)).all()), name
        else:
            assert float((got - want).norm() / want.norm()) < 2**-10, name
        padded = -(-layer.out_features // PANEL_ROWS) * PANEL_ROWS
        assert layer.codes.nbytes == padded * layer.in_features * layer.bits // 8
        assert layer.scales.nbytes == padded * layer.in_features // 32 * 4
        codes_bytes += layer.codes.nbytes + layer.scales.nbytes
        weights += layer.in_features * layer.out_features
    print(f"{text_type}: {len(served)} linears hold {codes_bytes / 2**20:.3f} MiB, bf16 {2 * weights / 2**20:.3f} MiB")
    bits = Counter(m.bits for m in served.values())
    assert codes_bytes <= (bits[4] * 0.63 + bits[8] * 1.13) / sum(bits.values()) * weights * 1.05
    fast = prefill_logprobs(engine, engine.tokenizer(TEXT)["input_ids"])
    reference = exact_logprobs(text_type)
    kl = float((reference.exp() * (reference - fast)).sum(-1).mean())
    top1 = float((fast.argmax(-1) == reference.argmax(-1)).float().mean())
    print(f"{text_type} fast vs exact: mean KL {kl:.4f}, top-1 {top1:.0%}")
    assert kl < max_kl and top1 >= min_top1, (kl, top1)
    if text_type == "Q4_K_M":  # greedy image + text generation runs on the mixed int4 / int8 model
        reply = engine.chat(
            [user(make_image(97, 61, 1), "What is in this picture?")], SamplingParams(max_tokens=8, temperature=0.0)
        )
        assert 1 <= len(reply[0].token_ids) <= 8 and max(reply[0].token_ids) < engine.hf_config.text_config.vocab_size


@pytest.mark.slow
def test_quantizing_a_quantized_gguf_again_is_refused_and_an_f32_one_stays_dense() -> None:
    """As for a pre-quantized safetensors checkpoint: `--quantization` on a Q4_K_M pair is a start-up error (its
    codes are served as stored); an F32 pair is no quantized checkpoint, so it stays dense by default."""
    with pytest.raises(ValueError, match="already quantized"):
        Engine(str(gguf_makers.gguf_vlm_dir("qwen2.5-vl", "Q4_K_M")), quantization="int8", kv_cache_tokens=1024)
    dense = Engine(str(gguf_makers.gguf_vlm_dir("qwen2.5-vl")), dtype="float32", kv_cache_tokens=1024)
    assert not any(isinstance(m, QuantizedLinear) for m in dense.model.modules())


@pytest.mark.slow
def test_smolvlm_q8_0_pair_serves_its_codes_with_the_rope_rows_undone() -> None:
    """SmolVLM's text is a llama GGUF (q / k rows in llama.cpp's RoPE order): in fast numerics its Q8_0 linears are
    int8 panels whose weights are exact numerics' bit for bit, q and k included; the vision tower stays dense."""
    directory = str(gguf_makers.gguf_vlm_dir("smolvlm", "Q8_0"))
    fast = Engine(directory, dtype="float32", kv_cache_tokens=1024)
    exact = dict(Engine(directory, dtype="float32", kv_cache_tokens=1024, numerics="exact").model.named_modules())
    served = {name: m for name, m in fast.model.named_modules() if isinstance(m, QuantizedLinear)}
    assert any("qkv" in name or "q_proj" in name for name in served)
    assert not any("vision" in name or "connector" in name for name in served)
    for name, layer in served.items():
        assert layer.bits == 8 and torch.equal(layer.dequantized_weight(), exact[name].weight.float()), name
