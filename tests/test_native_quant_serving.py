"""Native AWQ (GEMM, zero_point, g32) and GPTQ (v1, g32: symmetric, and desc_act asymmetric) checkpoints of the tiny
Qwen2.5-VL, packed by AutoAWQ 0.2.9 / GPTQModel 7.7.0 themselves (testkit/native_quant_checkpoints.py), served
through the public Engine (issue 51).

The reference is Transformers' `generate` on the same checkpoint with every packed linear dequantized to fp32 from
the saved words by the tool's formula (its `fp32-reference/`). Exact numerics: greedy tokens equal, text and an
odd-sized image. Fast numerics (our int4 kernels from the codes): the tolerance test_quant_formats holds
compressed-tensors' W4A16 to."""

from __future__ import annotations

import functools
import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest

from testkit.native_quant_checkpoints import NATIVE_RECIPES, WEIGHTS, cached_native, reference_dir
from testkit.qwen_vl_checkpoints import cached_qwen2_5_vl
from tests.conftest import hf_greedy, make_image, user
from tests.family_table import family, hf_model
from tests.test_quant_formats import FIRST_LOGPROB_ATOL
from vlm_engine import Engine, SamplingParams
from vlm_engine.models.quant_formats import UnsupportedQuantization
from vlm_engine.models.quantized import QuantizedLinear

pytestmark = pytest.mark.slow

MAX_TOKENS = 12
CONVERSATIONS = (
    [{"role": "user", "content": "Tell me a story about a red fox."}],
    user(make_image(97, 41, 3), "What is in this picture?"),  # odd size: windows and 2x2 merges cut at its edges
)
RECIPES = sorted(NATIVE_RECIPES)


@functools.cache
def checkpoint(recipe: str) -> Path:
    return cached_native(cached_qwen2_5_vl("tiny"), recipe)


@functools.cache
def references(recipe: str) -> tuple[list[int], ...]:
    """Transformers' greedy tokens on the tool-dequantized fp32 weights (every tensor loaded, none left over)."""
    import torch
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model, info = AutoModelForImageTextToText.from_pretrained(
        str(reference_dir(checkpoint(recipe))), dtype=torch.float32, output_loading_info=True
    )
    assert not any(info.values()), info
    hf = (model.eval(), AutoProcessor.from_pretrained(str(checkpoint(recipe))))
    return tuple(hf_greedy(hf, c, MAX_TOKENS) for c in CONVERSATIONS)


@functools.cache
def engine(recipe: str, numerics: str) -> Engine:
    return Engine(str(checkpoint(recipe)), dtype="float32", kv_cache_tokens=1024, numerics=numerics)


def test_the_references_are_quantized() -> None:
    """Each reference's tokens differ from the unquantized model's: an engine ignoring the codes would fail below."""
    base = tuple(hf_greedy(hf_model(family("qwen2.5-vl")), c, MAX_TOKENS) for c in CONVERSATIONS)
    assert all(references(recipe) != base for recipe in RECIPES)


@pytest.mark.parametrize("recipe", RECIPES)
def test_the_config_is_the_tools(recipe: str) -> None:
    spec = NATIVE_RECIPES[recipe]
    config = json.loads((checkpoint(recipe) / "config.json").read_text())["quantization_config"]
    assert (config["quant_method"], config["bits"], config["group_size"]) == (spec.method, 4, spec.group_size)
    if spec.method == "awq":
        assert (config["version"], config["zero_point"], config["modules_to_not_convert"]) == (
            "gemm", True, ["visual", "lm_head"])  # fmt: skip
    else:
        assert (config["checkpoint_format"], config["sym"], config["desc_act"]) == ("gptq", spec.sym, spec.desc_act)


@pytest.mark.parametrize("recipe", RECIPES)
def test_exact_greedy_equals_transformers_on_the_tool_dequantized_weights(recipe: str) -> None:
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
    ours = [o.token_ids for o in engine(recipe, "exact").chat(list(CONVERSATIONS), params)]
    assert ours == list(references(recipe))


@pytest.mark.parametrize("recipe", RECIPES)
def test_fast_first_token_is_among_exacts_best(recipe: str) -> None:
    """Every decoder linear on our int4 kernels from the codes (q/k/v and gate/up fused: 4 modules a layer, none
    dequantized as a fallback); fast's first greedy token is in exact's top 5, their shared top-5 log-probs within
    FIRST_LOGPROB_ATOL."""
    layers = [m for m in engine(recipe, "fast").model.modules() if isinstance(m, QuantizedLinear)]
    assert len(layers) == 4 * 4 and {m.bits for m in layers} == {4}
    assert all((m.input_order is not None) == NATIVE_RECIPES[recipe].desc_act for m in layers)
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=5)
    fast = engine(recipe, "fast").chat(list(CONVERSATIONS), params)
    exact = engine(recipe, "exact").chat(list(CONVERSATIONS), params)
    for f, e in zip(fast, exact):
        best = dict(e.logprobs[0].top_logprobs)
        assert f.token_ids[0] in best
        for token, logprob in f.logprobs[0].top_logprobs:
            assert token not in best or abs(best[token] - logprob) < FIRST_LOGPROB_ATOL


@pytest.mark.parametrize(
    ("recipe", "field", "value"),
    [
        ("awq-gemm-g32", "version", "exllama"),
        ("gptq-g32-sym", "checkpoint_format", "marlin"),
    ],
)
def test_a_packing_the_readers_refuse_fails_before_any_weight(
    tmp_path: Path, recipe: str, field: str, value: Any
) -> None:
    """A copy of the checkpoint with the field changed and its weights file deleted: the error names the field
    (a weights read would fail on the missing file instead)."""
    copy = tmp_path / recipe
    shutil.copytree(checkpoint(recipe), copy, ignore=shutil.ignore_patterns("fp32-reference"))
    (copy / WEIGHTS).unlink()
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"][field] = value
    if field == "checkpoint_format":
        config["quantization_config"]["format"] = value
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(UnsupportedQuantization, match=re.escape(f"{field} = {value!r}")):
        Engine(str(copy), dtype="float32", kv_cache_tokens=256)
