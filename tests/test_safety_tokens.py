"""Bidirectional and invisible characters in tokens are shown escaped wherever a report draws a token."""

from __future__ import annotations

import torch

import attnprobe
from attnprobe.reports import heatmap, to_html
from attnprobe.reports._common import display_token

from reports_helpers import browser, hover_cell, open_report, stack_capture  # noqa: F401  (browser fixtures)

# "\u202eevil" is drawn "live" by a bidi-aware renderer; the others draw nothing at all
TRICKY = ["\u202eevil", "a\u200bb", "\u2066x\u2069", "\u3164", "e\ufe0f", "\u200f", "plain", "tab\there"]
ESCAPED = ["\\u202eevil", "a\\u200bb", "\\u2066x\\u2069", "\\u3164", "e\\ufe0f", "\\u200f", "plain", "tab\\there"]


def test_display_token_escapes_bidi_and_invisible_characters():
    assert [display_token(t) for t in TRICKY] == ESCAPED
    assert display_token("\U000e0100") == "\\U000e0100" and display_token("é 日本 ▁the Ġx") == "é 日本 ▁the Ġx"
    assert display_token("\x00\x7f") == "\\x00\\x7f"


def test_png_tick_labels_are_escaped():
    from matplotlib.figure import Figure

    attn = attnprobe.MultiHeadAttention(8, num_heads=1)
    with attnprobe.capture(attn) as cap:
        attn(torch.randn(1, len(TRICKY), 8))
    ax = heatmap(cap[0], ax=Figure().add_subplot(), tokens=TRICKY)
    assert [t.get_text() for t in ax.get_xticklabels()] == ESCAPED
    assert [t.get_text() for t in ax.get_yticklabels()] == ESCAPED


def test_html_labels_readout_and_token_list_are_escaped(tmp_path, browser, assert_no_hooks):  # noqa: F811
    cap = stack_capture(assert_no_hooks, layers=1, heads=2, length=len(TRICKY), batch=1, padded=False)
    path = to_html(cap, tmp_path / "tricky.html", tokens=TRICKY)
    text = path.read_text(encoding="utf-8")
    assert not any(ch in text for ch in "\u202e\u200b\u2066\u2069\u3164\ufe0f\u200f")  # nowhere in the file
    page = browser.new_page()
    try:
        # record every label the canvases draw
        page.add_init_script("""(() => {
            window.__drawn = [];
            const fill = CanvasRenderingContext2D.prototype.fillText;
            CanvasRenderingContext2D.prototype.fillText = function (t, ...rest) {
                window.__drawn.push(String(t)); return fill.call(this, t, ...rest); };
        })()""")
        page.goto(path.resolve().as_uri() + "#head-0-1")
        page.evaluate("window.attnprobe.ready")
        page.wait_for_function("() => window.attnprobe.state().head === 1")
        page.wait_for_function("() => window.__drawn.length > 0")
        drawn = set(page.evaluate("window.__drawn"))
        assert {e for e in ESCAPED} <= drawn, drawn
        assert not any(ch in t for t in drawn for ch in "\u202e\u200b\u2066\u3164\ufe0f\u200f")
        shown = page.evaluate("Array.from(document.querySelectorAll('.tokenlist .tok')).map(e => e.textContent)")
        assert shown == ESCAPED
        for q in range(len(TRICKY)):
            readout = hover_cell(page, q, 0)
            assert readout["q"] == f'"{ESCAPED[q]}"' and readout["k"] == f'"{ESCAPED[0]}"'
    finally:
        page.close()
