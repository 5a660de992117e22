"""The tree shows the architecture: one room per role, no two modules with one basename, every package
installed, and the paths the docs once published still importable for one release (with a warning)."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest

from attnprobe.probe.moved import MOVED

ROOT = Path(__file__).resolve().parents[1]
NOT_PACKAGE = {"tests", "benchmarks", "docs", "examples", "build", "dist"}


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT)
        if rel.parts[0] in NOT_PACKAGE or any(p.startswith(".") for p in rel.parts):
            continue
        found[".".join(("attnprobe", *rel.with_suffix("").parts))] = path
    return found


def test_no_two_modules_share_a_basename():
    by_name: dict[str, list[str]] = defaultdict(list)
    for name, path in _modules().items():
        if path.name in ("__init__.py", "__main__.py") or name in MOVED:
            continue
        by_name[path.stem].append(name)
    assert {stem: names for stem, names in by_name.items() if len(names) > 1} == {}


def test_every_package_folder_is_installed():
    declared = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"])
    folders = {name.removesuffix(".__init__") for name, path in _modules().items() if path.name == "__init__.py"}
    assert folders == declared


@pytest.mark.parametrize("old", sorted(MOVED))
def test_a_published_path_that_moved_still_imports_with_a_warning(old):
    sys.modules.pop(old, None)  # the stand-in runs again; the module at the new path stays the one in use
    with pytest.warns(DeprecationWarning, match=f"{old} moved to {MOVED[old]}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(MOVED[old])
    assert (ROOT / Path(*old.split(".")[1:])).with_suffix(".py").read_text().count("\n") <= 6  # a stand-in only


def test_the_new_paths_import_without_a_warning():
    code = "; ".join(f"import {new}" for new in MOVED.values())
    subprocess.run([sys.executable, "-W", "error", "-c", code], check=True, cwd=ROOT.parent)
