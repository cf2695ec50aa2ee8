"""Gemma 3 beyond the family matrix (tests/test_family_matrix.py), on the tiny checkpoint
(testkit/gemma3_checkpoints.py: a 32-token sliding window on 3 of 5 layers, 16 tokens an image): the
windows and the bidirectional image blocks, prompts longer than the window with images on both sides of its
edge, each image's span its token-type run, prefill chunks whose budget ends inside an image, pan-and-scan
crops, the bf16 fused path against bf16 exact; and on the released configs (meta device) the layouts,
windows and rotary bases of gemma-3-4b-it / 12b-it and the text-only gemma-3-1b-it's names."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import make_image, to_hf_messages, user
from tests.family_table import GEMMA3_WINDOW as WINDOW
from tests.family_table import exact_engine, family, hf_model, meta_model, references
from tests.released_configs import GEMMA_3_1B, GEMMA3_TEXT, gemma3_config
from tests.test_fast_numerics import greedy_agreement
from vlm_engine import Engine, SamplingParams
from vlm_engine.models import loader
from vlm_engine.models.families.gemma3.model import Gemma3ForCausalLM

GEMMA3 = family("gemma3")
CONVERSATIONS = GEMMA3.conversations
MAX_TOKENS = GEMMA3.max_tokens
GREEDY = GEMMA3.greedy


@pytest.fixture(scope="module")
def engine() -> Engine:
    return exact_engine(GEMMA3)


@pytest.fixture(scope="module")
def checkpoint() -> Path:
    return GEMMA3.path


def test_the_model_has_windows_and_bidirectional_images(engine: Engine) -> None:
    model: Any = engine.model
    assert model.attention_windows == (WINDOW, WINDOW, 0, WINDOW, 0)
    assert model.bidirectional_media is True
    assert [layer.self_attn.window for layer in model.model.layers] == list(model.attention_windows)


def test_long_prompts_cross_the_window(engine: Engine) -> None:
    for conv in CONVERSATIONS[4:]:
        prompt = engine.process_messages(conv)
        first, last = prompt.media[0].span, prompt.media[-1].span
        assert len(prompt.token_ids) - first.end > WINDOW  # the first image leaves the window
        if len(prompt.media) > 1:
            assert len(prompt.token_ids) - last.end < WINDOW  # the last one is (at least partly) inside it


def test_each_images_span_is_its_token_type_run(engine: Engine) -> None:
    """One item per image, its span the image-token run (Transformers' bidirectional block)."""
    _, processor = hf_model(GEMMA3)
    for conv in CONVERSATIONS:
        hf_messages, images = to_hf_messages(conv)
        text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
        inputs = processor(text=[text], images=images or None, return_tensors="pt")
        prompt = engine.process_messages(conv)
        image_rows = [i for i, t in enumerate(inputs["token_type_ids"][0].tolist()) if t == 1]
        assert [i for m in prompt.media for i in range(m.span.offset, m.span.end)] == image_rows
        assert len(prompt.media) == len(images)


def test_chunked_prefill_with_the_budget_inside_an_image(checkpoint: Path) -> None:
    """24-token chunks: the budget runs out inside image spans (16 tokens each, not at 24-token
    boundaries); the chunk ends before such an image, whose tokens attend to each other both ways."""
    engine = Engine(
        str(checkpoint), dtype="float32", kv_cache_tokens=4096, max_num_batched_tokens=24, page_size=16, numerics="exact"
    )
    prompts = [engine.process_messages(c) for c in CONVERSATIONS]
    assert any(m.span.offset // 24 != (m.span.end - 1) // 24 for p in prompts for m in p.media)
    for conv, want in zip(CONVERSATIONS, references(GEMMA3)):
        assert engine.chat([conv], GREEDY)[0].token_ids == want
    assert [o.token_ids for o in engine.chat(CONVERSATIONS, GREEDY)] == list(references(GEMMA3))


# ---- pan-and-scan --------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pan_and_scan_checkpoint(checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny checkpoint with the processor's pan-and-scan on (crops of at least 16 px)."""
    path = tmp_path_factory.mktemp("gemma3-pan-and-scan")
    for file in checkpoint.iterdir():
        if file.is_file():
            (path / file.name).symlink_to(file)
    config_file = path / "processor_config.json"
    config = json.loads(config_file.read_text())
    config["image_processor"].update(do_pan_and_scan=True, pan_and_scan_min_crop_size=16)
    config_file.unlink()  # a symlink into the cache: write a file of our own in its place
    config_file.write_text(json.dumps(config))
    return path


def test_pan_and_scan_crops_match_hf(pan_and_scan_checkpoint: Path) -> None:
    """The checkpoint's image processor config turns pan-and-scan on; Transformers' processor takes it
    as a call argument: each crop is an image-token run and a media item of its own."""
    from transformers import AutoProcessor

    model, _ = hf_model(GEMMA3)
    processor = AutoProcessor.from_pretrained(str(pan_and_scan_checkpoint))
    conv = user("Wide and tall:", make_image(150, 40, 8), make_image(30, 100, 9), "Describe both.")
    hf_messages, images = to_hf_messages(conv)
    text = processor.apply_chat_template(hf_messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(
        text=[text], images=images, return_tensors="pt", do_pan_and_scan=True, pan_and_scan_min_crop_size=16
    )
    with torch.inference_mode():
        out = model.generate(**inputs, max_new_tokens=MAX_TOKENS, do_sample=False)
    want = out[0, inputs["input_ids"].shape[1] :].tolist()
    engine = Engine(str(pan_and_scan_checkpoint), dtype="float32", kv_cache_tokens=4096, numerics="exact")
    prompt = engine.process_messages(conv)
    assert prompt.token_ids == inputs["input_ids"][0].tolist()
    assert len(prompt.media) == len(inputs["pixel_values"]) > len(images)  # crops: items of their own
    assert len({m.span.content_hash for m in prompt.media}) == len(prompt.media)
    assert engine.chat([conv], GREEDY)[0].token_ids == want


# ---- the engine's other numerics on this family --------------------------------------------------


def test_bf16_fused_path_runs_gemma_layers(checkpoint: Path, ops: object) -> None:
    """bf16 fast numerics (fused ops on, linears prepacked): Gemma's layers have no fused plan and run
    as their modules with the fused ops that are exact for them; greedy tokens agree with bf16 exact
    (Transformers' ops) for most of the run."""
    fast = Engine(str(checkpoint), dtype="bfloat16", kv_cache_tokens=2048, numerics="fast")
    exact = Engine(str(checkpoint), dtype="bfloat16", kv_cache_tokens=2048, numerics="exact")
    assert fast.runner.fused_ops is not None  # `ops`: built, or this test failed (CI) / skipped with the errors
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    convs = CONVERSATIONS[:3]
    agreed = [greedy_agreement(f.token_ids, e.token_ids) for f, e in zip(fast.chat(convs, params), exact.chat(convs, params))]
    assert sum(agreed) >= len(convs) * MAX_TOKENS // 2, agreed


# ---- the released configs, on the meta device ----------------------------------------------------


@pytest.mark.parametrize("name", sorted(GEMMA3_TEXT))
def test_the_real_layouts_windows_and_rope(name: str) -> None:
    config = gemma3_config(name)
    model: Any = meta_model(config)
    text = config.text_config
    layers, kv_heads, head_dim = model.kv_layout
    assert (layers, kv_heads, head_dim) == (text.num_hidden_layers, text.num_key_value_heads, 256)
    # five sliding layers of 1024 tokens, then a full one
    assert model.attention_windows == tuple(0 if (i + 1) % 6 == 0 else 1024 for i in range(layers))
    assert model.bidirectional_media
    attn = model.model.layers[0].self_attn
    assert attn.scale == 256**-0.5 and attn.window == 1024
    # the local layers rotate with base 1e4, the global ones with theta 1e6 over 8 (linear scaling)
    local, full = (model.model.rotaries[model.model.layer_rotary[i]] for i in (0, 5))
    assert torch.allclose(local.inv_freq[1], torch.tensor(10000.0 ** (-2 / 256)))
    assert torch.allclose(full.inv_freq[1], torch.tensor(1000000.0 ** (-2 / 256) / 8))


def test_the_text_only_model_loads_gemma_3_1b() -> None:
    from transformers import Gemma3ForCausalLM as HFGemma3ForCausalLM
    from transformers import Gemma3TextConfig

    config = Gemma3TextConfig(**GEMMA_3_1B, architectures=["Gemma3ForCausalLM"])
    with torch.device("meta"):
        model = Gemma3ForCausalLM(config)
        hf = HFGemma3ForCausalLM(config)
    checkpoint = [(n, torch.empty(t.shape, device="meta")) for n, t in hf.state_dict().items() if n != "lm_head.weight"]
    assert loader.load_weights(model, checkpoint) == []
    assert model.attention_windows.count(512) == 22 and model.attention_windows.count(0) == 4
    assert not model.bidirectional_media
