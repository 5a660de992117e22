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
STARTED: dict[str, set[int]] = {}  # file -> the lines of the blocks already started in this process

CASES = [(path.relative_to(ROOT).as_posix(), line, code) for path in pages() for line, code in python_blocks(path)]


# pytest-xdist: the blocks of one page go to one worker, in order (with --dist loadgroup)
@pytest.mark.parametrize(
    "page, line, code",
    [
        pytest.param(*case, id=f"{case[0]}:{case[1]}", marks=pytest.mark.xdist_group(f"readme {case[0]}"))
        for case in CASES
    ],
)
def test_python_block_runs(page, line, code, tmp_path_factory, monkeypatch):
    folder = tmp_path_factory.getbasetemp() / ("readme" if page == "README.md" else page.replace("/", "-"))
    folder.mkdir(exist_ok=True)
    monkeypatch.chdir(folder)
    namespace = NAMESPACES.setdefault(page, {"__name__": "__readme__"})
    started = STARTED.setdefault(page, set())
    # the earlier blocks this one builds on, where this process has not run them (a block selected alone with -k,
    # or a page split between workers): run first, once, as the reader would have
    for earlier, earlier_code in ((n, c) for p, n, c in CASES if p == page and n < line and n not in started):
        started.add(earlier)
        exec(compile(earlier_code, f"{page}:{earlier}", "exec"), namespace)
    started.add(line)
    exec(compile(code, f"{page}:{line}", "exec"), namespace)
