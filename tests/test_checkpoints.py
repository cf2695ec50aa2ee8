"""Tests for testkit.checkpoints (deterministic offline checkpoints)."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

# No hub access anywhere in this project; set before transformers/huggingface_hub import.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

import pytest
import torch
from PIL import Image

from testkit import checkpoints as ckpt

REPO_ROOT = Path(__file__).resolve().parents[1]


def _file_digests(path: Path) -> dict[str, str]:
    return {
        f.name: hashlib.sha256(f.read_bytes()).hexdigest()
        for f in sorted(path.iterdir())
        if f.is_file() and f.name != ckpt.COMPLETE_MARKER
    }


def _image(height: int, width: int, seed: int = 0) -> Image.Image:
    generator = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8)
    return Image.fromarray(pixels.numpy())


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # Built through the cache helper so the cache path is exercised too.
    return ckpt.cached_qwen2_vl("tiny", seed=0, cache_root=tmp_path_factory.mktemp("cache"))


@pytest.fixture(scope="module")
def tiny_model(tiny_dir: Path):
    from transformers import Qwen2VLForConditionalGeneration

    return Qwen2VLForConditionalGeneration.from_pretrained(str(tiny_dir)).eval()


@pytest.fixture(scope="module")
def tiny_processor(tiny_dir: Path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(str(tiny_dir))


# ---------------------------------------------------------------- determinism


def test_tiny_build_is_deterministic(tiny_dir: Path, tmp_path: Path) -> None:
    again = ckpt.write_qwen2_vl(tmp_path / "again", "tiny", seed=0)
    first, second = _file_digests(tiny_dir), _file_digests(again)
    assert "model.safetensors" in first and "tokenizer.json" in first
    assert first == second


def test_tiny_build_is_deterministic_across_processes(tiny_dir: Path, tmp_path: Path) -> None:
    # A fresh interpreter with another hash seed: catches dict/set-order or Rust HashMap
    # randomness that a same-process rebuild could miss.
    out = tmp_path / "subprocess"
    code = f"from testkit.checkpoints import write_qwen2_vl; write_qwen2_vl({str(out)!r})"
    env = {**os.environ, "PYTHONHASHSEED": "12345", "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-c", code], check=True, env=env, cwd=REPO_ROOT, capture_output=True)
    assert _file_digests(out) == _file_digests(tiny_dir)


def test_seed_changes_weights_but_not_tokenizer(tiny_dir: Path, tmp_path: Path) -> None:
    other = _file_digests(ckpt.write_qwen2_vl(tmp_path / "seed1", "tiny", seed=1))
    base = _file_digests(tiny_dir)
    assert other["model.safetensors"] != base["model.safetensors"]
    assert other["tokenizer.json"] == base["tokenizer.json"]


# ---------------------------------------------------------------- config / files


def test_tiny_config_matches_tokenizer(tiny_dir: Path, tiny_processor) -> None:
    from transformers import AutoConfig, GenerationConfig

    config = AutoConfig.from_pretrained(str(tiny_dir))
    text, vision = config.text_config, config.vision_config
    tokenizer = tiny_processor.tokenizer
    assert config.architectures == ["Qwen2VLForConditionalGeneration"]
    assert (text.hidden_size, text.num_hidden_layers) == (128, 4)
    assert (text.num_attention_heads, text.num_key_value_heads) == (4, 2)
    head_dim = text.hidden_size // text.num_attention_heads
    assert text.rope_parameters["mrope_section"] == [4, 6, 6]
    assert sum(text.rope_parameters["mrope_section"]) == head_dim // 2
    assert (vision.depth, vision.embed_dim, vision.num_heads, vision.hidden_size) == (2, 64, 4, 128)
    assert (vision.patch_size, vision.spatial_merge_size, vision.temporal_patch_size) == (14, 2, 2)

    assert text.vocab_size == len(tokenizer) == ckpt.QWEN2_VL_VOCAB_SIZE
    ids = tokenizer.convert_tokens_to_ids
    assert config.image_token_id == ids("<|image_pad|>")
    assert config.video_token_id == ids("<|video_pad|>")
    assert config.vision_start_token_id == ids("<|vision_start|>")
    assert config.vision_end_token_id == ids("<|vision_end|>")
    assert text.eos_token_id == tokenizer.eos_token_id == ids("<|im_end|>")
    assert text.pad_token_id == tokenizer.pad_token_id == ids("<|endoftext|>")

    generation = GenerationConfig.from_pretrained(str(tiny_dir))
    assert generation.do_sample is False
    assert generation.eos_token_id == ids("<|im_end|>")


def test_tiny_files_and_key_layout(tiny_dir: Path) -> None:
    from safetensors import safe_open

    for name in ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                 "tokenizer_config.json", "preprocessor_config.json", "chat_template.jinja"):
        assert (tiny_dir / name).is_file(), name
    with safe_open(str(tiny_dir / "model.safetensors"), framework="pt") as handle:
        keys = list(handle.keys())
        dtypes = {handle.get_slice(k).get_dtype() for k in keys}
    # transformers saves the hub layout (model.* / visual.* / lm_head.*) even though the
    # in-memory module tree is model.language_model.* / model.visual.*.
    assert all(k.startswith(("model.", "visual.", "lm_head.")) for k in keys)
    assert any("visual." in k for k in keys) and "lm_head.weight" in keys
    assert dtypes == {"F32"}


def test_tokenizer_round_trips_arbitrary_text(tiny_processor) -> None:
    tokenizer = tiny_processor.tokenizer
    text = "Describe the picture: héllo wörld 🐱 中文 \t tabs\n\nnew lines 12345 {x: [1, 2]}"
    ids = tokenizer(text, add_special_tokens=False).input_ids
    assert tokenizer.decode(ids) == text
    for special in ckpt.QWEN2_VL_SPECIAL_TOKENS:
        assert tokenizer(special, add_special_tokens=False).input_ids == [tokenizer.convert_tokens_to_ids(special)]


# ---------------------------------------------------------------- chat template / processor


def test_chat_template_renders_like_qwen2_vl(tiny_processor) -> None:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
    rendered = tiny_processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>What is this?<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    conversation = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "video"}, {"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": "Hello."},
    ]
    rendered = tiny_processor.apply_chat_template(conversation, tokenize=False)
    assert rendered == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\n<|vision_start|><|video_pad|><|vision_end|>Hi<|im_end|>\n"
        "<|im_start|>assistant\nHello.<|im_end|>\n"
    )
    # The tokenizer alone carries the same template (engines often load only the tokenizer).
    assert tiny_processor.tokenizer.chat_template == ckpt.QWEN2_VL_CHAT_TEMPLATE


def test_processor_expands_image_pad_tokens(tiny_processor) -> None:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    text = tiny_processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = tiny_processor(text=[text], images=[_image(180, 240)], return_tensors="pt")
    grid_t, grid_h, grid_w = inputs["image_grid_thw"][0].tolist()
    merge = tiny_processor.image_processor.merge_size
    image_token_id = tiny_processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    num_pads = int((inputs["input_ids"] == image_token_id).sum())
    assert num_pads == grid_t * grid_h * grid_w // merge**2
    assert inputs["pixel_values"].shape[0] == grid_t * grid_h * grid_w
    # A big image is capped by the tiny preset's max_pixels (64 merged tokens).
    big = tiny_processor(text=[text], images=[_image(1000, 1000)], return_tensors="pt")
    _, big_h, big_w = big["image_grid_thw"][0].tolist()
    assert big_h * big_w * 14 * 14 <= ckpt.QWEN2_VL_PRESETS["tiny"].max_pixels


# ---------------------------------------------------------------- Hugging Face generation


def _greedy(model, inputs: dict, max_new_tokens: int = 16):
    with torch.no_grad():
        out = model.generate(
            **inputs, max_new_tokens=max_new_tokens, do_sample=False,
            output_scores=True, return_dict_in_generate=True,
        )
    new_tokens = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return new_tokens, torch.stack([s[0] for s in out.scores])


def test_hf_greedy_generate_text(tiny_model, tiny_processor) -> None:
    messages = [{"role": "user", "content": "Write a short story about a small red cat."}]
    text = tiny_processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = tiny_processor.tokenizer(text, return_tensors="pt")
    tokens, scores = _greedy(tiny_model, dict(inputs))
    assert torch.isfinite(scores).all()
    assert len(tokens) >= 1
    assert len(set(tokens)) > len(tokens) // 2  # not one token repeated forever
    top2 = scores.topk(2, dim=-1).values
    gaps = top2[:, 0] - top2[:, 1]
    assert gaps.median() > 0.05  # greedy choices are not near-ties


def test_hf_greedy_generate_with_image(tiny_model, tiny_processor) -> None:
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Describe."}]}]
    text = tiny_processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = tiny_processor(text=[text], images=[_image(112, 168, seed=1)], return_tensors="pt")
    tokens, scores = _greedy(tiny_model, dict(inputs))
    assert torch.isfinite(scores).all()
    assert len(set(tokens)) > len(tokens) // 2
    # The image actually influences the output logits.
    other = tiny_processor(text=[text], images=[_image(112, 168, seed=2)], return_tensors="pt")
    _, other_scores = _greedy(tiny_model, dict(other), max_new_tokens=1)
    assert not torch.allclose(scores[0], other_scores[0])


# ---------------------------------------------------------------- cache helper


def test_cached_checkpoint_builds_once_and_atomically(tmp_path: Path) -> None:
    calls: list[Path] = []

    def builder(target: Path) -> None:
        calls.append(target)
        (target / "weights.bin").write_bytes(b"abc")

    first = ckpt.cached_checkpoint("toy", builder, cache_root=tmp_path)
    second = ckpt.cached_checkpoint("toy", builder, cache_root=tmp_path)
    assert first == second and len(calls) == 1
    assert (first / "weights.bin").read_bytes() == b"abc"
    assert (first / ckpt.COMPLETE_MARKER).exists()
    assert f"-v{ckpt.BUILDER_VERSION}-" in first.name
    assert not [p for p in tmp_path.iterdir() if ".tmp-" in p.name]

    def failing(target: Path) -> None:
        (target / "partial").write_bytes(b"x")
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        ckpt.cached_checkpoint("broken", failing, cache_root=tmp_path)
    assert not [p for p in tmp_path.iterdir() if "broken" in p.name and p.is_dir()]


def test_default_cache_root_honours_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("VLM_ENGINE_CACHE", str(tmp_path))
    assert ckpt.default_cache_root() == tmp_path / "checkpoints"


# ---------------------------------------------------------------- SmolLM2 / bench (slow)


def test_smollm2_gguf_path_exists() -> None:
    path = ckpt.smollm2_gguf_path()
    assert path.is_file() and path.name == ckpt.SMOLLM2_GGUF_NAME


@pytest.mark.slow
def test_smollm2_conversion(tmp_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = ckpt.write_smollm2_safetensors(tmp_path / "smollm2")
    assert (out / ckpt.COMPLETE_MARKER).exists()
    assert ckpt.write_smollm2_safetensors(out) == out  # second call is a no-op
    model = AutoModelForCausalLM.from_pretrained(str(out)).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(out))
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.vocab_size == 49152 and not hasattr(model.config, "quantization_config")
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text.endswith("<|im_start|>assistant\n")
    inputs = tokenizer(text, return_tensors="pt")
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=12, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1]:])
    assert "Paris" in answer


@pytest.mark.slow
def test_bench_preset_shape(tmp_path: Path) -> None:
    from transformers import AutoConfig

    out = ckpt.write_qwen2_vl(tmp_path / "bench", "bench", seed=0)
    assert ckpt.count_parameters(out) == 268_432_384
    config = AutoConfig.from_pretrained(str(out))
    text = config.text_config
    assert (text.hidden_size, text.num_attention_heads, text.num_key_value_heads) == (1536, 12, 2)
    assert text.intermediate_size == 8960 and text.rope_parameters["mrope_section"] == [16, 24, 24]
    assert config.vision_config.embed_dim == 1280
