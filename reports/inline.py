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
from .html import checks_document, render_plan
from .page import PagePlan, plan_view

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


class View:
    """A notebook view of a capture with pictures (``reports.view``): shown like the capture itself, plus the
    report's Image section."""

    def __init__(self, capture: Capture, image=None) -> None:
        self.capture, self.image = capture, image

    def _repr_html_(self) -> str:
        return capture_view(self.capture, image=self.image)


def view(capture: Capture, *, image=None) -> View:
    """The notebook view of ``capture`` (what a cell showing ``cap`` displays) with the Image section of the
    pictures ``image`` (one, or a list in the processor's order; the capture holds their image tokens:
    ``cap.image_tokens()``). A notebook displays the returned object."""
    if not isinstance(capture, Capture):
        raise TypeError(f"view() takes a Capture, got {type(capture).__name__}")
    return View(capture, image)


def capture_view(capture: Capture, *, what: str = "capture", image=None) -> str:
    """The report of ``capture`` in a frame, under ``MAX_BYTES`` (see the module docstring): planned once
    (``reports.page.plan_view``), rendered in one pass; only when the page comes out larger than estimated is it
    rendered again with half its records."""
    full = (
        'attnprobe.reports.to_html(cap, "report.html")'
        if what == "capture"
        else 'attnprobe.reports.to_html(attnprobe.Capture([record]), "report.html")'
    )
    try:
        plan, drawn = plan_view(capture, max_bytes=MAX_BYTES, image=image)
        shown = _document(plan)
    except AttnprobeError as exc:
        return _note(html.escape(f"{capture!r}: {exc}"))
    if shown is None:
        return _note(
            html.escape(
                f"{capture!r}: even one record of it makes a report over {MAX_BYTES / 1e6:g} MB "
                f"(attnprobe.reports.inline.MAX_BYTES), too large to show here; write the report to a file: {full}"
            )
        )
    document, plan = shown
    return _view_note(plan, drawn, full) + _frame(document, FRAME_HEIGHT, f"attnprobe {what}")


def _document(plan: PagePlan) -> tuple[str, PagePlan] | None:
    """The page of ``plan`` and the plan it shows, under ``MAX_BYTES``: the plan's estimate is an upper bound on
    the values' share only, so a page over the bound is rendered again with half its records (None: not even one
    record fits)."""
    while plan.records:
        document = "".join(render_plan(plan))
        if _view_bytes(document) <= MAX_BYTES:
            return document, plan
        if len(plan.records) == 1:
            return None
        plan = plan.first(len(plan.records) // 2)
    return None


def _view_note(plan: PagePlan, drawn: int, full: str) -> str:
    """The line above a view that does not show everything: which rows, records and precision it shows."""
    parts = []
    if plan.rows == [0] and plan.batch_size > 1:
        parts.append(f"batch row 0 of {plan.batch_size}")
    if len(plan.records) < drawn:
        layers = sorted({r.layer for r in plan.records})
        parts.append(f"showing the first {len(plan.records)} of {drawn} records (layers {layers[0]} to {layers[-1]})")
    if plan.precision != "exact":
        parts.append("values rounded to bfloat16")
    if not parts:
        return ""
    mb = f"{MAX_BYTES / 1e6:g} MB"
    return _note(
        html.escape(f"attnprobe: {' and '.join(parts)} to keep this view under {mb}; the whole report, exact: {full}")
    )


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
