"""LightOnOCR-1B-1025's config.json form (model type `mistral3`, architecture "LightOnOCRForConditionalGeneration",
as vLLM and llama.cpp's converter read it; testkit's bench-1b preset writes it): the registry serves it as
Transformers' LightOnOcr class, and the engine answers on it exactly as on the Transformers-saved form of the
same weights."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from testkit.mistral3_checkpoints import cached_mistral3, released_lightonocr_config
from tests.family_table import FAMILIES, exact_engine
from vlm_engine import Engine
from vlm_engine.models import registry
from vlm_engine.models.families.mistral3.model import LightOnOcrForConditionalGeneration

RELEASED_NAME = "LightOnOCRForConditionalGeneration"


def released_form(tmp_path: Path) -> Path:
    """The tiny LightOnOCR checkpoint's files with its config.json rewritten to the release's form."""
    saved = cached_mistral3("tiny-lightonocr")
    out = tmp_path / "released-form"
    out.mkdir()
    for item in saved.iterdir():
        if item.name != "config.json":
            (out / item.name).symlink_to(item)
    config = released_lightonocr_config(json.loads((saved / "config.json").read_text()), RELEASED_NAME)
    (out / "config.json").write_text(json.dumps(config))
    return out


def test_the_released_spelling_is_served_by_the_lightonocr_class(tmp_path: Path) -> None:
    config = registry.load_config(registry.resolve_model(str(released_form(tmp_path))))
    assert config.model_type == "mistral3" and config.architectures == [RELEASED_NAME]
    assert registry.served_architecture(config) == "LightOnOcrForConditionalGeneration"
    assert registry.model_class(config) is LightOnOcrForConditionalGeneration


@pytest.mark.slow
def test_the_released_form_answers_as_the_saved_one(tmp_path: Path) -> None:
    """The matrix's exact engine on the saved form (shared with it) against one on the released form: the same
    prompt ids and greedy tokens for one image and for two of odd sizes."""
    row = next(f for f in FAMILIES if f.name == "lightonocr")
    saved = exact_engine(row)
    released = Engine(
        str(released_form(tmp_path)), dtype="float32", kv_cache_tokens=row.kv_cache_tokens, numerics="exact"
    )
    conversations = row.conversations[1:3]
    for conversation in conversations:
        assert released.process_messages(conversation).token_ids == saved.process_messages(conversation).token_ids
    want = [o.token_ids for o in saved.chat(conversations, row.greedy)]
    assert all(want) and [o.token_ids for o in released.chat(conversations, row.greedy)] == want


def test_the_lightonocr_suite_sizes_kv_and_tells_vllm_the_image_size(tmp_path: Path) -> None:
    """The suite's servers get its 32,768 KV tokens; vLLM is told the workloads' image size (else it profiles its
    encoder with the processor's largest image at start-up)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import models
    import peers
    import side_by_side as SBS

    suite, row = SBS.SUITES["lightonocr"], models.MODELS["lightonocr-1b"]
    for side in ("ours", "vllm bf16"):
        spec = peers.side_spec(side, row, tmp_path, slots=8, kv_tokens=suite.kv_tokens)
        assert spec.kv_tokens == 32_768 and spec.model_dir == str(tmp_path) and spec.label == side
    vllm = peers.side_spec("vllm bf16", row, tmp_path, slots=8, kv_tokens=suite.kv_tokens)
    limit = json.loads(vllm.extra_args[vllm.extra_args.index("--limit-mm-per-prompt") + 1])
    assert limit["image"] == {"count": 1, "width": 640, "height": 480}
