"""GGUF SmolVLM (models/gguf_vlm.py): the text GGUF (arch `llama`: SmolVLM2's SmolLM2 text) and its mmproj
(projector type `idefics3`) as llama.cpp's converter writes them from the tiny random SmolVLM2 checkpoint
(testkit/gguf_makers.py), served by our smolvlm family. F32: the config values the family reads and every
tensor (the llama q/k rows unpermuted) are the checkpoint's, and greedy tokens equal Transformers' on the
checkpoint. Q8_0 text: greedy tokens equal Transformers' on the checkpoint holding the file's dequantized
values. The files of a SmolVLM v1 checkpoint (Idefics3's classes) cannot be told from SmolVLM2's: served as
SmolVLM2, they give Transformers' Idefics3 prompt ids and tokens."""

from __future__ import annotations

import functools
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from testkit import gguf_makers
from tests.conftest import hf_greedy, make_image, to_hf_messages, user
from vlm_engine import Engine, SamplingParams
from vlm_engine.models import loader, registry

pytestmark = pytest.mark.slow  # the first run converts (cached after)

FAMILY = "smolvlm"
BOTH = ["smolvlm", "idefics3"]  # SmolVLM2 and SmolVLM v1 (Idefics3ForConditionalGeneration) checkpoints
MAX_TOKENS = 12
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
CONVERSATIONS = [
    [{"role": "user", "content": "Tell me a story about a red fox."}],
    user(make_image(97, 61, 1), "What is in this picture?"),  # odd sizes: resized to 192 x 121, 3 x 2 tiles + global
]


@functools.cache
def hf_model(checkpoint: Path) -> tuple[Any, Any]:
    from transformers import AutoModelForImageTextToText, AutoProcessor

    model = AutoModelForImageTextToText.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    return model, AutoProcessor.from_pretrained(str(checkpoint))


def stored(checkpoint: Path) -> dict[str, torch.Tensor]:
    return {n: t.read() if isinstance(t, loader.StoredTensor) else t for n, t in loader.iter_safetensors(checkpoint)}


def test_config_is_the_checkpoints() -> None:
    """Every value the smolvlm family and its processor read, recovered from the two files."""
    from transformers import AutoConfig

    want = AutoConfig.from_pretrained(str(gguf_makers.source_checkpoint(FAMILY)))
    got = registry.load_config(registry.resolve_model(str(gguf_makers.gguf_vlm_dir(FAMILY))))
    assert got.architectures == want.architectures
    assert (got.scale_factor, got.image_token_id) == (want.scale_factor, want.image_token_id)
    text_keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                 "num_key_value_heads", "head_dim", "rms_norm_eps", "rope_parameters", "tie_word_embeddings",
                 "attention_bias", "hidden_act", "bos_token_id", "eos_token_id", "pad_token_id")  # fmt: skip
    for key in text_keys:
        assert getattr(got.text_config, key) == getattr(want.text_config, key), key
    vision_keys = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "image_size",
                   "patch_size", "layer_norm_eps", "hidden_act", "num_channels")  # fmt: skip
    for key in vision_keys:
        assert getattr(got.vision_config, key) == getattr(want.vision_config, key), key


@pytest.mark.parametrize("family", BOTH)
def test_f32_tensors_are_the_checkpoints_bit_for_bit(family: str) -> None:
    """The inverted name map with conversion/llama.py's q/k row permutation undone: every checkpoint
    tensor comes back exactly, none left over."""
    source = registry.resolve_model(str(gguf_makers.gguf_vlm_dir(family)))
    got = dict(source.weights(registry.load_config(source)))
    want = stored(gguf_makers.source_checkpoint(family))
    assert got.keys() == want.keys()
    for name, tensor in want.items():
        assert torch.equal(got[name], tensor.float()), name


@pytest.mark.parametrize("family", BOTH)
def test_f32_pair_greedy_equals_transformers(family: str) -> None:
    """The processor rebuilt from the files (resize edge from the mmproj, tiles of the tower's size, the
    vocabulary's user-defined double newline matched whole) expands the prompts into Transformers' ids;
    greedy tokens in exact numerics are Transformers'."""
    engine = Engine(str(gguf_makers.gguf_vlm_dir(family)), dtype="float32", kv_cache_tokens=2048, numerics="exact")
    assert engine.source.mmproj is not None and engine.hf_config.architectures == ["SmolVLMForConditionalGeneration"]
    hf = hf_model(gguf_makers.source_checkpoint(family))
    prompts = [engine.process_messages(c).token_ids for c in CONVERSATIONS]
    assert prompts == [hf_prompt_ids(hf[1], c) for c in CONVERSATIONS]
    assert [o.token_ids for o in engine.chat(CONVERSATIONS, GREEDY)] == [
        hf_greedy(hf, c, MAX_TOKENS) for c in CONVERSATIONS
    ]


def hf_prompt_ids(processor: Any, conversation: list[dict[str, Any]]) -> list[int]:
    messages, images = to_hf_messages(conversation)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=[text], images=images or None, return_tensors="pt")["input_ids"][0].tolist()


def test_q8_0_text_greedy_equals_transformers_on_its_values(tmp_path: Path) -> None:
    """The converter's Q8_0 text file holds Q8_0 matrices, their values are the checkpoint's within
    Q8_0's error, and greedy tokens equal Transformers' on those values."""
    from gguf import GGMLQuantizationType
    from safetensors.torch import save_file

    directory = gguf_makers.gguf_vlm_dir(FAMILY, "Q8_0")
    types = {t.tensor_type for t in loader.gguf_reader(gguf_makers.text_file(directory)).tensors}
    assert GGMLQuantizationType.Q8_0 in types, types
    source = gguf_makers.source_checkpoint(FAMILY)
    for item in source.iterdir():
        if item.suffix != ".safetensors":
            (tmp_path / item.name).symlink_to(item)
    pair = registry.resolve_model(str(directory))
    values = dict(pair.weights(registry.load_config(pair)))
    original = stored(source)
    for name, value in values.items():
        error = (value - original[name]).norm() / original[name].norm().clamp_min(1e-12)
        assert error < 0.01, (name, float(error))
    assert any(not torch.equal(values[n], original[n]) for n in values)  # the text's matrices were rounded
    save_file(values, str(tmp_path / "model.safetensors"), {"format": "pt"})
    engine = Engine(str(directory), dtype="float32", kv_cache_tokens=2048, numerics="exact")
    ours = [o.token_ids for o in engine.chat(CONVERSATIONS, GREEDY)]
    assert ours == [hf_greedy(hf_model(tmp_path), c, MAX_TOKENS) for c in CONVERSATIONS]


def test_text_gguf_alone_is_the_llama_text_model(tmp_path: Path) -> None:
    """Without its mmproj, SmolVLM's text file is the plain llama model (loader.py's config and weights):
    its greedy text tokens are Transformers' SmolVLM's."""
    directory = gguf_makers.gguf_vlm_dir(FAMILY)
    shutil.copy(gguf_makers.text_file(directory), tmp_path / "text.gguf")
    engine = Engine(str(tmp_path), dtype="float32", kv_cache_tokens=2048, numerics="exact")
    assert engine.source.mmproj is None and engine.hf_config.architectures == ["LlamaForCausalLM"]
    assert engine.chat(CONVERSATIONS[:1], GREEDY)[0].token_ids == hf_greedy(
        hf_model(gguf_makers.source_checkpoint(FAMILY)), CONVERSATIONS[0], MAX_TOKENS
    )


def test_a_qwen_mmproj_beside_smolvlm_text_is_refused() -> None:
    text = gguf_makers.text_file(gguf_makers.gguf_vlm_dir(FAMILY))
    qwen = gguf_makers.mmproj_file(gguf_makers.gguf_vlm_dir("qwen2-vl"))
    with pytest.raises(ValueError, match="llama text takes idefics3"):
        registry.load_config(registry.resolve_model(str(text), str(qwen)))
