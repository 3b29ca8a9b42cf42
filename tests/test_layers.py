"""The package's layering holds, and the check that enforces it fails on a wrong import.

The contracts live in pyproject.toml ([tool.importlinter]): hsdp.engine < checkpoint | data | models <
tools < apps, and inside the engine mesh < collectives < hops < runtime < model < extensions. The
negative cases copy the package, add one import that breaks a layer, and expect ``lint-imports`` to fail
naming it: a check that cannot fail would enforce nothing.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = str(Path(sys.executable).with_name("lint-imports"))


def _lint(root: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(root)}
    return subprocess.run([LINT, "--no-cache"], cwd=root, env=env, capture_output=True, text=True, timeout=120)


def test_the_layers_hold() -> None:
    proc = _lint(ROOT)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "BROKEN" not in proc.stdout and "0 broken" in proc.stdout


@pytest.mark.parametrize(("module", "wrong", "contract"), [
    ("hsdp/engine/mesh.py", "hsdp.apps.train.config", "engine < libraries < tools < apps"),
    ("hsdp/checkpoint/save.py", "hsdp.tools.planner.plan", "engine < libraries < tools < apps"),
    ("hsdp/engine/runtime/unit.py", "hsdp.engine.model", "engine: mesh < collectives"),
])
def test_a_wrong_import_breaks_the_check(tmp_path: Path, module: str, wrong: str, contract: str) -> None:
    shutil.copytree(ROOT / "hsdp", tmp_path / "hsdp", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    target = tmp_path / module
    target.write_text(target.read_text() + f"\nimport {wrong}  # deliberately wrong\n")
    proc = _lint(tmp_path)
    assert proc.returncode != 0, proc.stdout
    broken = proc.stdout[proc.stdout.index("Broken contracts"):]
    assert contract in broken and wrong in broken, broken


def test_no_import_cycles() -> None:
    """No module reaches itself through its imports (TYPE_CHECKING imports included): every concept
    has a place in one direction of the layering."""
    graph = grimp.build_graph("hsdp", cache_dir=None)
    cycles = sorted({tuple(sorted((m, imp))) for m in graph.modules
                     for imp in graph.find_modules_directly_imported_by(m)
                     if graph.chain_exists(importer=imp, imported=m)})
    assert cycles == [], cycles
