"""Weight-only int8 / int4 linears: the kernels against the weights they stand for, GGUF codes kept,
and the quality of the quantized SmolLM2 (perplexity on a fixed text against fp32)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from vlm_engine import Engine, SamplingParams
from vlm_engine.models.quantized import Quantization, QuantizedLinear, quantize_linears
from vlm_engine.models.registry import cpu_has_native_bf16, resolve_model

LONG_TEXT = (
    "The lighthouse stood at the end of a long stone pier. Every evening the keeper climbed the "
    "spiral stairs, trimmed the wick and wound the clockwork that turned the great lens, so that "
    "ships far out at sea could count the flashes and know exactly where they were. In winter the "
    "storms came in from the west, and the waves broke over the pier so high that the keeper had "
    "to wait for a lull before he could cross to the tower. He kept a logbook of every ship he saw, "
    "every storm and every repair, and on quiet nights he read old letters by the light of a lamp."
)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize(("n", "k"), [(960, 576), (37, 64)])
def test_kernel_equals_the_weights_it_stands_for(ops, bits: int, n: int, k: int) -> None:
    g = torch.Generator().manual_seed(bits * n)
    w, b = torch.randn(n, k, generator=g) * 0.05, torch.randn(n, generator=g)
    codes, scales = ops.quantize_panels(w, bits)
    deq = ops.dequantize_panels(codes, scales, n, bits)
    # The scheme's error bound: half a step of each group's scale, plus the fp16 rounding of the
    # stored scale (up to 2^-11 relative, times the largest code) and of the int4 minimum.
    groups = w.view(n, k // 32, 32)
    absmax = groups.abs().amax(-1, keepdim=True)
    if bits == 8:
        step, codes_max = absmax / 127, 127
    else:
        step, codes_max = (groups.amax(-1, keepdim=True) - groups.amin(-1, keepdim=True)) / 15, 15
    bound = 0.5 * step + codes_max * step * 2**-11 + absmax * 2**-11 + 1e-7
    assert ((deq - w).view(n, k // 32, 32).abs() <= bound).all()
    minima = _group_minima(scales, n, k)
    for rows in (1, 2, 3, 5):
        x = torch.randn(rows, k, generator=g)
        got = ops.quant_panel_linear(x, codes, scales, n, bits, b)
        torch.testing.assert_close(got, _reference_product(x, deq, minima, b), rtol=1e-5, atol=1e-4)
        # Quantizing x moves each input by at most half its group's step, which the scaled codes
        # (d * q: the int4 minimum multiplies the exact x) carry into the output.
        exact = F.linear(x.double(), deq.double(), b.double())
        x_step = x.view(rows, k // 32, 32).abs().amax(-1).repeat_interleave(32, dim=1) / 127
        assert ((got.double() - exact).abs() <= 0.5 * x_step.double() @ (deq - minima).double().abs().T + 1e-3).all()
    with pytest.raises(RuntimeError, match="multiple of 32"):
        ops.quantize_panels(torch.ones(4, 48), bits)


def _group_minima(scales: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The int4 minimum of every weight's group, [n, k] (zeros for int8), from the scales' [P][K/32][2][16] layout."""
    m = scales.view(torch.float16)[:, :, 1, :].float()  # [P, G, 16]
    return m.permute(0, 2, 1).reshape(-1, k // 32)[:n].repeat_interleave(32, dim=1)


def _reference_product(x: torch.Tensor, deq: torch.Tensor, minima: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
    """The kernel's scheme in torch (llama.cpp's): x rounded per group of 32 to int8 steps of max|x|/127
    (half to even), times the weights; the int4 minimum times the exact x."""
    rows, k = x.shape
    groups = x.view(rows, k // 32, 32)
    step = groups.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(step > 0, 1 / step, torch.zeros_like(step))
    x_q = (torch.round(groups * inv) * step).view(rows, k)
    exact_minimum = F.linear((x - x_q).double(), minima.double())
    return (F.linear(x_q.double(), deq.double()) + exact_minimum + bias.double()).float()


def test_quantizing_a_q4_1_gguf_keeps_its_codes(ops) -> None:
    """Weights dequantized from llama.cpp's Q4_1 (and Q8_0) blocks quantize back to the same values:
    serving the shipped Q4_1 SmolLM2 with --quantization int4 uses the numbers llama.cpp uses."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    reader = GGUFReader(str(resolve_model("SmolLM2-135M-Instruct").gguf_path))
    tensors = {t.name: t for t in reader.tensors}
    for name, bits in (("blk.0.ffn_down.weight", 4), ("blk.3.attn_q.weight", 4), ("token_embd.weight", 8)):
        t = tensors[name]
        assert t.tensor_type.name == ("Q4_1" if bits == 4 else "Q8_0")
        w = torch.from_numpy(np.array(dequantize(t.data, t.tensor_type), dtype=np.float32))
        if bits == 8:
            w = w[:4096]  # the embedding is large; a slice shows the same
        codes, scales = ops.quantize_panels(w, bits)
        again = ops.dequantize_panels(codes, scales, w.shape[0], bits)
        same = (again == w).float().mean().item()
        assert same > 0.999, (name, same)
        torch.testing.assert_close(again, w, rtol=0, atol=1e-6)


def test_which_linears_are_quantized() -> None:
    assert Quantization("int4").bits("model.layers.3.mlp.down_proj") == 4
    assert Quantization("int8").bits("model.layers.3.mlp.down_proj") == 8
    assert Quantization("int4").bits("lm_head") == 8  # as llama.cpp's Q4 files keep the output in Q8_0
    assert Quantization("int4").bits("visual.blocks.0.mlp.fc1") is None
    assert Quantization("int4").bits("classifier._fc") is None


def test_quantize_linears_replaces_decoder_linears(ops) -> None:
    model = nn.Module()
    model.layers = nn.ModuleList([nn.Sequential(nn.Linear(64, 32), nn.Linear(48, 8))])  # 48: not a multiple of 32
    model.lm_head = nn.Linear(32, 100, bias=False)
    assert quantize_linears(model.requires_grad_(False), "int4", ops) == 2
    assert isinstance(model.layers[0][0], QuantizedLinear) and model.layers[0][0].bits == 4
    assert isinstance(model.layers[0][1], nn.Linear)  # left unquantized
    assert isinstance(model.lm_head, QuantizedLinear) and model.lm_head.bits == 8
    with pytest.raises(TypeError, match="float32"):
        model.lm_head(torch.ones(1, 32, dtype=torch.float16))  # fp32 and bf16 only


def test_encoders_are_quantized_only_when_asked() -> None:
    """Every family's vision encoder (`encoder_modules`: SmolVLM's and Gemma 3's have `.layers.` in
    their paths too) keeps its dtype unless asked, and is then 8 bits whatever the scheme."""
    plain = Quantization("int4", encoders=("visual", "vision_model", "connector"))
    asked = Quantization("int4", vision=True, encoders=plain.encoders)
    for path in ("vision_model.encoder.layers.0.mlp.fc1", "connector.modality_projection.proj", "visual.blocks.0.qkv"):
        assert plain.bits(path) is None and asked.bits(path) == 8, path
    decoder = "model.text_model.layers.0.mlp.down_proj"
    assert plain.bits(decoder) == asked.bits(decoder) == 4


def test_quantization_config_errors(tiny_vlm_dir: Path) -> None:
    with pytest.raises(ValueError, match="quantization must be"):
        Engine(str(tiny_vlm_dir), quantization="int3")
    with pytest.raises(ValueError, match="float32 activations"):
        Engine(str(tiny_vlm_dir), quantization="int8", dtype="float16")
    with pytest.raises(ValueError, match="give quantization"):
        Engine(str(tiny_vlm_dir), quantize_vision=True)


def test_tiny_vlm_runs_quantized_with_an_image(tiny_vlm_dir: Path) -> None:
    from tests.conftest import make_image

    engine = Engine(str(tiny_vlm_dir), quantization="int4", kv_cache_tokens=2048)
    assert engine.dtype == (torch.bfloat16 if cpu_has_native_bf16() else torch.float32)  # as unquantized
    assert isinstance(engine.model.lm_head, QuantizedLinear)
    assert not any(isinstance(m, QuantizedLinear) for m in engine.model.visual.modules())
    messages = [[{"role": "user", "content": [{"type": "image", "image": make_image(64, 48, 1)},
                                               {"type": "text", "text": "What is this?"}]}]]
    out = engine.chat(messages, SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 8


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_quantized_model_computes_in_its_dtype(tiny_vlm_dir: Path, dtype: str) -> None:
    """Only the decoder's linears are quantized: the vision tower, norms, embedding and KV cache run in
    the model's dtype, bf16 where asked (what `auto` picks on a CPU with bf16 dot products), not in
    fp32 (the tower ran in fp32 under quantization before: ~1.6 s of a 4.1 s batch of 8 bench
    Qwen2-VL requests against ~0.7 s in bf16)."""
    engine = Engine(str(tiny_vlm_dir), quantization="int8", dtype=dtype, kv_cache_tokens=1024)
    want = getattr(torch, dtype)
    assert engine.dtype == want
    floats = [p for p in engine.model.parameters() if p.is_floating_point()]
    tower = [p for p in engine.model.visual.parameters() if p.is_floating_point()]
    assert tower and floats and {p.dtype for p in floats} == {want}
    quantized = [m for m in engine.model.modules() if isinstance(m, QuantizedLinear)]
    assert quantized and all(m.bias is None or m.bias.dtype == torch.float32 for m in quantized)
    x = torch.randn(5, quantized[0].in_features).to(want)
    assert quantized[0](x).dtype == want


def test_the_vision_tower_quantized_when_asked(tiny_vlm_dir: Path) -> None:
    from tests.conftest import make_image

    engine = Engine(str(tiny_vlm_dir), quantization="int4", quantize_vision=True, kv_cache_tokens=1024)
    tower = [m for m in engine.model.visual.modules() if isinstance(m, QuantizedLinear)]
    assert tower and all(m.bits == 8 for m in tower)
    messages = [[{"role": "user", "content": [{"type": "image", "image": make_image(64, 48, 1)},
                                               {"type": "text", "text": "What is this?"}]}]]  # fmt: skip
    out = engine.chat(messages, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_bf16_quantized_codes_come_from_the_checkpoints_values(tiny_vlm_dir: Path) -> None:
    """A bf16 model's quantized linears (the LM head tied to the embedding included) get the codes of
    the checkpoint's own values, the fp32 model's codes, not those of the values rounded to bf16."""
    kwargs = {"quantization": "int4", "kv_cache_tokens": 1024}
    fp32 = Engine(str(tiny_vlm_dir), dtype="float32", **kwargs)
    bf16 = Engine(str(tiny_vlm_dir), dtype="bfloat16", **kwargs)
    a = {n: m for n, m in fp32.model.named_modules() if isinstance(m, QuantizedLinear)}
    b = {n: m for n, m in bf16.model.named_modules() if isinstance(m, QuantizedLinear)}
    assert a.keys() == b.keys() and "lm_head" in a
    for name, layer in a.items():
        assert torch.equal(layer.codes, b[name].codes) and torch.equal(layer.scales, b[name].scales), name


def _perplexity(engine: Engine, text: str) -> float:
    from tests.test_fast_numerics import prefill_logprobs

    ids = engine.tokenizer(text)["input_ids"]
    logprobs = prefill_logprobs(engine, ids)
    nll = -logprobs[:-1].gather(1, torch.tensor(ids[1:])[:, None]).mean().item()
    return math.exp(nll)


@pytest.mark.slow
def test_smollm2_quantized_perplexity_and_answers() -> None:
    """Perplexity of three fixed English texts (their geometric mean) under fp32 and under each scheme. The SmolLM2 weights are
    themselves the shipped Q4_1 file dequantized, so int4 keeps them (the LM head is int8, as in
    llama.cpp's file) and int8 re-rounds them; both kernels round the activations to int8 per group
    of 32, as llama.cpp does. The greedy answer asks for Germany's
    capital: France's first token is a near tie under fp32 (0.08 nats), where llama.cpp's own Q4_1
    answers "L'Étoile, la Marseillaise," and so do our int8 and int4.

    The bound is 3% of fp32: rounding activations to int8 turns last-bit differences of the fp32 ops around
    the linears into different roundings, so the same weights and scheme measure differently from
    one build to another. On LONG_TEXT alone, int4 on the 2-core Sapphire Rapids: 24.17 (+1.7%) before the attention
    op's V-row change (d31e4eb, within 1e-6 of the reference attention), 24.36 (+2.5%) after, 24.30
    (+2.2%) with VLM_ENGINE_ISA=avx2; int8 23.84 (+0.3%).

    The one text is too short to bound either: with bf16 activations (what `auto` picks on a CPU with
    bf16 dot products) on the 2-core Zen 5 int4 measured +3.77% there, but -0.83% and +3.49% on two more
    texts where int4 in fp32 measured +2.42% and -0.94% (int8 in bf16 -0.03%, -1.48%, +0.57%); and in
    fp32 on the 2-core Zen 3 (AVX2) int4 measured +3.44%, +1.51%, +2.04% (int8 +0.04%, -0.64%, +1.58%).
    So both are held to the 3% over the three texts together (the geometric mean of their
    perplexities: int4 fp32 +2.33% on that Zen 3)."""
    kwargs = {"kv_cache_tokens": 4096}
    fp32 = Engine("SmolLM2-135M-Instruct", dtype="float32", numerics="exact", **kwargs)
    pooled = _pooled_perplexity(fp32)
    question = [[{"role": "user", "content": "What is the capital of Germany?"}]]
    for scheme in ("int8", "int4"):
        engine = Engine("SmolLM2-135M-Instruct", quantization=scheme, dtype="float32", **kwargs)
        ppl = _pooled_perplexity(engine)
        print(f"SmolLM2 perplexity, three texts: fp32 {pooled:.3f}, {scheme} {ppl:.3f} ({ppl / pooled - 1:+.2%})")
        assert abs(ppl / pooled - 1) < 0.03, (scheme, ppl, pooled)
        answer = engine.chat(question, SamplingParams(max_tokens=12, temperature=0.0))[0].text
        assert "Berlin" in answer, (scheme, answer)
        engine = Engine("SmolLM2-135M-Instruct", quantization=scheme, dtype="bfloat16", **kwargs)
        ppl = _pooled_perplexity(engine)
        print(f"SmolLM2 perplexity, three texts: fp32 {pooled:.3f}, {scheme} bf16 {ppl:.3f} ({ppl / pooled - 1:+.2%})")
        assert abs(ppl / pooled - 1) < 0.03, (scheme, "bf16", ppl, pooled)
        answer = engine.chat(question, SamplingParams(max_tokens=12, temperature=0.0))[0].text
        assert "Berlin" in answer, (scheme, "bf16", answer)


MORE_TEXTS = (
    ("Bread has been made for thousands of years. The simplest loaf needs only flour, water, salt and yeast. The "
    "baker mixes them into a dough, kneads it until it becomes smooth and elastic, and leaves it in a warm place to "
    "rise. During this time the yeast eats the sugars in the flour and releases gas, which is trapped by the gluten "
    "and makes the dough grow. After shaping, the loaf rises again and is baked in a hot oven until the crust turns "
    "golden brown and the inside sounds hollow when tapped."),
    ("The city council met on Tuesday evening to discuss the new bicycle lanes. Several residents spoke in favour of "
    "the plan, saying that safer streets would encourage more people to cycle to work and school. Shop owners on the "
    "main road were worried that removing parking spaces would reduce the number of customers. After two hours of "
    "debate the council agreed to run a six month trial on one street and to collect data on traffic, sales and "
    "accidents before making a final decision."),
)


def _pooled_perplexity(engine: Engine) -> float:
    """The geometric mean of the perplexities of LONG_TEXT and MORE_TEXTS."""
    texts = (LONG_TEXT, *MORE_TEXTS)
    return math.exp(sum(math.log(_perplexity(engine, t)) for t in texts) / len(texts))


def test_parallel_quantization_equals_single_threaded(ops) -> None:
    """Threads take whole panels (int4 rows c and c+8 share code bytes): row counts that split a
    panel between threads must give the same codes as one thread."""
    before = torch.get_num_threads()
    try:
        for n in (37, 200):
            w = torch.randn(n, 64, generator=torch.Generator().manual_seed(n))
            torch.set_num_threads(1)
            want = ops.quantize_panels(w, 4)
            torch.set_num_threads(max(2, before))
            for _ in range(10):
                got = ops.quantize_panels(w, 4)
                assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
    finally:
        torch.set_num_threads(before)
