"""The package layering of pyproject.toml's [tool.importlinter] contracts, checked by import-linter.

A maintained tool, not a grep of our own: it follows every import (inside functions too) through
grimp's graph, so a lazy import that closes a circle or reaches up a layer fails here."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

from vlm_engine.models import registry

ROOT = Path(__file__).resolve().parents[1]
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"
FAMILIES = "vlm_engine.models.families"


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


def test_the_family_contracts_cover_exactly_the_registrys_families() -> None:
    """The family contracts name `vlm_engine.models.families` (by wildcard), so a new family joins them by
    being a package there: every family of `registry.ARCHITECTURES` must be one, and every package there
    a registered family (an unregistered one would be checked yet never served)."""
    families = {module.removeprefix(f"{FAMILIES}.") for module in registry.ARCHITECTURES.values()}
    assert all(module.startswith(f"{FAMILIES}.") for module in registry.ARCHITECTURES.values())
    packages = {p.parent.name for p in (ROOT / FAMILIES.replace(".", "/")).glob("*/__init__.py")}
    assert packages == families
    contracts = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]
    (independence,) = [c for c in contracts if c["type"] == "independence"]
    (generic,) = [c for c in contracts if c["name"].startswith("Generic code names no family")]
    assert independence["modules"] == [f"{FAMILIES}.*"]
    assert generic["forbidden_modules"] == [FAMILIES]


def test_a_family_importing_another_is_reported(tmp_path: Path) -> None:
    """The independence contract can fail: a family package that imports another one breaks it."""
    tree = tmp_path / "pkg" / "families"
    for name, body in (("alpha", "from pkg.families import beta\n"), ("beta", "")):
        (tree / name).mkdir(parents=True)
        (tree / name / "__init__.py").write_text(body)
    (tree / "__init__.py").write_text("")
    (tmp_path / "pkg" / "__init__.py").write_text("")
    config = tmp_path / "families.toml"
    config.write_text(
        '[tool.importlinter]\nroot_packages = ["pkg"]\n\n'
        '[[tool.importlinter.contracts]]\nname = "apart"\ntype = "independence"\nmodules = ["pkg.families.*"]\n'
    )
    command = [str(LINT_IMPORTS), "--no-cache", "--config", str(config)]
    result = subprocess.run(command, check=False, cwd=tmp_path, capture_output=True, text=True, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(tmp_path)})
    assert result.returncode != 0 and "pkg.families.alpha is not allowed to import pkg.families.beta" in result.stdout
