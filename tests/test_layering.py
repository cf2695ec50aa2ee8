"""The package layering of pyproject.toml's [tool.importlinter] contracts, checked by import-linter.

A maintained tool, not a grep of our own: it follows every import (inside functions too) through
grimp's graph, so a lazy import that closes a circle or reaches up a layer fails here."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from vlm_engine.models import registry

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def _lint(*args: str) -> subprocess.CompletedProcess[str]:
    command = [str(LINT_IMPORTS), "--no-cache", *args]
    return subprocess.run(command, check=False, cwd=ROOT, capture_output=True, text=True, timeout=300)


def test_import_contracts_hold() -> None:
    result = _lint()
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]


def test_a_broken_layering_is_reported(tmp_path: Path) -> None:
    """The check can fail: the engine placed below the kernels it imports breaks a layers contract."""
    config = tmp_path / "inverted.toml"
    config.write_text(
        '[tool.importlinter]\nroot_packages = ["vlm_engine"]\n\n'
        '[[tool.importlinter.contracts]]\nname = "inverted"\ntype = "layers"\n'
        'layers = ["vlm_engine.kernels", "vlm_engine.engine"]\n'
    )
    result = _lint("--config", str(config))
    assert result.returncode != 0 and "vlm_engine.engine is not allowed to import vlm_engine.kernels" in result.stdout


def test_the_contracts_family_lists_are_the_registrys() -> None:
    """import-linter reads pyproject.toml as it is, so the family lists are written there; they must be
    `registry.ARCHITECTURES`' families, no more and no fewer (a new family joins both lists)."""
    families = sorted(set(registry.ARCHITECTURES.values()))
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (independence,) = [c for c in contracts if c["type"] == "independence"]
    (generic,) = [c for c in contracts if c["name"].startswith("Generic code names no family")]
    assert sorted(independence["modules"]) == families
    assert sorted(generic["forbidden_modules"]) == families
