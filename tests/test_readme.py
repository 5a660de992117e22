"""The README and the docs show what works today: every ```python block in them runs as written.

A block preceded by the line ``<!-- readme-test: skip -->`` is left out (say why next to it).
The blocks of one file run in order in one shared namespace, like cells of a notebook, in a temporary
folder of that file's own; each file starts afresh.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"


def pages() -> list[Path]:
    """The README, then every page of docs/."""
    return [README, *sorted(DOCS.rglob("*.md"))]


def python_blocks(path: Path = README) -> list[tuple[int, str]]:
    text = path.read_text()
    blocks = []
    for m in re.finditer(r"```python\n(.*?)```", text, flags=re.S):
        before = text[: m.start()].rstrip().splitlines()
        if before and before[-1].strip() == "<!-- readme-test: skip -->":
            continue
        blocks.append((text[: m.start()].count("\n") + 1, m.group(1)))
    return blocks


NAMESPACES: dict[str, dict] = {}  # file -> the namespace its blocks share

CASES = [(path.relative_to(ROOT).as_posix(), line, code) for path in pages() for line, code in python_blocks(path)]


@pytest.mark.parametrize("page, line, code", CASES, ids=[f"{page}:{line}" for page, line, _ in CASES])
def test_python_block_runs(page, line, code, tmp_path_factory, monkeypatch):
    folder = tmp_path_factory.getbasetemp() / ("readme" if page == "README.md" else page.replace("/", "-"))
    folder.mkdir(exist_ok=True)
    monkeypatch.chdir(folder)
    namespace = NAMESPACES.setdefault(page, {"__name__": "__readme__"})
    exec(compile(code, f"{page}:{line}", "exec"), namespace)
