"""The package layering of pyproject.toml's [tool.importlinter] contracts, checked by import-linter.

A maintained tool, not a grep of our own: it follows every import (inside functions too) through
grimp's graph, so a lazy import that closes a circle or reaches up a layer fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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
