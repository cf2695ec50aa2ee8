"""Pre-quantized checkpoints made by the real quantization tools, offline, from tiny random checkpoints (issue 51).

The tools cannot install beside our pins (llm-compressor caps torch and Transformers below ours; GPTQModel's sdist
builds kernels), so each lives in a side venv of its own, built once and cached (`quant_venv`), and runs there as a
subprocess on a script of testkit/quant_maker_scripts/ (`cached_quantized`). What comes back is a checkpoint as a user
downloads one: llm-compressor's compressed-tensors with the published VLM recipes' scheme (`lm_head` and the vision
tower unquantized), or GPTQModel's native GPTQ / AWQ files plus, in `fp32-reference/`, the same weights dequantized
to fp32 by GPTQModel itself (our Transformers cannot read those formats without it).

    quant_venv(tool) -> Path                  # ~/.cache/vlm_engine/venvs/<tool>-<version>
    cached_quantized(base, recipe) -> Path    # <checkpoint cache>/<base name>-<recipe>-<tool><version>-...

Each checkpoint carries `quant_maker.json`: the recipe, the tool's versions, the making's CPU and wall seconds, and
the config fields rewritten so that our Transformers reads what the tool wrote as the base says (`_align_to_base`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from testkit.checkpoints import _file_lock, cached_checkpoint, default_cache_root

CPU_TORCH = "torch==2.13.0+cpu"  # on local disk; PyPI's default torch drags in the CUDA stack
MAKER_VERSION = 1  # bump when a recipe or a script changes the bytes written
SCRIPTS = Path(__file__).parent / "quant_maker_scripts"
COMPLETE = ".vlm_engine_complete"
REFERENCE = "fp32-reference"  # GPTQModel checkpoints: the subdirectory holding the weights it dequantized to fp32
# Module names as the published VLM recipes write them: the head and the whole vision tower stay in floating point.
VLM_IGNORE = ("lm_head", "re:visual.*", "re:model.visual.*")


@dataclass(frozen=True)
class SideTool:
    """A quantization tool in a venv of its own: what it installs, the script run there, the environment both get."""

    name: str
    version: str
    pins: tuple[str, ...]
    script: str
    env: tuple[tuple[str, str], ...] = ()


TOOLS = {
    # llm-compressor's own caps pick Transformers (5.17) and compressed-tensors (0.19).
    "llmcompressor": SideTool("llmcompressor", "0.14.0.1", ("llmcompressor==0.14.0.1", CPU_TORCH),
                              "llmcompressor_oneshot.py"),
    # An sdist: BUILD_CUDA_EXT=0 builds no CUDA kernel; its CPU thread pool wants two workers where it would size
    # itself at one on two cores.
    "gptqmodel": SideTool("gptqmodel", "7.6.0", ("gptqmodel==7.6.0", CPU_TORCH), "gptqmodel_quantize.py",
                          env=(("BUILD_CUDA_EXT", "0"), ("GPTQMODEL_CPU_WORKERS", "2"))),
}  # fmt: skip


@dataclass(frozen=True)
class Recipe:
    """One quantization: the tool, its algorithm and the scheme it writes."""

    algorithm: str  # "gptq" | "awq" (llm-compressor: AWQModifier smoothing, then QuantizationModifier)
    weight_bits: int
    group_size: int | None  # None: one scale per output channel
    symmetric: bool
    actorder: str | None = None  # "group": a g_idx stored (GPTQModel's desc_act); "weight": columns by Hessian only
    activation_bits: int | None = None  # dynamic per-token int activations (W8A8), None for weight-only
    observer: str = "minmax"
    dtype: str = "float32"  # the model's dtype while quantizing: scales and unquantized tensors are saved in it
    sequential_targets: tuple[str, ...] = ("Qwen2_5_VLDecoderLayer",)
    ignore: tuple[str, ...] = VLM_IGNORE  # llm-compressor's; GPTQModel quantizes the text decoder only
    tool: str = "llmcompressor"

    @property
    def quant_method(self) -> str:
        return "compressed-tensors" if self.tool == "llmcompressor" else self.algorithm

    @property
    def format(self) -> str:
        """The compressed-tensors format llm-compressor picks for the scheme; GPTQModel's packing."""
        if self.tool == "gptqmodel":
            return "gemm" if self.algorithm == "awq" else "gptq"
        return "int-quantized" if self.activation_bits else "pack-quantized"


RECIPES: dict[str, Recipe] = {
    "w4a16-gptq-g32": Recipe("gptq", 4, 32, symmetric=True),
    # Act-order "weight": columns quantized by decreasing Hessian diagonal, groups still contiguous columns, so no
    # g_idx is stored (llm-compressor 0.14 refuses "group", which stored one).
    "w4a16-gptq-g128-actorder": Recipe("gptq", 4, 128, symmetric=True, actorder="weight"),
    "w4a16-awq-asym-g32": Recipe("awq", 4, 32, symmetric=False),
    "w8a8-int8-dynamic": Recipe("gptq", 8, None, symmetric=True, activation_bits=8),
    # GPTQModel's native formats (what AutoGPTQ / AutoAWQ checkpoints on the hub hold): GPTQ with desc_act (g_idx),
    # GPTQ asymmetric (the v1 files' zero points stored minus one), and AWQ's GEMM packing, which GPTQModel's torch
    # kernel packs on a CPU only from a bf16 / fp16 model.
    "gptqmodel-gptq-g32-descact": Recipe("gptq", 4, 32, symmetric=True, actorder="group", tool="gptqmodel"),
    "gptqmodel-gptq-g64-asym": Recipe("gptq", 4, 64, symmetric=False, tool="gptqmodel"),
    "gptqmodel-awq-gemm-g32": Recipe("awq", 4, 32, symmetric=False, dtype="bfloat16", tool="gptqmodel"),
}


def venvs_root() -> Path:
    """$VLM_ENGINE_CACHE/venvs if set, else ~/.cache/vlm_engine/venvs (beside the checkpoint cache)."""
    return default_cache_root().parent / "venvs"


def quant_venv(tool: str = "llmcompressor") -> Path:
    """`TOOLS[tool]`'s venv, created and installed once (a lock keeps parallel test workers from racing); its
    `pip freeze` is kept in `pip-freeze.txt` and the seconds it took in `build.json`. A venv cannot be moved
    (its scripts name their own path), so it is built in place and counts as built only once marked."""
    side = TOOLS[tool]
    venv = venvs_root() / f"{side.name}-{side.version}"
    if (venv / COMPLETE).exists():
        return venv
    venv.parent.mkdir(parents=True, exist_ok=True)
    with _file_lock(venv.parent / f".{venv.name}.lock"):
        if (venv / COMPLETE).exists():
            return venv
        start = time.monotonic()
        subprocess.run([sys.executable, "-m", "venv", "--clear", str(venv)], check=True)
        python, env = str(venv / "bin" / "python"), {**os.environ, **dict(side.env)}
        subprocess.run([python, "-m", "pip", "install", "-q", *side.pins], check=True, env=env)
        freeze = subprocess.run([python, "-m", "pip", "freeze"], check=True, capture_output=True, text=True).stdout
        (venv / "pip-freeze.txt").write_text(freeze)
        (venv / "build.json").write_text(json.dumps({"pins": side.pins, "seconds": time.monotonic() - start}))
        (venv / COMPLETE).write_text(" ".join(side.pins) + "\n")
    return venv


def cached_quantized(base: Path, recipe: str) -> Path:
    """`base` quantized with `RECIPES[recipe]` by its tool, made once and cached beside the checkpoints."""
    spec = RECIPES[recipe]
    side = TOOLS[spec.tool]
    name = f"{Path(base).name}-{recipe}-{side.name}{side.version}-m{MAKER_VERSION}"
    return cached_checkpoint(name, lambda tmp: make_quantized(Path(base), spec, tmp))


def make_quantized(base: Path, recipe: Recipe, out: Path) -> Path:
    """Run the tool's script in its venv on `base` into `out`, then align what Transformers versions disagree on."""
    side = TOOLS[recipe.tool]
    python, script = quant_venv(recipe.tool) / "bin" / "python", SCRIPTS / side.script
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           **dict(side.env)}  # fmt: skip
    args = json.dumps({**dataclasses.asdict(recipe), "reference": REFERENCE})
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic()
    with tempfile.TemporaryDirectory() as scratch:  # GPTQModel writes a logs/ folder where it runs
        run = subprocess.run([str(python), str(script), str(base), str(out), args],
                             check=False, env=env, capture_output=True, text=True, cwd=scratch)  # fmt: skip
    if run.returncode != 0:  # the tool's own traceback says what it refused
        raise RuntimeError(f"{side.name} {recipe} failed ({run.returncode}):\n{run.stderr[-4000:]}")
    after, wall = resource.getrusage(resource.RUSAGE_CHILDREN), time.monotonic() - start
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    tools = json.loads((out / "tool_versions.json").read_text())
    (out / "tool_versions.json").unlink()
    record = {"recipe": dataclasses.asdict(recipe), "tools": tools, "cpu_seconds": round(cpu, 1),
              "wall_seconds": round(wall, 1), "rewritten": _align_to_base(base, out)}  # fmt: skip
    if (out / REFERENCE).is_dir():  # the tool's fp32 twin: the aligned config, unquantized
        config = {**json.loads((out / "config.json").read_text()), "dtype": "float32"}
        del config["quantization_config"]
        (out / REFERENCE / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    (out / "quant_maker.json").write_text(json.dumps(record, indent=2) + "\n")
    return out


def reference_dir(checkpoint: Path, recipe: str) -> Path | None:
    """Where a GPTQModel checkpoint keeps its weights dequantized to fp32 by the tool (None for llm-compressor's:
    our Transformers dequantizes compressed-tensors itself)."""
    return Path(checkpoint) / REFERENCE if RECIPES[recipe].tool == "gptqmodel" else None


# Written by the quantizer, not read from the base: the scheme, which Transformers saved the file, and the dtype
# the model was quantized in (Recipe.dtype; at every level of the config).
_QUANTIZER_FIELDS = frozenset({"quantization_config", "transformers_version", "dtype"})


def _align(ours: dict[str, Any], theirs: dict[str, Any], where: str) -> list[str]:
    """Make `theirs` equal `ours` field by field, the quantizer's fields aside; the paths of those rewritten."""
    rewritten = []
    for key in sorted(set(ours) | set(theirs)):
        mine, other, path = ours.get(key), theirs.get(key), f"{where}.{key}"
        if key in _QUANTIZER_FIELDS or mine == other:
            continue
        if isinstance(mine, dict) and isinstance(other, dict):
            rewritten += _align(mine, other, path)
            continue
        rewritten.append(path)
        if key in ours:
            theirs[key] = mine
        else:
            del theirs[key]
    return rewritten


def _align_to_base(base: Path, out: Path) -> list[str]:
    """The side venv's older Transformers may save the config differently from ours. The model is the base's with
    its linears quantized, so every field but the quantizer's own must equal the base's: rewrite only the fields
    that differ (returned as "file.field.subfield" paths). The processor, tokenizer and template files are the
    base's as they are (the quantizer does not touch them; its script does not save them)."""
    rewritten: list[str] = []
    for name in ("config.json", "generation_config.json"):
        ours, theirs = json.loads((base / name).read_text()), json.loads((out / name).read_text())
        rewritten += _align(ours, theirs, name)
        (out / name).write_text(json.dumps(theirs, indent=2, sort_keys=True) + "\n")
    for source in base.iterdir():
        if _processor_file(source):
            shutil.copyfile(source, out / source.name)
    return rewritten


def _processor_file(path: Path) -> bool:
    """Tokenizer, template and processor files: not the weights (model*), the configs or the cache's markers."""
    skip = path.name.startswith((".", "model")) or path.name in ("config.json", "generation_config.json")
    return path.is_file() and not skip


def maker_record(checkpoint: Path) -> dict[str, Any]:
    """What `make_quantized` recorded: recipe, tool versions, CPU/wall seconds, rewritten config fields."""
    return json.loads((Path(checkpoint) / "quant_maker.json").read_text())
