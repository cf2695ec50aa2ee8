"""The family shape: every registered architecture is served by one family module through the
protocol, and generic code names no family (import-linter checks the imports; this checks the text)."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest
import torch

from preprocess.family_prompts import FamilyPrompts
from vlm_engine.models import registry
from vlm_engine.models.family import ModelFamily, VLModel

ROOT = Path(__file__).resolve().parents[1]
GENERIC = ["preprocess", "vlm_engine/scheduler", "vlm_engine/runner", "vlm_engine/server", "vlm_engine/speculative",
           "vlm_engine/engine.py", "vlm_engine/batch", "vlm_engine/cli.py"]  # fmt: skip
FAMILY_MODULES = sorted({module.rsplit(".", 1)[1] for module in registry.ARCHITECTURES.values()})
# What a family used to leak into generic code: its module, its position scheme's names, its tower.
FAMILY_WORDS = [rf"models[./]{name}\b" for name in FAMILY_MODULES] + [
    r"models import (\w+, )*(" + "|".join(FAMILY_MODULES) + r")\b",
    r"\bmrope\w*",
    r"\buses_mrope\b",
    r"\blabels_images\b",
    r"\bhead_dim_of\b",
    r"efficientnet",
]


def _generic_files() -> list[Path]:
    files: list[Path] = []
    for entry in GENERIC:
        path = ROOT / entry
        files += [path] if path.is_file() else sorted(path.rglob("*.py"))
    return files


def test_generic_code_names_no_family() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in _generic_files()
        for n, line in enumerate(path.read_text().splitlines(), 1)
        if any(re.search(word, line, re.IGNORECASE) for word in FAMILY_WORDS)
    ]
    assert not found, "\n".join(found)


def test_the_grep_would_see_a_family_import(tmp_path: Path) -> None:
    """The check above can fail: the lines the old generic code had match it."""
    leaked = ["from vlm_engine.models.qwen2_vl import mrope_positions", "from vlm_engine.models import placard"]
    assert all(any(re.search(word, line) for word in FAMILY_WORDS) for line in leaked)


@pytest.mark.parametrize("architecture", sorted(registry.ARCHITECTURES))
def test_each_architecture_has_one_family(architecture: str) -> None:
    family = registry.family_of_architecture(architecture)
    assert isinstance(family, ModelFamily)
    assert importlib.import_module(registry.ARCHITECTURES[architecture]).FAMILY is family
    module_name, _, class_name = family.model_classes[architecture].partition(":")
    cls = getattr(importlib.import_module(module_name), class_name)
    for method in ("embed", "forward", "compute_logits", "encode_media"):
        assert callable(getattr(cls, method)), (architecture, method)


def test_unknown_architecture_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="unsupported architecture 'NopeForCausalLM'"):
        registry.family_of_architecture("NopeForCausalLM")


@pytest.mark.parametrize("spec", ["tiny_vlm", registry.SMOLLM2_MODEL, registry.PLACARD_MODEL])
def test_built_models_and_prompts_implement_the_protocol(spec: str, tiny_vlm_dir: Path) -> None:
    source = registry.resolve_model(str(tiny_vlm_dir) if spec == "tiny_vlm" else spec)
    config = registry.load_config(source)
    with torch.device("meta"):
        model = registry.model_class(config)(config)
    assert isinstance(model, VLModel)
    layers, kv_heads, head_dim = model.kv_layout
    assert layers == len(model.model.layers) and kv_heads >= 1 and head_dim >= 1
    assert model.position_axes == (3 if spec == "tiny_vlm" else 1)
    processor = registry.prompt_processor(source, config)
    assert isinstance(processor.family, FamilyPrompts)
    assert processor.vocab_size == model.vocab_size
