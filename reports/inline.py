"""Notebook views (``_repr_html_``) of captures, records and check results: the HTML report, inline.

A ``Capture`` or ``AttentionRecord`` shows the report page itself (``to_html``: the same script and style, its head
grid of thumbnails, a head's detail on click), inside a sandboxed frame so that neither the notebook's page nor the
report restyle or script each other, and with no network request. The view is bounded in bytes (``MAX_BYTES``):
past the bound its values are rounded to bfloat16, then only the first records are shown, and the view says so and
how to write the whole report (``attnprobe.reports.to_html(cap, "report.html")``). A ``CheckResult`` shows the
report's checks table.

attnprobe's ``__init__`` registers ``repr_html`` with ``probe.display`` (probe/ never imports reports/).
"""

from __future__ import annotations

import base64
import html
from typing import Any

from ..probe.capture import Capture
from ..probe.checks.violations import CheckResult
from ..probe.errors import AttnprobeError
from ..probe.record import AttentionRecord
from .html import MAX_BATCH_ROWS, checks_document, shown_records, to_html

#: The most bytes a notebook view holds; settable. The page travels base64-encoded in a data: URL (4/3 of its size),
#: which Chromium accepts up to 2 MiB.
MAX_BYTES = 2_000_000
#: Height of the frame, in CSS pixels.
FRAME_HEIGHT = 640

_FRAME_STYLE = "width:100%;border:1px solid #c8c8c8;border-radius:4px;background:#fff"
_NOTE_STYLE = "font:12px/1.4 system-ui,sans-serif;margin:0 0 4px;color:#444"


def repr_html(obj: Any) -> str:
    """The notebook HTML of a ``Capture``, ``AttentionRecord`` or ``CheckResult``."""
    if isinstance(obj, CheckResult):
        return checks_view(obj)
    if isinstance(obj, AttentionRecord):
        return capture_view(Capture([obj]), what="record")
    if isinstance(obj, Capture):
        return capture_view(obj)
    raise TypeError(f"no notebook view for {type(obj).__name__}")


def _values(record: AttentionRecord) -> int:
    per_head = (record.query_len or 0) * (record.key_len or 0)
    return per_head * len(record.heads) * ((record.weights is not None) + (record.scores is not None))


def _estimate(records: list[AttentionRecord], precision: str) -> int:
    """Bytes of the view of a report of ``records`` at most (values base64-encoded twice before compression)."""
    per_value = 4 if precision == "exact" else 2
    return (80_000 + sum(_values(r) for r in records) * per_value * 4 // 3 + 2_000 * len(records)) * 4 // 3


def _view_bytes(document: str) -> int:
    return (len(document.encode("utf-8")) + 2) // 3 * 4 + 300


def _frame(document: str, height: int, title: str) -> str:
    # a data: URL, not srcdoc: the report's links (#head-1-2) then resolve within the frame's own document
    url = "data:text/html;charset=utf-8;base64," + base64.b64encode(document.encode("utf-8")).decode("ascii")
    return (
        f'<iframe title="{html.escape(title)}" sandbox="allow-scripts" src="{url}" '
        f'style="{_FRAME_STYLE};height:{height}px"></iframe>'
    )


def _note(text: str) -> str:
    return f'<p class="attnprobe-note" style="{_NOTE_STYLE}">{text}</p>'


def capture_view(capture: Capture, *, what: str = "capture") -> str:
    """The report of ``capture`` in a frame, under ``MAX_BYTES`` (see the module docstring)."""
    full = (
        'attnprobe.reports.to_html(cap, "report.html")'
        if what == "capture"
        else 'attnprobe.reports.to_html(attnprobe.Capture([record]), "report.html")'
    )
    try:
        records, _, _ = shown_records(capture)
    except AttnprobeError as exc:
        return _note(html.escape(f"{capture!r}: {exc}"))
    # every batch row (as the report shows them) when they all fit exactly; else batch row 0, as before
    size = max(r.batch_size or 1 for r in records)
    batch = None if _estimate(records, "exact") * min(size, MAX_BATCH_ROWS) <= MAX_BYTES else 0
    chosen, precision = records, "exact"
    for precision in ("exact", "bfloat16"):
        chosen = list(records)
        while chosen and _estimate(chosen, precision) > MAX_BYTES:
            chosen.pop()
        if len(chosen) == len(records):
            break
    document = None
    while chosen:
        try:
            document = to_html(Capture(chosen, capture.info), precision=precision, max_values=None, batch=batch)
        except AttnprobeError as exc:
            return _note(html.escape(f"{capture!r}: {exc}"))
        if _view_bytes(document) <= MAX_BYTES or len(chosen) == 1:
            break
        chosen = chosen[: len(chosen) // 2]
    mb = f"{MAX_BYTES / 1e6:g} MB"
    if document is None or _view_bytes(document) > MAX_BYTES:
        return _note(
            html.escape(
                f"{capture!r}: even one record of it makes a report over {mb} (attnprobe.reports.inline.MAX_BYTES), "
                f"too large to show here; write the report to a file: {full}"
            )
        )
    parts = []
    if batch == 0 and size > 1:
        parts.append(f"batch row 0 of {size}")
    if len(chosen) < len(records):
        layers = sorted({r.layer for r in chosen})
        parts.append(f"showing the first {len(chosen)} of {len(records)} records (layers {layers[0]} to {layers[-1]})")
    if precision != "exact":
        parts.append("values rounded to bfloat16")
    note = ""
    if parts:
        note = _note(
            html.escape(
                f"attnprobe: {' and '.join(parts)} to keep this view under {mb}; the whole report, exact: {full}"
            )
        )
    return note + _frame(document, FRAME_HEIGHT, f"attnprobe {what}")


def checks_view(result: CheckResult) -> str:
    """The report's checks table for ``result`` (its style, no script), in a frame."""
    document = checks_document(result)
    if _view_bytes(document) > MAX_BYTES and len(result.violations) > 100:
        shown = CheckResult(result.violations[:100], result.checks, result.records, result.skipped, result.coverage)
        return _note(
            html.escape(
                f"{len(result.violations)} violations: the first 100 below; CheckResult.to_frame() has them all"
            )
        ) + checks_view(shown)
    rows = min(len(result.violations), 12)
    return _frame(document, 150 + 34 * rows + (40 if result.skipped else 0), "attnprobe checks")
