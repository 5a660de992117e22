"""The README shows what works today: every ```python block in it runs as written.

A block preceded by the line ``<!-- readme-test: skip -->`` is left out (say why next to it).
Blocks run in order in one shared namespace, like cells of a notebook, in a temporary folder.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def python_blocks() -> list[tuple[int, str]]:
    text = README.read_text()
    blocks = []
    for m in re.finditer(r"```python\n(.*?)```", text, flags=re.S):
        before = text[: m.start()].rstrip().splitlines()
        if before and before[-1].strip() == "<!-- readme-test: skip -->":
            continue
        blocks.append((text[: m.start()].count("\n") + 1, m.group(1)))
    return blocks


NAMESPACE: dict = {"__name__": "__readme__"}


@pytest.mark.parametrize("line, code", python_blocks(), ids=lambda v: f"line{v}" if isinstance(v, int) else "")
def test_readme_python_block_runs(line, code, tmp_path_factory, monkeypatch):
    monkeypatch.chdir(tmp_path_factory.getbasetemp())
    exec(compile(code, f"README.md:{line}", "exec"), NAMESPACE)
