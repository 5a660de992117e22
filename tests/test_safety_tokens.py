"""Bidirectional and invisible characters in tokens are shown escaped wherever a report draws a token."""

from __future__ import annotations

import torch

import attnprobe
from attnprobe.reports import heatmap
from attnprobe.reports._common import display_token

# "\u202eevil" is drawn "live" by a bidi-aware renderer; the others draw nothing at all (the HTML report's
# labels, readout and token list: tests/test_reports_browser.py, which owns the browser)
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
