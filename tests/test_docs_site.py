"""The docs site (mkdocs.yml, docs/) and the README that points to it.

The README stays a first screen: at most 12 KB, with the fenced blocks .ci/run reads after its
``<!-- ci:NAME -->`` markers. Every page is in the site's navigation, every link from the README to docs/
leads somewhere, and ``mkdocs build --strict`` (the docs extra) builds the site with no warning.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
CI_BLOCKS = ("make", "install", "first-run", "test")  # what .ci/run reads from the README


def ci_block(text: str, name: str) -> str | None:
    """The first fenced block after the line ``<!-- ci:NAME -->``, as .ci/run's awk reads it."""
    lines = text.splitlines()
    if f"<!-- ci:{name} -->" not in lines:
        return None
    rest = lines[lines.index(f"<!-- ci:{name} -->") + 1 :]
    start = next(i for i, line in enumerate(rest) if line.startswith("```"))
    end = next(i for i, line in enumerate(rest[start + 1 :], start + 1) if line.startswith("```"))
    return "\n".join(rest[start + 1 : end])


def test_readme_is_a_first_screen_with_the_blocks_ci_runs():
    text = README.read_text()
    assert len(text.encode()) <= 12 * 1024, f"README.md is {len(text.encode()):,} bytes: move sections to docs/"
    for name in CI_BLOCKS:
        assert ci_block(text, name), f"README.md has no <!-- ci:{name} --> block (.ci/run needs it)"
    assert "pip install" in ci_block(text, "install") and "attnprobe report" in ci_block(text, "first-run")


def test_readme_links_to_docs_lead_somewhere():
    text = README.read_text()
    targets = re.findall(r"\]\((docs/[^)#\s]+)", text)
    assert len(targets) >= 8 and "docs/images/report.png" in targets
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert missing == []


def test_every_page_is_in_the_navigation():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())

    def pages(nav) -> list[str]:
        out = []
        for item in nav:
            value = next(iter(item.values())) if isinstance(item, dict) else item
            out += pages(value) if isinstance(value, list) else [value]
        return out

    listed = pages(config["nav"])
    assert sorted(listed) == sorted(p.relative_to(DOCS).as_posix() for p in DOCS.rglob("*.md"))
    assert len(listed) == len(set(listed))


def test_readme_sections_the_docs_include_exist():
    readme = README.read_text()
    for page in DOCS.rglob("*.md"):
        for name in re.findall(r'^--8<-- "README\.md:([\w-]+)"$', page.read_text(), flags=re.M):
            assert f"--8<-- [start:{name}]" in readme and f"--8<-- [end:{name}]" in readme, (page, name)


def test_site_builds_strict(tmp_path):
    if shutil.which("mkdocs", path=str(Path(sys.executable).parent)) is None:
        pytest.skip('mkdocs is not installed: pip install -e ".[docs]" (CI builds the site in .ci/run)')
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stderr[-3000:]
    api = (tmp_path / "site" / "api" / "index.html").read_text()
    assert "Capture attention from" in api  # the API reference came from docstrings
    assert "test_attention_masks" in (tmp_path / "site" / "checks" / "index.html").read_text()  # README snippet
