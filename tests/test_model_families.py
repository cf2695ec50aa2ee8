"""The family shape: every registered architecture is served by one family module through the
protocol, and generic code names no family (import-linter checks the imports; this checks the text)."""

from __future__ import annotations

import importlib
import io
import re
import tokenize
from pathlib import Path

import pytest
import torch

from preprocess.family_prompts import FamilyPrompts
from vlm_engine.models import registry
from vlm_engine.models.family import ModelFamily, VLModel
from testkit.qwen_vl_checkpoints import cached_qwen2_5_vl, cached_qwen3_vl

ROOT = Path(__file__).resolve().parents[1]
GENERIC = ["preprocess", "vlm_engine/scheduler", "vlm_engine/runner", "vlm_engine/server", "vlm_engine/speculative",
           "vlm_engine/engine.py", "vlm_engine/batch", "vlm_engine/cli.py", "vlm_engine/inputs.py",
           "vlm_engine/ipc.py"]  # fmt: skip
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


# Family names as words of an identifier (comments may cite a model; code may not name one).
FAMILY_NAMES = re.compile(r"qwen|llama|placard|mrope|efficientnet|smollm|gemma|idefics|llava", re.IGNORECASE)
# server/apps.py serves the `apps/placard` web page, a client of the public API named after the demo, not the family.
WEB_APPS = ROOT / "vlm_engine/server/apps.py"


def _family_identifiers(source: str) -> list[tuple[int, str]]:
    tokens = tokenize.generate_tokens(io.StringIO(source).readline)
    return [(t.start[0], t.string) for t in tokens if t.type == tokenize.NAME and FAMILY_NAMES.search(t.string)]


def test_generic_code_has_no_family_identifier() -> None:
    found = [
        f"{path.relative_to(ROOT)}:{n}: {name}"
        for path in _generic_files()
        if path != WEB_APPS
        for n, name in _family_identifiers(path.read_text())
    ]
    assert not found, "\n".join(found)


def test_the_identifier_check_sees_family_code() -> None:
    old = "mrope = self.uses_mrope and request.prompt.mrope_positions is not None  # Qwen2-VL only\n"
    assert [name for _, name in _family_identifiers(old)] == ["mrope", "uses_mrope", "mrope_positions"]


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


TINY_VLMS = {
    "tiny_vlm": lambda d: d,
    "tiny-qwen2.5-vl": lambda _: cached_qwen2_5_vl("tiny"),
    "tiny-qwen3-vl": lambda _: cached_qwen3_vl("tiny"),
    "tiny-qwen3-vl-moe": lambda _: cached_qwen3_vl("tiny-moe"),
}


@pytest.mark.parametrize("spec", [*TINY_VLMS, registry.SMOLLM2_MODEL, registry.PLACARD_MODEL])
def test_built_models_and_prompts_implement_the_protocol(spec: str, tiny_vlm_dir: Path) -> None:
    source = registry.resolve_model(str(TINY_VLMS[spec](tiny_vlm_dir)) if spec in TINY_VLMS else spec)
    config = registry.load_config(source)
    with torch.device("meta"):
        model = registry.model_class(config)(config)
    assert isinstance(model, VLModel)
    layers, kv_heads, head_dim = model.kv_layout
    assert layers == len(model.model.layers) and kv_heads >= 1 and head_dim >= 1
    assert model.position_axes == (3 if spec in TINY_VLMS else 1)
    processor = registry.prompt_processor(source, config)
    assert isinstance(processor.family, FamilyPrompts)
    assert processor.vocab_size == model.vocab_size


def test_a_text_draft_of_an_mrope_target_runs_on_plain_positions(tiny_vlm_dir: Path, tmp_path: Path) -> None:
    """A prompt's positions are its family's: a draft model with another number of rotary axes (a
    Llama draft of Qwen2-VL) runs the prompt on plain 1-D positions, without the M-RoPE delta, and
    greedy output stays the target's own."""
    from tests.conftest import make_image
    from vlm_engine import Engine, SamplingParams
    from vlm_engine.models.family import text_config_of
    from testkit.drafts import write_random_llama

    config = registry.load_config(registry.resolve_model(str(tiny_vlm_dir)))
    draft = write_random_llama(tmp_path / "draft", vocab_size=int(text_config_of(config).vocab_size), seed=1)
    chat = [
        {
            "role": "user",
            "content": [{"type": "image", "image": make_image(64, 48, 3)}, {"type": "text", "text": "Hm?"}],
        }
    ]
    greedy = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    plain = Engine(str(tiny_vlm_dir), dtype="float32", kv_cache_tokens=2048)
    want = plain.chat([chat], greedy)[0].token_ids
    engine = Engine(
        str(tiny_vlm_dir), dtype="float32", kv_cache_tokens=2048, speculative=f"draft:{draft}",
        speculative_disable_batch_size=1000,
    )  # fmt: skip
    runner = engine.speculator.proposer.runner
    prepare, steps = runner.prepare_inputs, []

    def recorded(chunks):
        inputs = prepare(chunks)
        steps.append((inputs.positions, torch.cat([torch.arange(c.start, c.end) for c in chunks])))
        return inputs

    runner.prepare_inputs = recorded
    prompt = engine.process_messages(chat)
    assert prompt.position_axes == 3 and prompt.position_delta != 0  # the target's positions are M-RoPE's
    assert engine.generate([prompt], [greedy])[0].token_ids == want
    assert len(steps) > 1 and engine.speculator.stats.num_draft_tokens > 0
    for positions, plain_positions in steps:
        assert torch.equal(positions.cpu(), plain_positions)
