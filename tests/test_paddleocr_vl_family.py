"""PaddleOCR-VL beyond the family matrix (tests/test_family_matrix.py), on the tiny checkpoint
(testkit/paddleocr_vl_checkpoints.py): the NaViT encoder and the merge projector equal Transformers' bit for
bit in fp32 on packed images of odd sizes, the resampled position table equals torch's own bilinear
F.interpolate, the prompt's M-RoPE positions equal Transformers' get_rope_index, both weight namings load
(the released files' `mlp_AR.*` / `visual.*` / `model.*` and Transformers 5's in-memory names), prefill chunks
ending inside an image equal Transformers' greedy tokens, the bf16 tower stays near fp32, and a config with
biases on every projection is refused."""

from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import safetensors.torch
import torch
import torch.nn.functional as F

from tests.conftest import hf_greedy, make_image, to_hf_messages, user
from tests.family_table import exact_engine, family, hf_model, references
from vlm_engine import Engine
from vlm_engine.models import loader, registry
from vlm_engine.models.families.paddleocr_vl.vision import encoder_plan

PADDLEOCR_VL = family("paddleocr-vl")
TWO_IMAGES = PADDLEOCR_VL.conversations[2]


def hf_inputs(conversation: list[dict[str, Any]]) -> Any:
    _, processor = hf_model(PADDLEOCR_VL)
    messages, images = to_hf_messages(conversation)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return processor(text=[text], images=images or None, return_tensors="pt")


def our_model(names: str = "file") -> Any:
    """Our fp32 model of the tiny checkpoint, loaded from the file's names or from Transformers' state dict."""
    hf, _ = hf_model(PADDLEOCR_VL)
    model = registry.model_class(hf.config)(hf.config)
    if names == "file":
        weights = list(safetensors.torch.load_file(str(PADDLEOCR_VL.path / "model.safetensors")).items())
    else:
        weights = list(hf.state_dict().items())
    assert loader.load_weights(model, weights) == []
    return model.eval()


def grids_of(inputs: Any) -> list[tuple[int, int, int]]:
    return [tuple(int(x) for x in g) for g in inputs["image_grid_thw"]]


def test_the_tower_and_projector_equal_transformers_bit_for_bit() -> None:
    hf, _ = hf_model(PADDLEOCR_VL)
    inputs = hf_inputs(TWO_IMAGES)
    grids = grids_of(inputs)
    assert len({g[1:] for g in grids}) == 2 and any(h != w for _, h, w in grids)  # two odd, different grids
    pixels = inputs["pixel_values"]
    with torch.inference_mode():
        want = hf.model.get_image_features(pixels, inputs["image_grid_thw"]).pooler_output
        got = our_model().encode_media(list(pixels.split([t * h * w for t, h, w in grids])), grids)
    assert [g.shape for g in got] == [w.shape for w in want]
    assert all(torch.equal(g, w) for g, w in zip(got, want))


def test_resampled_positions_are_torchs_bilinear_interpolation() -> None:
    """The taps reproduce F.interpolate(bilinear, align_corners=False) of the side x side table to each grid,
    shrinking and growing, square and not."""
    side, dim = 8, 5
    table = torch.randn(side * side, dim, generator=torch.Generator().manual_seed(0))
    grids = ((1, 3, 11), (1, 16, 4), (1, 8, 8))
    plan = encoder_plan(grids, 16, 10000.0, side)
    rows = (table[plan.pos_indices] * plan.pos_weights[:, :, None]).sum(1)
    image = table.T.reshape(1, dim, side, side)
    want = [
        F.interpolate(image, size=(h, w), mode="bilinear", align_corners=False)[0].flatten(1).T for _, h, w in grids
    ]
    torch.testing.assert_close(rows, torch.cat(want), rtol=1e-5, atol=1e-5)  # a wrong tap is off by ~0.1


def test_positions_equal_transformers_rope_index() -> None:
    hf, _ = hf_model(PADDLEOCR_VL)
    engine = exact_engine(PADDLEOCR_VL)
    for conversation in (TWO_IMAGES, PADDLEOCR_VL.conversations[4]):  # two images; a wide one
        inputs = hf_inputs(conversation)
        want, delta = hf.model.get_rope_index(
            inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs["image_grid_thw"]
        )
        prompt = engine.process_messages(conversation)
        assert prompt.positions.tolist() == want[:, 0].tolist()
        assert prompt.position_delta == int(delta[0, 0])


@pytest.mark.slow
def test_chunked_prefill_cutting_through_an_image_equals_transformers() -> None:
    """16-token prefill chunks: two chunk boundaries fall inside the image's 35 placeholders."""
    conversation = user(make_image(200, 150, 8), "Read it.")
    engine = Engine(
        str(PADDLEOCR_VL.path), dtype="float32", numerics="exact", max_num_batched_tokens=16, kv_cache_tokens=512
    )
    (span,) = engine.process_messages(conversation).media_spans
    assert span.offset < 16 and span.end > 32
    out = engine.chat([conversation], PADDLEOCR_VL.greedy)[0]
    assert out.token_ids == hf_greedy(hf_model(PADDLEOCR_VL), conversation, PADDLEOCR_VL.max_tokens)


@pytest.mark.slow
def test_a_flat_config_with_its_own_lm_head_is_served_untied(tmp_path: Path) -> None:
    """The released config.json's flat form (text values at the top, `tie_word_embeddings: false`), which
    Transformers reads as tied, beside a file that stores its own lm_head: untied, as Transformers loads it."""
    from transformers import AutoModelForImageTextToText, AutoProcessor

    checkpoint = tmp_path / "flat"
    shutil.copytree(PADDLEOCR_VL.path, checkpoint)
    nested = json.loads((checkpoint / "config.json").read_text())
    text = nested.pop("text_config")
    for key in ("model_type", "architectures", "dtype", "tie_word_embeddings"):
        text.pop(key, None)
    nested["vision_config"]["model_type"] = "paddleocr_vl"
    (checkpoint / "config.json").write_text(json.dumps({**nested, **text, "tie_word_embeddings": False}))
    engine = Engine(str(checkpoint), dtype="float32", numerics="exact", kv_cache_tokens=512)
    assert engine.model.lm_head.weight is not engine.model.model.embed_tokens.weight
    hf = AutoModelForImageTextToText.from_pretrained(str(checkpoint), dtype=torch.float32).eval()
    conversation = PADDLEOCR_VL.conversations[1]
    want = hf_greedy((hf, AutoProcessor.from_pretrained(str(checkpoint))), conversation, PADDLEOCR_VL.max_tokens)
    assert engine.chat([conversation], PADDLEOCR_VL.greedy)[0].token_ids == want == references(PADDLEOCR_VL)[1]


def test_transformers_names_load_as_the_released_ones() -> None:
    from_file, from_hf = our_model("file"), our_model("transformers")
    ours = dict(from_hf.named_parameters())
    assert all(torch.equal(p, ours[n]) for n, p in from_file.named_parameters())


@pytest.mark.slow
def test_bf16_tower_stays_near_fp32() -> None:
    """bf16 takes the shared fast paths (patch GEMM, fused rotary, flash attention on the CPU)."""
    inputs = hf_inputs(TWO_IMAGES)
    grids = grids_of(inputs)
    pixels = list(inputs["pixel_values"].split([t * h * w for t, h, w in grids]))
    model = our_model()
    with torch.inference_mode():
        exact = torch.cat(model.encode_media(pixels, grids))
        fast = torch.cat(model.to(torch.bfloat16).encode_media(pixels, grids)).float()
    assert fast.dtype == torch.float32 and torch.isfinite(fast).all()
    cosine = F.cosine_similarity(fast, exact, dim=-1)
    assert cosine.min() > 0.99, cosine.min()


def test_biases_on_every_projection_are_refused() -> None:
    hf, _ = hf_model(PADDLEOCR_VL)
    config = copy.deepcopy(hf.config)
    config.text_config.use_bias = True
    with pytest.raises(ValueError, match="use_bias"), torch.device("meta"):
        registry.model_class(config)(config)
