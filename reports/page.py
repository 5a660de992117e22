"""What a page shows, decided once: the one road every HTML page of reports/ takes.

A page is planned by one of three functions, each returning a ``PagePlan``: ``plan_page`` (the report of one
capture: the HTML report, or the long-input report of a statistics-only capture), ``plan_diff`` (two captures side
by side) and ``plan_view`` (the notebook view, under a byte bound). A plan says which records are drawn (generation
steps stitched), which batch rows, which values (precision, masked scores) and that they fit the budget; the
refusals (a batch row that does not exist, a page past ``max_values``) are raised here, before any work.
``reports.html.page_data`` then builds the page's data from the plan in one place, and ``reports.html.render_plan``
(the report, the long-input report, the notebook view) or ``reports.diff.diff_html`` renders it in one pass.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ..probe.capture import Capture
from ..probe.checks.violations import CheckResult
from ..probe.errors import AttnprobeError
from ..probe.outputs.image_tokens import ImageTokens, capture_image_tokens
from ..probe.record import AttentionRecord
from . import encoding
from ._common import check_batch
from .image_section import cells_per_record
from .long import stats_only

#: Refuse reports that would hold more matrix values than this (about 4 bytes each, exact precision).
MAX_VALUES = 80_000_000
#: A report shows every batch row up to this many (with a selector); pass ``batch=`` for the others.
MAX_BATCH_ROWS = 8

#: The page layouts: the HTML report, the long-input report (statistics, no (query x key) matrix), a comparison.
LAYOUTS = ("report", "long", "diff")


@dataclass(frozen=True)
class PagePlan:
    """What one page shows. ``sources``: per capture (two for a diff), the records drawn, matched one to one;
    ``rows``: the batch rows shown, the first one the page's own (the others behind a selector)."""

    layout: str  # one of LAYOUTS
    capture: Capture  # the capture reported (the first of a diff); its ``info`` describes the model
    sources: tuple[list[AttentionRecord], ...]
    rows: list[int]
    batch_size: int  # rows the input has
    precision: str  # "exact" or "bfloat16"
    masked_scores: bool = False  # scores of cells the query may not attend are kept (else NaN on the page)
    undrawn: list[AttentionRecord] = field(default_factory=list)  # records with neither weights nor scores
    stitched: int = 0  # generation runs stitched into one matrix per module
    tokens: Any = None
    key_tokens: Any = None
    checks: CheckResult | bool | None = True  # True: run attnprobe.check on ``capture``; False/None: no panel
    image: Any = None  # the pictures of the Image section (to_html(image=)); None: no such section
    image_tokens: ImageTokens | None = None  # where they are in the records (the capture's, or image_grid=)

    @property
    def records(self) -> list[AttentionRecord]:
        """The records drawn (of the first capture, for a diff)."""
        return self.sources[0]

    def first(self, count: int) -> PagePlan:
        """The same page showing only the first ``count`` records (a notebook view that came out too large)."""
        kept = self.records[:count]
        return replace(self, capture=Capture(kept, self.capture.info), sources=(kept,))


def check_precision(precision: str) -> None:
    if precision not in encoding.PRECISIONS:
        raise AttnprobeError(f"precision must be one of {encoding.PRECISIONS}, got {precision!r}")


def shown_records(capture) -> tuple[list[AttentionRecord], list[AttentionRecord], int]:
    """(records drawn, records without weights or scores, number of generation runs stitched).

    Records of a generation (with ``step``) are stitched into one matrix per module and run; steps
    selected out of a run are drawn as they are.
    """
    if not isinstance(capture, Capture):
        raise TypeError(
            f"expected an attnprobe.Capture (from `with attnprobe.capture(model) as cap`), got {type(capture).__name__}"
        )
    records = list(capture)
    stitched_runs = 0
    if any(r.step is not None for r in records):
        from ..probe.outputs.generation import shown

        records, stitched_runs = shown(records)
    drawable = [r for r in records if r.weights is not None or r.scores is not None]
    if not drawable:
        raise AttnprobeError(
            "nothing to report: no record has weights or scores. Capture with keep=None (everything) or "
            "keep=['scores', 'weights']" + (" (this capture is empty)" if not records else "")
        )
    return drawable, [r for r in records if r.weights is None and r.scores is None], stitched_runs


def matrix_values(record: AttentionRecord) -> int:
    """Weights and scores one batch row of ``record`` puts on the page."""
    per_head = (record.query_len or 0) * (record.key_len or 0)
    return per_head * len(record.heads) * ((record.weights is not None) + (record.scores is not None))


def values_per_row(sources: Sequence[list[AttentionRecord]]) -> int:
    """Weights and scores one batch row puts on the page."""
    return sum(matrix_values(r) for rows in sources for r in rows)


def estimate_view_bytes(records: list[AttentionRecord], precision: str) -> int:
    """Bytes of a notebook view of ``records`` (one batch row) at most: values base64-encoded twice before
    compression, and the page's own weight."""
    per_value = 4 if precision == "exact" else 2
    return (80_000 + sum(matrix_values(r) for r in records) * per_value * 4 // 3 + 2_000 * len(records)) * 4 // 3


def describe_record(r: AttentionRecord) -> str:
    return (
        f"layer {r.layer} call {r.call} {r.name!r} "
        f"({r.kind}, heads {list(r.heads)}, {r.batch_size}x{r.query_len}x{r.key_len})"
    )


def match_records(before: list[AttentionRecord], after: list[AttentionRecord]) -> None:
    """Raise unless ``before`` and ``after`` hold the same attention calls in the same shapes."""
    if len(before) != len(after):
        raise AttnprobeError(
            f"the captures hold {len(before)} and {len(after)} drawable records; compare two captures of the same "
            "model and input with the same layer and head selection"
        )
    for a, b in zip(before, after):
        place = (a.layer, a.call, a.name, a.kind, a.heads, a.batch_size, a.query_len, a.key_len, a.query_offset)
        if place != (b.layer, b.call, b.name, b.kind, b.heads, b.batch_size, b.query_len, b.key_len, b.query_offset):
            raise AttnprobeError(
                f"the captures differ: {describe_record(a)} vs {describe_record(b)}; compare two captures of the same "
                "model and input with the same layer and head selection"
            )


def _batch_size(records: list[AttentionRecord]) -> int:
    return max((r.batch_size or 1) for r in records)


def _report_rows(records: list[AttentionRecord], batch, max_values: int | None) -> list[int]:
    """The batch rows a report shows. ``batch``: an int (that row), a list of rows, or None: every row up to
    ``MAX_BATCH_ROWS`` and as many as fit ``max_values`` (row 0 always), and that every record has (a VLM's vision
    tower attends one row per picture, its language model one per prompt)."""
    if batch is None:
        per_row = values_per_row([records]) or 1
        size = min((r.batch_size or 1) for r in records)
        fit = size if max_values is None else max(1, max_values // per_row)
        return list(range(min(size, MAX_BATCH_ROWS, fit)))
    if isinstance(batch, (list, tuple)):
        if not batch:
            raise AttnprobeError("batch=[] names no batch row; give rows, one row, or None for every row")
        return list(dict.fromkeys(batch))
    return [batch]


def _refuse_past_budget(
    sources: Sequence[list[AttentionRecord]], rows: list[int], max_values: int | None, *, extra: int = 0
) -> None:
    """Check the batch rows exist in every record, and the page's weights and scores (and ``extra`` values: the
    Image section's) fit ``max_values``."""
    for records in sources:
        for r in records:
            for b in rows:
                check_batch(r, b)
    values = values_per_row(sources) * len(rows) + extra
    if max_values is not None and values > max_values:
        several = f" ({len(rows)} batch rows)" if len(rows) > 1 else ""
        raise AttnprobeError(
            f"this report would hold {values:,} values{several} (~{values * 4 / 2**20:,.0f} MiB before compression), "
            f"more than max_values={max_values:,}. Report fewer layers or heads (cap.select(layers=..., heads=...))"
            + (", one batch row (batch=)" if len(rows) > 1 else "")
            + ", use precision='bfloat16', or raise max_values="
        )


def _plan_long(capture: Capture, batch, precision: str, checks) -> PagePlan:
    """The long-input report of a statistics-only capture: one batch row, every query row along the sequence."""
    if isinstance(batch, (list, tuple)):
        if len(batch) != 1:
            raise AttnprobeError(
                f"a statistics report (long input) shows one batch row; got batch={batch!r}: "
                "pass one row, e.g. batch=0 (--batch 0)"
            )
        batch = batch[0]
    row = batch or 0
    records = list(capture)
    sampled = [r for r in records if "stats_rows" in r.meta]
    if sampled:
        raise AttnprobeError(
            f"layer {sampled[0].layer} has the statistics of {len(sampled[0].meta['stats_rows'])} sampled query rows "
            f"of {sampled[0].query_len} (capture(stats_rows=)): the long-input report draws every row along the "
            "sequence. Capture without stats_rows= for the report; a monitor's history has its own page, "
            "attnprobe.reports.monitor_html(mon)"
        )
    for r in records:
        check_batch(r, row)
    return PagePlan(
        layout="long",
        capture=capture,
        sources=(records,),
        rows=[row],
        batch_size=_batch_size(records),
        precision=precision,
        checks=checks,
    )


def plan_page(
    capture,
    *,
    tokens=None,
    key_tokens=None,
    batch: int | list[int] | None = None,
    checks: CheckResult | bool | None = True,
    precision: str = "exact",
    masked_scores: bool = False,
    max_values: int | None = MAX_VALUES,
    image=None,
    image_grid=None,
) -> PagePlan:
    """The plan of ``reports.to_html(capture, ...)`` (the arguments are its own): the long-input layout for a
    statistics-only capture, else the report's, its batch rows as many as fit ``max_values`` (with the Image
    section's values when ``image`` is given)."""
    check_precision(precision)
    if stats_only(capture):  # a long input: statistics, pooled overviews and windows, no (query x key) matrix
        if image is not None:
            raise AttnprobeError(
                "a statistics capture holds no weights to draw on the picture: capture with keep=('weights',) for "
                "the Image section, or read attnprobe.image_mass(cap)"
            )
        return _plan_long(capture, batch, precision, checks)
    records, undrawn, stitched = shown_records(capture)
    image_tokens = _image_tokens(capture, image, image_grid)
    rows = _report_rows(records, batch, max_values)
    extra = 0 if image is None or image_tokens is None else cells_per_record(records, image_tokens)
    _refuse_past_budget([records], rows, max_values, extra=extra)
    return PagePlan(
        layout="report",
        capture=capture,
        sources=(records,),
        rows=rows,
        batch_size=_batch_size(records),
        precision=precision,
        masked_scores=masked_scores,
        undrawn=undrawn,
        stitched=stitched,
        tokens=tokens,
        key_tokens=key_tokens,
        checks=checks,
        image=image,
        image_tokens=image_tokens,
    )


def plan_diff(
    before,
    after,
    *,
    tokens=None,
    key_tokens=None,
    batch: int = 0,
    precision: str = "exact",
    masked_scores: bool = False,
    max_values: int | None = MAX_VALUES,
) -> PagePlan:
    """The plan of ``reports.diff_html(before, after, ...)``: the drawn records of both captures, matched one to
    one (the same attention calls in the same shapes), one batch row; no checks panel."""
    rows_a, undrawn, stitched = shown_records(before)
    rows_b, _, _ = shown_records(after)
    match_records(rows_a, rows_b)
    check_precision(precision)
    _refuse_past_budget((rows_a, rows_b), [batch], max_values)
    return PagePlan(
        layout="diff",
        capture=before,
        sources=(rows_a, rows_b),
        rows=[batch],
        batch_size=_batch_size(rows_a),
        precision=precision,
        masked_scores=masked_scores,
        undrawn=undrawn,
        stitched=stitched,
        tokens=tokens,
        key_tokens=key_tokens,
        checks=None,
    )


def _image_tokens(capture: Capture, image, image_grid) -> ImageTokens | None:
    """The image tokens a page uses: for the Image section (``image=``), and to label a vision tower's records by
    their patches; None when the capture holds none and none is given."""
    held = image is not None or image_grid is not None or "image_tokens" in capture.info
    return capture_image_tokens(capture, image_grid) if held else None


def plan_view(capture, *, max_bytes: int, image=None) -> tuple[PagePlan, int]:
    """The plan of a notebook view of ``capture`` under ``max_bytes`` (estimated: ``estimate_view_bytes``), and
    how many records the capture draws. Every batch row (as the report shows them) when they all fit exactly, else
    batch row 0; exact values when every record fits, else bfloat16; then as many records as fit, in order (none
    when even the first does not). The view's checks run over the records it shows. ``image``: the pictures of an
    Image section (``reports.view(cap, image=...)``)."""
    records, _, stitched = shown_records(capture)
    size = _batch_size(records)
    every_row = estimate_view_bytes(records, "exact") * min(size, MAX_BATCH_ROWS) <= max_bytes
    rows = list(range(min(size, MAX_BATCH_ROWS))) if every_row else [0]
    chosen, precision = records, "exact"
    for precision in encoding.PRECISIONS:
        chosen = list(records)
        while chosen and estimate_view_bytes(chosen, precision) > max_bytes:
            chosen.pop()
        if len(chosen) == len(records):
            break
    _refuse_past_budget([chosen], rows, None)
    plan = PagePlan(
        layout="report",
        capture=Capture(chosen, capture.info),
        sources=(chosen,),
        rows=rows,
        batch_size=size,
        precision=precision,
        stitched=stitched,
        image=image,
        image_tokens=_image_tokens(capture, image, None),
    )
    return plan, len(records)
