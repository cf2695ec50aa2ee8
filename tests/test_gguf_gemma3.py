"""GGUF Gemma 3 (models/gguf_gemma3.py): the text GGUF (arch `gemma3`) and its mmproj (projector type `gemma3`)
as llama.cpp's converter writes them from a tiny random Gemma 3 checkpoint in the released layout
(testkit/gguf_makers.py), served by our gemma3 family.

F32 files hold the checkpoint's tensors bit for bit except where the converter changed them: Gemma's norm
weights written as 1 + w (read back as (1 + w) - 1 in fp32, whose 1 + w is the checkpoint's exactly) and
the projector's matrix, always written F16. Greedy tokens in exact numerics equal Transformers' on the
checkpoint holding the values the files give (for F32: those two differences; for Q8_0 and Q4_K_M: the rounded
matrices too)."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from preprocess.errors import PromptError
from testkit import gguf_makers
from tests.conftest import hf_greedy, make_image, to_hf_messages, user
from vlm_engine import Engine, SamplingParams
from vlm_engine.models import loader, registry

pytestmark = pytest.mark.slow  # the first run builds the checkpoint and converts it (cached after)

FAMILY = "gemma3"
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
CONVERSATIONS = [
    [{"role": "user", "content": "Tell me a story about a red fox."}],
    user(make_image(97, 61, 1), "What is in this picture?"),  # odd sizes: resized to the tower's square
    # two images: 2 x 16 image tokens, a prompt past the 32-token window of the sliding layers
    user("Compare these:", make_image(150, 40, 8), make_image(30, 100, 9), "Describe both."),
]


def stored(checkpoint: Path) -> dict[str, torch.Tensor]:
    return {n: t.read() if isinstance(t, loader.StoredTensor) else t for n, t in loader.iter_safetensors(checkpoint)}


def pair_values(directory: Path) -> dict[str, torch.Tensor]:
    source = registry.resolve_model(str(directory))
    return dict(source.weights(registry.load_config(source)))


def dequantized_checkpoint(directory: Path, out: Path) -> Path:
    """The source checkpoint with its weights replaced by the GGUF pair's values."""
    from safetensors.torch import save_file

    for item in gguf_makers.source_checkpoint(FAMILY).iterdir():
        if item.suffix != ".safetensors":
            (out / item.name).symlink_to(item)
    save_file(pair_values(directory), str(out / "model.safetensors"), {"format": "pt"})
    return out


@functools.cache
def hf_model(checkpoint: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(str(checkpoint))


def hf_prompt_ids(processor: Any, conversation: list[dict[str, Any]]) -> list[int]:
    messages, images = to_hf_messages(conversation)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=[text], images=images or None, return_tensors="pt")["input_ids"][0].tolist()


def test_config_is_the_checkpoints() -> None:
    """Every value the gemma3 family and its processor read, recovered from the two files (layer types,
    query scale and the local RoPE base as llama.cpp assumes them, which the source checkpoint follows)."""
    from transformers import AutoConfig

    want = AutoConfig.from_pretrained(str(gguf_makers.source_checkpoint(FAMILY)))
    got = registry.load_config(registry.resolve_model(str(gguf_makers.gguf_vlm_dir(FAMILY))))
    assert got.architectures == want.architectures
    for key in ("mm_tokens_per_image", "boi_token_index", "eoi_token_index", "image_token_index", "eos_token_id"):
        assert getattr(got, key) == getattr(want, key), key
    text_keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "query_pre_attn_scalar", "rms_norm_eps", "sliding_window",
                 "layer_types", "rope_parameters", "final_logit_softcapping", "attn_logit_softcapping",
                 "attention_bias", "hidden_activation", "tie_word_embeddings", "max_position_embeddings",
                 "bos_token_id", "pad_token_id")  # fmt: skip
    for key in text_keys:
        assert getattr(got.text_config, key) == getattr(want.text_config, key), key
    vision_keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                   "patch_size", "layer_norm_eps", "hidden_act", "num_channels", "vision_use_head")  # fmt: skip
    for key in vision_keys:
        assert getattr(got.vision_config, key) == getattr(want.vision_config, key), key


def test_f32_tensors_are_the_checkpoints_as_converted() -> None:
    """Every checkpoint tensor comes back under its released name, none left over: bit for bit, except the
    norms ((w + 1) - 1 in fp32: +1 undone) and the projection matrix (the converter's F16)."""
    got = pair_values(gguf_makers.gguf_vlm_dir(FAMILY))
    want = stored(gguf_makers.source_checkpoint(FAMILY))
    assert got.keys() == want.keys()
    shifted = [n for n in want if n.startswith("language_model.") and n.endswith("norm.weight")]
    shifted.append("multi_modal_projector.mm_soft_emb_norm.weight")
    assert len(shifted) == 7 * 6 + 2  # per layer: 4 sandwich norms, q and k norms; the final and projector's
    for name, tensor in want.items():
        tensor = tensor.float()
        if name in shifted:
            tensor = (tensor + 1) - 1
        elif name == "multi_modal_projector.mm_input_projection_weight":
            tensor = tensor.half().float()
        assert torch.equal(got[name], tensor), name


def test_f32_pair_greedy_equals_transformers(tmp_path: Path) -> None:
    """The directory form finds its mmproj; the tokenizer and Gemma3Processor rebuilt from the files give
    Transformers' prompt ids on the source checkpoint (boi, 16 image tokens, eoi a picture); greedy tokens in
    exact numerics are Transformers' on the files' values."""
    directory = gguf_makers.gguf_vlm_dir(FAMILY)
    engine = Engine(str(directory), dtype="float32", kv_cache_tokens=2048, numerics="exact")
    assert engine.source.mmproj == gguf_makers.mmproj_file(directory)
    assert engine.hf_config.architectures == ["Gemma3ForConditionalGeneration"]
    source = hf_model(gguf_makers.source_checkpoint(FAMILY))
    assert [engine.process_messages(c).token_ids for c in CONVERSATIONS] == [
        hf_prompt_ids(source[1], c) for c in CONVERSATIONS
    ]
    hf = hf_model(dequantized_checkpoint(directory, tmp_path))
    ours = [o.token_ids for o in engine.chat(CONVERSATIONS, GREEDY)]
    assert ours == [hf_greedy(hf, c, MAX_TOKENS) for c in CONVERSATIONS]


@pytest.mark.parametrize(("text_type", "max_error"), [("Q8_0", 0.01), ("Q4_K_M", 0.1)])
def test_quantized_pair_greedy_equals_transformers_on_its_values(
    text_type: str, max_error: float, tmp_path: Path
) -> None:
    """The text file holds the type it says (the converter's Q8_0; llama-quantize's Q4_K, not a fallback), its
    values are the checkpoint's within the type's error, and greedy tokens equal Transformers' on them."""
    from gguf import GGMLQuantizationType

    directory = gguf_makers.gguf_vlm_dir(FAMILY, text_type)
    kind = GGMLQuantizationType[text_type.removesuffix("_M")]
    types = {t.tensor_type for t in loader.gguf_reader(gguf_makers.text_file(directory)).tensors}
    assert kind in types, types
    checkpoint = dequantized_checkpoint(directory, tmp_path)
    values, original = stored(checkpoint), stored(gguf_makers.source_checkpoint(FAMILY))
    for name, value in values.items():
        error = (value - original[name]).norm() / original[name].norm().clamp_min(1e-12)
        assert error < max_error, (name, float(error))
    embedding = "language_model.model.embed_tokens.weight"
    assert not torch.equal(values[embedding], original[embedding])  # the text's matrices were rounded
    engine = Engine(str(directory), dtype="float32", kv_cache_tokens=2048, numerics="exact")
    ours = [o.token_ids for o in engine.chat(CONVERSATIONS, GREEDY)]
    assert ours == [hf_greedy(hf_model(checkpoint), c, MAX_TOKENS) for c in CONVERSATIONS]


def test_fast_numerics_serve_the_q4_k_m_files_codes() -> None:
    """Fast numerics (the default) serve a Q4_K_M Gemma 3 file from its codes, as the qwen pairs
    (tests/test_gguf_kquants.py): each decoder linear is int4 where all its shards are Q4_K, else int8 (the tied
    LM head stays the embedding's), within the Q4_K mapping's fp16 error of exact numerics' weights, and it
    answers text and images."""
    from vlm_engine.models.quantized import QuantizedLinear

    directory = gguf_makers.gguf_vlm_dir(FAMILY, "Q4_K_M")
    types = {t.name: t.tensor_type.name for t in loader.gguf_reader(gguf_makers.text_file(directory)).tensors}
    shards = {"self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"), "self_attn.o_proj": ("attn_output",),
              "mlp.gate_up_proj": ("ffn_gate", "ffn_up"), "mlp.down_proj": ("ffn_down",)}  # fmt: skip
    layers = {int(name.split(".")[1]) for name in types if name.startswith("blk.")}
    want = {
        f"model.layers.{layer}.{module}": 4 if all(types[f"blk.{layer}.{p}.weight"] == "Q4_K" for p in parts) else 8
        for layer in sorted(layers)
        for module, parts in shards.items()
    }
    assert set(want.values()) == {4, 8}  # llama-quantize's mix: the test covers both paths
    fast = Engine(str(directory), dtype="float32", kv_cache_tokens=2048)
    served = {name: m for name, m in fast.model.named_modules() if isinstance(m, QuantizedLinear)}
    assert {name: m.bits for name, m in served.items()} == want
    exact = dict(Engine(str(directory), dtype="float32", kv_cache_tokens=2048, numerics="exact").model.named_modules())
    for name, layer in served.items():
        weight = exact[name].weight.float()
        error = (layer.dequantized_weight() - weight).abs().max() / weight.abs().max()
        assert error < (2e-3 if layer.bits == 4 else 1e-2), (name, float(error))  # fp16 d, m / Q8_0 re-rounding
    outputs = fast.chat(CONVERSATIONS, GREEDY)
    assert all(o.token_ids for o in outputs)


def test_text_gguf_alone_is_the_gemma3_text_model(tmp_path: Path) -> None:
    """Without its mmproj the text file is Gemma3ForCausalLM (the decoder alone): its greedy text tokens are
    Transformers' Gemma 3's, and an image is the request's error, not a crash."""
    directory = gguf_makers.gguf_vlm_dir(FAMILY)
    shutil.copy(gguf_makers.text_file(directory), tmp_path / "text.gguf")
    engine = Engine(str(tmp_path), dtype="float32", kv_cache_tokens=2048, numerics="exact")
    assert engine.source.mmproj is None and engine.hf_config.architectures == ["Gemma3ForCausalLM"]
    source = hf_model(gguf_makers.source_checkpoint(FAMILY))
    assert engine.chat(CONVERSATIONS[:1], GREEDY)[0].token_ids == hf_greedy(source, CONVERSATIONS[0], MAX_TOKENS)
    with pytest.raises(PromptError, match="does not accept images"):
        engine.process_messages(CONVERSATIONS[1])


def test_an_mmproj_of_another_family_is_refused() -> None:
    text = gguf_makers.text_file(gguf_makers.gguf_vlm_dir(FAMILY))
    smolvlm = gguf_makers.mmproj_gguf("smolvlm")
    with pytest.raises(ValueError, match="gemma3 text takes gemma3"):
        registry.load_config(registry.resolve_model(str(text), str(smolvlm)))
