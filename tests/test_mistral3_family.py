"""Mistral 3 and LightOnOCR beyond the family matrix (tests/test_family_matrix.py), on the tiny checkpoints
(testkit/mistral3_checkpoints.py): the Pixtral tower and projector against Transformers' image features on
two odd images in one pass (Pixtral's [IMG_BREAK] / [IMG_END] rows being those tokens' embeddings), images
kept apart within one pass (the block-diagonal mask), LightOnOCR's odd patch rows left out of the merge,
the untied LM head of a config that names no top-level tie (Mistral-Small-3.1's), and the bf16 fast path
(our flash attention over the tower's image segments, fused decoder) against fp32 and bf16 exact."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.conftest import to_hf_messages
from tests.family_table import exact_engine, family, hf_model, meta_model
from tests.released_configs import MISTRAL_SMALL_3_1
from tests.test_fast_numerics import greedy_agreement
from vlm_engine import Engine, SamplingParams
from vlm_engine.models.vision_blocks import tower_flash_attention

ROWS = [pytest.param(family("mistral3"), id="mistral3"), pytest.param(family("lightonocr"), id="lightonocr")]
TWO_ODD_IMAGES = 2  # the conversation of the base set with two images of odd sizes


def hf_image_features(row: Any, conversation: list[dict[str, Any]]) -> tuple[torch.Tensor, ...]:
    """Transformers' projected image tokens for the conversation's images (one padded batch)."""
    model, processor = hf_model(row)
    messages, images = to_hf_messages(conversation)
    text = processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    inputs = processor(text=[text], images=images, return_tensors="pt")
    with torch.inference_mode():
        out = model.model.get_image_features(pixel_values=inputs["pixel_values"], image_sizes=inputs["image_sizes"])
    return tuple(out.pooler_output)


@pytest.mark.parametrize("row", ROWS)
def test_image_rows_equal_transformers_features(row: Any) -> None:
    engine = exact_engine(row)
    conversation = row.conversations[TWO_ODD_IMAGES]
    prompt = engine.process_messages(conversation)
    with torch.inference_mode():
        ours = engine.model.encode_media([m.pixel_values for m in prompt.media], [m.grid_thw for m in prompt.media])
        embed = hf_model(row)[0].get_input_embeddings()
        ids = torch.tensor(prompt.token_ids)
        image_id = int(engine.hf_config.image_token_id)
        want = hf_image_features(row, conversation)
        assert len(ours) == len(want) == 2
        for item, rows, features in zip(prompt.media, ours, want):
            span = ids[item.span.offset : item.span.end]
            is_image = span == image_id
            # Transformers attends over the padded batch as one sequence under a block mask, we within each
            # image: the sums run in other orders (features up to ~30; 2e-5 apart seen)
            torch.testing.assert_close(rows[is_image], features, rtol=1e-5, atol=1e-4)
            # Pixtral's layout: a break after each merged row, the end after the last; LightOnOCR: none
            patch_rows, _, break_id = item.grid_thw
            assert int((~is_image).sum()) == (patch_rows // 2 if break_id >= 0 else 0)
            assert torch.equal(rows[~is_image], embed(span[~is_image]))


@pytest.mark.parametrize("row", ROWS)
def test_one_image_through_the_tower_equals_transformers_bit_for_bit(row: Any) -> None:
    engine = exact_engine(row)
    image = engine.process_messages(row.conversations[1]).media[0].pixel_values
    tower = hf_model(row)[0].model.get_image_features.__self__
    hf_tower = getattr(tower, "vision_tower", None) or tower.vision_encoder
    with torch.inference_mode():
        want = hf_tower(image, image_sizes=[tuple(image.shape[-2:])]).last_hidden_state[0]
        assert torch.equal(engine.model.vision_tower([image]), want)


def test_an_earlier_feature_layer_is_transformers_hidden_state() -> None:
    """`vision_feature_layer` indexes the tower's hidden states as Transformers does (0: ln_pre's output)."""
    row = family("mistral3")
    engine = exact_engine(row)
    image = engine.process_messages(row.conversations[1]).media[0].pixel_values
    hf_tower = hf_model(row)[0].model.vision_tower
    with torch.inference_mode():
        states = hf_tower(image, image_sizes=[tuple(image.shape[-2:])], output_hidden_states=True).hidden_states
        for layer in (0, 1, -2):
            assert torch.equal(engine.model.vision_tower([image], (layer,)), states[layer][0])


def test_an_unknown_text_model_is_refused() -> None:
    """Ministral 3's text model (model_type "ministral3": its own attention scaling) is not Mistral's decoder."""
    from transformers import Mistral3Config

    text = {**MISTRAL_SMALL_3_1["text_config"], "model_type": "ministral3"}
    config = Mistral3Config(
        **{**MISTRAL_SMALL_3_1, "text_config": text}, architectures=["Mistral3ForConditionalGeneration"]
    )
    with pytest.raises(NotImplementedError, match="ministral3"):
        meta_model(config)


def test_lightonocr_images_have_odd_patch_rows() -> None:
    """LightOnOCR's processor sizes images to patch multiples, so a last odd row of patches is left out of
    the 2 x 2 merge (as torch's unfold leaves it): the matrix's images include such ones."""
    engine = exact_engine(family("lightonocr"))
    grids = [m.grid_thw for m in engine.process_messages(family("lightonocr").conversations[TWO_ODD_IMAGES]).media]
    assert any(rows % 2 or cols % 2 for rows, cols, _ in grids), grids


@pytest.mark.parametrize("row", ROWS)
def test_images_in_one_pass_are_kept_apart(row: Any) -> None:
    """Two images of different sizes in one tower pass give each the rows it gets alone."""
    engine = exact_engine(row)
    media = engine.process_messages(row.conversations[TWO_ODD_IMAGES]).media
    with torch.inference_mode():
        together = engine.model.encode_media([m.pixel_values for m in media], [m.grid_thw for m in media])
        alone = [engine.model.encode_media([m.pixel_values], [m.grid_thw])[0] for m in media]
    for both, one in zip(together, alone):
        torch.testing.assert_close(both, one)


def test_a_config_untied_in_its_text_part_keeps_its_own_lm_head() -> None:
    """Mistral-Small-3.1's config.json names no top-level tie (Mistral3Config's default: tied) while its text
    config is untied and the file stores the head: the head stays its own parameter."""
    from transformers import Mistral3Config

    config = Mistral3Config(**MISTRAL_SMALL_3_1, architectures=["Mistral3ForConditionalGeneration"])
    assert config.tie_word_embeddings and not config.text_config.tie_word_embeddings
    model = meta_model(config)
    assert model.lm_head.weight is not model.model.embed_tokens.weight


def test_bf16_fast_path(ops: object) -> None:
    """bf16 fast numerics: the tower's attention is our flash kernel over each image's segment (several images
    in one call, kept apart), its patch embedding a GEMM; image rows stay near fp32 exact's (bf16 rounding:
    torch's SDPA in bf16 is as far), and greedy tokens agree with bf16 exact for most of the run."""
    row = family("mistral3")
    fast = Engine(str(row.path), dtype="bfloat16", kv_cache_tokens=2048, numerics="fast")
    assert fast.runner.fused_ops is not None
    assert tower_flash_attention(torch.zeros(1, dtype=torch.bfloat16)) is not None
    media = exact_engine(row).process_messages(row.conversations[TWO_ODD_IMAGES]).media
    pixels, grids = [m.pixel_values for m in media], [m.grid_thw for m in media]
    with torch.inference_mode():
        want = exact_engine(row).model.encode_media(pixels, grids)
        together = fast.model.encode_media(pixels, grids)
        alone = [fast.model.encode_media([p], [g])[0] for p, g in zip(pixels, grids)]
    for w, both, one in zip(want, together, alone):
        assert ((both.float() - w).norm() / w.norm()).item() < 0.05  # 0.017 and 0.024 seen
        torch.testing.assert_close(both, one)
    exact = Engine(str(row.path), dtype="bfloat16", kv_cache_tokens=2048, numerics="exact")
    params = SamplingParams(max_tokens=row.max_tokens, temperature=0.0, ignore_eos=True)
    convs = row.conversations[1:3]
    outs = zip(fast.chat(convs, params), exact.chat(convs, params))
    agreed = [greedy_agreement(f.token_ids, e.token_ids) for f, e in outs]
    assert sum(agreed) >= len(convs) * row.max_tokens // 2, agreed
