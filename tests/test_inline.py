"""Notebook views: Capture, AttentionRecord and CheckResult render inline with the report's own page, bounded in size.

The views in Chromium: tests/test_reports_browser.py (one browser per test session).
"""

from __future__ import annotations

import base64
import html as htmlmod
import re
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

from reports_helpers import stack_capture

import attnprobe
from attnprobe.probe import display
from attnprobe.reports import inline, to_html


def frames(view: str) -> list[str]:
    """The documents of the view's frames (data: URLs)."""
    urls = re.findall(r'<iframe [^>]*src="data:text/html;charset=utf-8;base64,([A-Za-z0-9+/=]+)"', view)
    return [base64.b64decode(u).decode("utf-8") for u in urls]


def without_timing(document: str) -> str:
    return re.sub(r"in [0-9.]+ s\.", "in _ s.", document)


def test_capture_and_record_views_are_the_report_itself(assert_no_hooks):
    cap = stack_capture(assert_no_hooks)
    (document,) = frames(cap._repr_html_())
    assert without_timing(document) == without_timing(to_html(cap))  # same page, script and style
    assert 'sandbox="allow-scripts"' in cap._repr_html_() and "attnprobe-note" not in cap._repr_html_()
    (one,) = frames(cap[1]._repr_html_())
    assert without_timing(one) == without_timing(to_html(attnprobe.Capture([cap[1]])))


def test_checks_view_is_the_reports_checks_table(assert_no_hooks):
    cap = stack_capture(assert_no_hooks)
    broken = attnprobe.Capture([replace(r, weights=r.weights * 1.5) for r in cap], cap.info)  # rows sum to 1.5
    result = attnprobe.check(broken)
    assert not result.ok
    (document,) = frames(result._repr_html_())
    assert '<section id="checks">' in document and "<script" not in document
    assert document.count('<tr class="sev-') == len(result.violations)
    assert htmlmod.escape(result.violations[0].message) in document


def test_views_are_bounded_and_point_to_the_full_report(assert_no_hooks, monkeypatch):
    cap = stack_capture(assert_no_hooks, layers=6, heads=3, length=40)
    full = len(cap._repr_html_())
    monkeypatch.setattr(inline, "MAX_BYTES", int(full * 0.75))
    view = cap._repr_html_()
    assert len(view) <= inline.MAX_BYTES
    assert "values rounded to bfloat16" in view and "to_html(cap, &quot;report.html&quot;)" in view
    monkeypatch.setattr(inline, "MAX_BYTES", 160_000)
    view = cap._repr_html_()
    assert len(view) <= inline.MAX_BYTES
    (document,) = frames(view)
    shown = int(re.search(r"showing the first (\d+) of 6 records", view).group(1))
    assert 1 <= shown < 6 and document.count('class="thumb') < 6 * 3 + 1
    monkeypatch.setattr(inline, "MAX_BYTES", 1_000)
    view = cap._repr_html_()
    assert frames(view) == [] and "too large to show here" in view and "to_html" in view


def test_nothing_drawable_and_no_renderer_fall_back_to_text(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, keep=["q"])
    view = cap._repr_html_()
    assert frames(view) == [] and "no record has weights or scores" in view
    display.set_html_renderer(None)
    try:
        assert cap._repr_html_() is None and cap[0]._repr_html_() is None  # notebooks then show the text repr
    finally:
        display.set_html_renderer(attnprobe._inline_html)


def test_probe_reaches_the_renderer_only_through_the_registered_hook():
    probe = Path(attnprobe.__file__).parent / "probe"
    for source in probe.glob("*.py"):
        assert not re.search(r"^\s*(from|import)\s+[.\w]*reports", source.read_text(), flags=re.M), source.name
    code = (
        "import sys, attnprobe\nassert 'attnprobe.reports' not in sys.modules and 'jinja2' not in sys.modules\n"
        "import torch\nattn = attnprobe.MultiHeadAttention(8, num_heads=2)\n"
        "out, cap = attnprobe.run(attn, torch.randn(1, 3, 8))\nassert cap._repr_html_().startswith('<iframe')\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
