"""Every script in examples/ runs, as a user would run it: a fresh Python process, in an empty folder."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"

# script, arguments, what its output must say, files it must write (glob patterns)
CASES = [
    ("padding_bug.py", [], ["error(s)", "padding", "with attention_mask passed on: ok"], []),
    ("invariant_test.py", [], ["2 passed"], []),
    ("generate_report.py", ["--out", "llama.html"], ["stitched: 2 records of (1, 4, 9, 9)", "wrote"], ["llama.html"]),
    (
        "generate_report.py",
        ["--model", "gpt2", "--out", "gpt2.html"],
        ["stitched: 2 records of (1, 4, 9, 9)"],
        ["gpt2.html"],
    ),
    (
        "long_context_stats.py",
        ["--tokens", "2048"],
        ["entropy of layer 0: shape (1, 4, 2048)", "checks on the statistics: ok"],
        [],
    ),
    ("scan_dataset.py", ["--out", "scan"], ["wrote 360 rows", "lowest-entropy heads"], ["scan/*.parquet"]),
]


def run_example(script: str, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONDONTWRITEBYTECODE": "1", "TOKENIZERS_PARALLELISM": "false"}
    return subprocess.run(
        [sys.executable, str(EXAMPLES / script), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300
    )


@pytest.mark.parametrize(
    ("script", "args", "says", "writes"), CASES, ids=[c[0] + ("-" + c[1][1] if c[1] else "") for c in CASES]
)
def test_example_runs(script, args, says, writes, tmp_path):
    done = run_example(script, args, tmp_path)
    assert done.returncode == 0, f"{script} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    for text in says:
        assert text in done.stdout, (text, done.stdout[-3000:])
    for pattern in writes:
        files = list(tmp_path.glob(pattern))
        assert files, (pattern, sorted(p.name for p in tmp_path.rglob("*")))
        if pattern.endswith(".html"):
            page = files[0].read_text(encoding="utf-8")
            assert page.startswith("<!doctype html>") and 'id="tokens"' in page


def test_every_example_is_run_by_these_tests():
    run = {c[0] for c in CASES} | {"test_attention_masks.py", "entropy_collapse.py"}
    assert {p.name for p in EXAMPLES.glob("*.py")} <= run


@pytest.mark.skipif(
    not (EXAMPLES / "entropy_collapse.py").exists(), reason="examples/entropy_collapse.py not written yet"
)
def test_entropy_collapse_example_runs(tmp_path):
    done = run_example("entropy_collapse.py", ["--steps", "20"], tmp_path)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert (tmp_path / "entropy_collapse.png").stat().st_size > 0
    pages = sorted(p.name for p in tmp_path.glob("entropy_collapse-lr*.html"))
    assert pages == ["entropy_collapse-lr0.001.html", "entropy_collapse-lr0.03.html"], pages
    page = (tmp_path / pages[0]).read_text(encoding="utf-8")
    assert page.startswith("<!doctype html>") and 'id="plot-entropy_min"' in page and 'id="alerts"' in page
