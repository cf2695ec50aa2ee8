"""Generic code names no family (import-linter checks the imports; this checks the text), and a draft of
another position scheme runs on plain positions. The protocol itself is checked for every family by the
family matrix (tests/test_family_matrix.py)."""

from __future__ import annotations

import io
import re
import tokenize
from pathlib import Path

import torch

from vlm_engine.models import registry

ROOT = Path(__file__).resolve().parents[1]
GENERIC = ["preprocess", "vlm_engine/scheduler", "vlm_engine/runner", "vlm_engine/server", "vlm_engine/speculative",
           "vlm_engine/engine.py", "vlm_engine/batch", "vlm_engine/cli.py", "vlm_engine/inputs.py",
           "vlm_engine/ipc.py"]  # fmt: skip
FAMILY_MODULES = sorted({module.rsplit(".", 1)[1] for module in registry.ARCHITECTURES.values()})
# What a family used to leak into generic code: its module, its position scheme's names, its tower.
FAMILY_WORDS = [r"models[./]families\b", *(rf"models[./]{name}\b" for name in FAMILY_MODULES)] + [
    r"families import (\w+, )*(" + "|".join(FAMILY_MODULES) + r")\b",
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




def _name_word(name: str) -> str:
    """The leading word of an architecture, family or model name: Qwen2_5_VL... -> qwen, SmolLM2-135M -> smollm."""
    return re.match(r"[A-Za-z]+", name).group(0).lower()


# Family names as words of an identifier (comments may cite a model; code may not name one): every
# registered architecture's and family's, the embedded models', and the words of a family's parts.
FAMILY_NAME_WORDS = sorted(
    {_name_word(n) for n in [*registry.ARCHITECTURES, *FAMILY_MODULES, registry.SMOLLM2_MODEL, registry.PLACARD_MODEL]}
)
PART_WORDS = ["mrope", "efficientnet", "llava"]  # a position scheme, a tower, a family ported from
FAMILY_NAMES = re.compile("|".join([*FAMILY_NAME_WORDS, *PART_WORDS]), re.IGNORECASE)
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
    leaked = [
        "from vlm_engine.models.families.qwen2_vl import mrope_positions",
        "from vlm_engine.models.families import placard",
    ]
    assert all(any(re.search(word, line) for word in FAMILY_WORDS) for line in leaked)


def test_the_family_names_come_from_the_registry() -> None:
    """Each architecture's own name is an identifier the check would refuse."""
    assert all(FAMILY_NAMES.search(architecture) for architecture in registry.ARCHITECTURES)
    assert FAMILY_NAMES.search(registry.SMOLLM2_MODEL.replace("-", "_"))


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
