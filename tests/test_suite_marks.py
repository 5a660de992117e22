"""The slow-test list in conftest.py names tests that exist: a renamed test would silently join the default run."""

from __future__ import annotations

import ast
from pathlib import Path

from conftest import SLOW, SLOW_FILES

TESTS = Path(__file__).parent


def test_every_slow_entry_names_a_test_that_exists():
    for name in SLOW_FILES:
        assert (TESTS / name).is_file(), name
    for key in SLOW:
        file, function = key.split("::")
        tree = ast.parse((TESTS / file).read_text())
        names = {node.name for node in ast.walk(tree) if isinstance(node, ast.FunctionDef)}
        assert function in names, f"{key}: no such test (renamed? update SLOW in tests/conftest.py)"
