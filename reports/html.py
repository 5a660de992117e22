"""One self-contained HTML file per capture: overview, head grid, per-head detail, summary, checks.

The document has no external script, style, font or image and makes no request: it opens from
``file://`` with the network off. Data travels as JSON (with ``<``, ``>`` and ``&`` escaped, so no
token can close the script element) and as compressed binary blobs (see ``encoding``); the page's
script sets token text with ``textContent`` or draws it on a canvas, never as markup, and a
Content-Security-Policy that allows only the report's own script (by hash) backs that up.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import json
import math
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from importlib import resources
from typing import Any

import numpy as np

from ..probe.capture import Capture
from ..probe.checks.violations import CheckResult, Violation, cause_groups
from ..probe.errors import AttnprobeError
from ..probe.files import atomic_open
from ..probe.outputs.tokens import token_rows
from ..probe.record import AttentionRecord
from ..probe.version import __version__
from . import encoding
from ._common import display_token, head_view, matrix_shape, output_path, record_labels
from .image_section import image_section
from .long import build_long_data
from .page import MAX_BATCH_ROWS, MAX_VALUES, PagePlan, plan_page


def _dtype_name(t) -> str | None:
    return None if t is None else str(t.dtype).replace("torch.", "")


def finite_or_none(x) -> float | None:
    x = float(x)
    return x if math.isfinite(x) else None


def page_number(x) -> float | int | None:
    """A summary or comparison value for the page: NaN and infinities kept (``script_json`` encodes them)."""
    if x is None:
        return None
    if isinstance(x, (int, np.integer)) and not isinstance(x, (bool, np.bool_)):
        return int(x)
    return float(x)


# ----------------------------------------------------------------------------------- data builder
@dataclass
class ReportData:
    """What the page script reads (``meta``, JSON) plus the binary blobs it decodes on demand."""

    meta: dict[str, Any]
    blobs: list[tuple[str, str]]
    token_lists: list[list[str]] = field(default_factory=list)


@dataclass
class PageData:
    """A planned page's data, built once (``page_data``): the page script's ``meta`` and ``blobs``, and what the
    template writes on the server (``context``: overview, tables, checks panel)."""

    meta: dict[str, Any]
    blobs: list[tuple[str, str]]
    context: dict[str, Any]


class _Tokens:
    """Deduplicated token lists referenced by index from the records, as ``display_token`` draws them:
    the page shows tokens only in that escaped form."""

    def __init__(self) -> None:
        self.lists: list[list[str]] = []
        self._index: dict[tuple[str, ...], int] = {}

    def ref(self, tokens: list[str] | None) -> int | None:
        if tokens is None:
            return None
        key = tuple(tokens)
        if key not in self._index:
            self._index[key] = len(self.lists)
            self.lists.append([display_token(t) for t in tokens])
        return self._index[key]


def build_data(plan: PagePlan) -> ReportData:
    """Encode the records of one capture (a report's plan) or of two matched captures (a diff's), for each batch
    row of the plan.

    Steps: per batch row, per record (a group of matched records), its facts (``_record_meta``), per source its
    encoded heads and their colour statistics (``_source_meta``), per head its thumbnail (``_Thumbnails``); then
    the page's meta: the first row's records, thumbnails and ``batch`` at the top, the other rows' in
    ``moreRows`` (same keys). Blobs are encoded lazily, in the order added.
    """
    diff = plan.layout == "diff"
    tok = _Tokens()
    blobs = encoding.Blobs()
    try:
        per_row = [_row_meta(plan, b, tok, blobs) for b in plan.rows]
        blob_list = blobs.results()
    except BaseException:
        blobs.close()
        raise
    meta = {
        **per_row[0],
        "tokens": tok.lists,
        "precision": plan.precision,
        "maskedScores": plan.masked_scores,
        "mode": "diff" if diff else "report",
        "moreRows": per_row[1:],
    }
    return ReportData(meta, blob_list, tok.lists)


def _row_meta(plan: PagePlan, batch: int, tok: _Tokens, blobs: encoding.Blobs) -> dict[str, Any]:
    """One batch row of the page: its records (as the page reads them) and its thumbnails."""
    thumbs = _Thumbnails(plan.layout == "diff")
    records_meta = []
    for rid, group in enumerate(zip(*plan.sources)):
        r = group[0]
        meta = _record_meta(rid, r, record_labels(r, batch, plan.tokens, plan.key_tokens, plan.image_tokens), tok)
        views = []  # per source, the head views of its record
        for rec in group:
            views.append([head_view(rec, h, batch) for h in r.heads])
            meta["sources"].append(_source_meta(rec, views[-1], blobs, plan.precision, plan.masked_scores))
        for i in range(len(r.heads)):
            meta["thumbs"].append(thumbs.add([vs[i] for vs in views]))
            meta["thumbShape"] = thumbs.shape
        records_meta.append(meta)
    return {
        "batch": batch,
        "records": records_meta,
        "thumbBlob": blobs.add(thumbs.encoded().tobytes),
        "thumbMax": thumbs.max,
    }


def _record_meta(rid: int, r: AttentionRecord, labels, tok: _Tokens) -> dict[str, Any]:
    """What the page knows of one record (or of a matched pair: ``r`` is the first): its place and shape."""
    return {
        "id": rid,
        "layer": r.layer,
        "call": r.call,
        "name": r.name,
        "kind": r.kind,
        "stitched": r.meta.get("stitched_steps"),
        "tq": r.query_len,
        "tk": r.key_len,
        "queryOffset": r.query_offset,
        "keyOffset": r.key_start,
        "heads": list(r.heads),
        "numHeads": r.num_heads,
        "numKvHeads": r.num_kv_heads,
        "qTokens": tok.ref(labels.query),
        "kTokens": tok.ref(labels.key),
        "sources": [],
        "thumbs": [],
    }


def _source_meta(
    rec: AttentionRecord, views: list, blobs: encoding.Blobs, precision: str, masked_scores: bool
) -> dict[str, Any]:
    """One capture's side of a record: how it ran, and per head its mask, weights and scores (as blob
    numbers) and colour statistics. Scores at masked positions are NaN unless ``masked_scores``."""
    src: dict[str, Any] = {
        "backend": rec.backend,
        "dtype": None if rec.dtype is None else str(rec.dtype).replace("torch.", ""),
        "storedDtype": _dtype_name(rec.weights if rec.weights is not None else rec.scores),
        "weightsSource": rec.weights_source,
        "causal": rec.causal,
        "scaling": rec.scaling,
        "maskKnown": views[0].mask_known,
        "padding": np.flatnonzero(views[0].query_padding).tolist(),
        "allowed": [blobs.add(functools.partial(encoding.packed_bits, v.allowed)) for v in views],
        "weights": None,
        "scores": None,
        "stats": [],
    }
    if rec.weights is not None:
        src["weights"] = [blobs.add(functools.partial(encoding.shuffled_floats, v.weights, precision)) for v in views]
    if rec.scores is not None:
        src["scores"] = []
        for v in views:
            s = v.scores if masked_scores else np.where(v.allowed, v.scores, np.float32(np.nan))
            src["scores"].append(blobs.add(functools.partial(encoding.shuffled_floats, s, precision)))
    src["stats"] = [_head_stats(v) for v in views]
    return src


def _head_stats(v) -> dict[str, Any]:
    """Colour ranges and counts of one head view, over its allowed cells."""
    w_ok = v.weights[v.allowed] if v.weights is not None else np.zeros(0)
    s_ok = v.scores[v.allowed] if v.scores is not None else np.zeros(0)
    s_ok = s_ok[np.isfinite(s_ok)]
    return {
        "wmax": finite_or_none(w_ok[np.isfinite(w_ok)].max()) if np.isfinite(w_ok).any() else None,
        # robust colour range: large weights of the first, forced rows do not wash out the rest
        "w99": finite_or_none(np.quantile(w_ok[np.isfinite(w_ok)], 0.99)) if np.isfinite(w_ok).any() else None,
        "smin": finite_or_none(s_ok.min()) if s_ok.size else None,
        "smax": finite_or_none(s_ok.max()) if s_ok.size else None,
        "leaks": int(v.leaks.sum()),
        "nonfinite": int((~np.isfinite(v.weights if v.weights is not None else v.scores) & v.allowed).sum()),
    }


class _Thumbnails:
    """The page's thumbnails, one per (record, head), concatenated into one float16 blob: the weights (or
    normalised scores) of the one capture; for a diff, |difference| of the two, whose largest value is ``max``."""

    def __init__(self, diff: bool) -> None:
        self.diff = diff
        self.parts: list[np.ndarray] = []
        self.size = 0
        self.max = 0.0
        self.shape: list[int] | None = None

    def add(self, views: list) -> int:
        """Draw the head of ``views`` (one per source); returns its offset in the blob."""
        t = self._diff_image(*views) if self.diff else self._image(views[0])
        offset = self.size
        self.parts.append(t.reshape(-1))
        self.size += t.size
        self.shape = list(t.shape)
        return offset

    def _image(self, v) -> np.ndarray:
        if v.weights is not None:
            return encoding.thumbnail(np.maximum(v.weights, 0), v.allowed, v.leaks)
        s = np.where(v.allowed & np.isfinite(v.scores), v.scores, np.nan)
        lo, hi = (np.nanmin(s), np.nanmax(s)) if np.isfinite(s).any() else (0.0, 1.0)
        return encoding.thumbnail((v.scores - lo) / ((hi - lo) or 1.0), v.allowed)

    def _diff_image(self, before, after) -> np.ndarray:
        image, allowed = _difference(before, after)
        # a value that became non-finite, or a cell allowed on one side only: the signal colour
        signal = (allowed & ~np.isfinite(image)) | (before.allowed != after.allowed)
        t = encoding.thumbnail(image, allowed, signal)
        shown = t[np.isfinite(t) & (t >= 0)]
        if shown.size:
            self.max = max(self.max, float(shown.max()))
        return t

    def encoded(self) -> np.ndarray:
        return np.concatenate(self.parts).astype("<f2") if self.parts else np.zeros(0, dtype="<f2")


def _difference(a, b) -> tuple[np.ndarray, np.ndarray]:
    """|after - before| of weights (scores when weights are missing), and where either is allowed."""
    if a.weights is not None and b.weights is not None:
        x, y = a.weights, b.weights
    elif a.scores is not None and b.scores is not None:
        x, y = a.scores, b.scores
    else:
        raise AttnprobeError(
            f"layer {a.record.layer} head {a.head}: the two captures share neither weights nor scores to compare"
        )
    allowed = a.allowed | b.allowed
    d = np.abs(y.astype(np.float64) - x.astype(np.float64))
    return np.where(np.isnan(d), np.inf, d), allowed


# ----------------------------------------------------------------------------------- checks panel
@dataclass(frozen=True)
class CheckRow:
    violation: Violation
    target: str | None  # "#head-<record id>-<head>" of its detail view
    other_batch: bool  # the violation is in another batch row than the one shown


def check_panel(
    checks: CheckResult | None, records_meta: list[dict], batch: int, shown: list[int] | None = None
) -> dict[str, Any]:
    """Rows of the checks table, and which (record id, head) are flagged (with the cells to mark in batch row
    ``batch``). ``shown``: every batch row the page shows (default: ``batch`` alone); a finding in one of them
    links to its head in that row (``#head-<record>-<head>-b<row>``), one in another row says so."""
    shown = [batch] if shown is None else shown
    if checks is None:
        return {"given": False, "rows": [], "flags": {}}
    if not isinstance(checks, CheckResult):
        raise TypeError(
            f"checks must be an attnprobe.CheckResult (from attnprobe.check(capture)), got {type(checks).__name__}"
        )
    by_call = {(m["layer"], m["call"]): m for m in records_meta}
    by_layer: dict[int, dict] = {}
    for meta in records_meta:
        by_layer.setdefault(meta["layer"], meta)
    rows: list[CheckRow] = []
    flags: dict[str, dict[str, Any]] = {}
    groups, rest = cause_groups(checks.violations)  # each cause, then the failures it explains
    for v in [v for cause, explained in groups for v in (cause, *explained)] + rest:
        m = None if v.layer is None else (by_call.get((v.layer, v.call)) or by_layer.get(v.layer))
        target = None
        if m is not None:
            heads = (
                [v.head] if v.head is not None and v.head in m["heads"] else ([] if v.head is not None else m["heads"])
            )
            for h in heads:
                key = f"{m['id']}-{h}"
                flag = flags.setdefault(key, {"errors": 0, "other": 0, "marks": []})
                flag["errors" if v.severity == "error" else "other"] += 1
                if v.batch in (None, batch):
                    flag["marks"].append({"check": v.check, "queries": list(v.queries), "keys": list(v.keys)})
            if heads:
                target = f"#head-{m['id']}-{heads[0]}"
                if len(shown) > 1 and v.batch in shown:
                    target += f"-b{v.batch}"
        rows.append(CheckRow(v, target, v.batch is not None and v.batch not in shown))
    return {"given": True, "result": checks, "rows": rows, "flags": flags}


# ----------------------------------------------------------------------------------- rendering
@functools.lru_cache(maxsize=1)
def _environment():
    import jinja2

    return jinja2.Environment(
        loader=jinja2.PackageLoader("attnprobe.reports", "templates"),
        autoescape=True,
        undefined=jinja2.StrictUndefined,
        trim_blocks=True,
        lstrip_blocks=True,
    )


@functools.cache
def _static(name: str) -> str:
    return resources.files("attnprobe.reports").joinpath("static", name).read_text(encoding="utf-8")


def strict_json_value(x: Any) -> Any:
    """``x`` with every non-finite float as ``{"$float": "NaN" | "Infinity" | "-Infinity"}``.

    Strict JSON has no NaN or infinity (``JSON.parse`` refuses Python's ``NaN`` token); the page's
    reviver turns these objects back into numbers, so an infinite difference reads "inf", not a blank.
    """
    if isinstance(x, float):
        if math.isfinite(x):
            return x
        return {"$float": "NaN" if math.isnan(x) else ("Infinity" if x > 0 else "-Infinity")}
    if isinstance(x, dict):
        return {k: strict_json_value(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [strict_json_value(v) for v in x]
    if isinstance(x, np.generic):
        return strict_json_value(x.item())
    return x


def script_json(data: Any) -> str:
    """Strict JSON safe inside a ``<script>`` element: ``<``, ``>`` and ``&`` escaped, ASCII only,
    non-finite floats encoded as ``{"$float": ...}`` (see ``strict_json_value``)."""
    text = json.dumps(strict_json_value(data), ensure_ascii=True, allow_nan=False, separators=(",", ":"))
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


def fmt(x, digits: int = 4) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "–"
    if isinstance(x, (bool, np.bool_)):
        return "yes" if x else "no"
    if isinstance(x, (int, np.integer)):
        return str(int(x))
    return f"{float(x):.{digits}g}"


def sort_value(x) -> str:
    """A table cell's sort key, readable by the page's ``Number()`` (``Infinity``, not Python's ``inf``)."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return ""
    if isinstance(x, (bool, np.bool_)):
        return "1" if x else "0"
    if isinstance(x, (float, np.floating)):
        x = float(x)
        return repr(x) if math.isfinite(x) else ("Infinity" if x > 0 else "-Infinity")
    return str(x)


def render(
    template: str,
    *,
    script_name: str = "report.js",
    page_scripts: tuple[str, ...] = (),
    data_images: bool = False,
    **context,
):
    """Render ``template`` with the page script (``static/<script_name>``), any further ``page_scripts`` (names in
    ``static/``, e.g. ``("monitor.js",)`` for a report's Monitor section) and the style inlined, and a CSP that pins
    each script by its own hash (no 'unsafe-inline', no eval). ``data_images``: the page embeds images as ``data:``
    URIs (the diff report's first divergence), which the CSP then allows (and no other image source).

    Returns an iterator of text chunks (a file is written without holding the whole document twice).
    """
    names = (script_name, *page_scripts)
    scripts = [_static(name) for name in names]
    for name, text in zip(names, scripts):
        if "</script" in text.lower() or "<!--" in text:
            raise AssertionError(f"the page script {name} must not contain '</script' or '<!--'")
    digests = [base64.b64encode(hashlib.sha256(text.encode("utf-8")).digest()).decode("ascii") for text in scripts]
    hashes = " ".join(f"'sha256-{digest}'" for digest in digests)
    csp = f"default-src 'none'; script-src {hashes}; style-src 'unsafe-inline'; base-uri 'none'; form-action 'none'"
    if data_images:
        csp += "; img-src data:"
    env = _environment()
    return env.get_template(template).generate(
        csp=csp,
        style=_static("report.css"),
        script=scripts[0],
        page_scripts=scripts[1:],
        fmt=fmt,
        sort_value=sort_value,
        display_token=display_token,
        version=__version__,
        **context,
    )


def checks_document(result: CheckResult) -> str:
    """A page with the report's checks table for ``result`` and the report's style (no script, no records)."""
    template = _environment().get_template("report.html.j2")
    context = template.new_context({"checks": check_panel(result, [], 0), "fmt": fmt, "sort_value": sort_value})
    body = "".join(template.blocks["checks"](context))
    return (
        '<!doctype html><html lang="en"><head><meta charset="utf-8">'
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">"
        f'<style>{_static("report.css")}</style></head><body data-mode="report"><main>{body}</main></body></html>'
    )


def write_or_return(chunks, path, overwrite: bool):
    """The document as one string when ``path`` is None; else write it there and return the path."""
    if path is None:
        return "".join(chunks)
    p = output_path(path, overwrite=overwrite)
    # complete or not at all: an interrupted or failed write leaves the old file (if any) as it was
    with atomic_open(p, "w", overwrite=overwrite, encoding="utf-8", errors="backslashreplace", newline="\n") as f:
        f.writelines(chunks)
    return p


def describe_info(info) -> list[tuple[str, str]]:
    """``capture.info`` as (label, text) pairs for the overview."""
    out = []
    names = {
        "model_class": "model",
        "adapters": "adapters",
        "attention_modules": "attention modules",
        "num_heads": "heads per module",
        "num_kv_heads": "key/value heads per module",
    }
    for key, label in names.items():
        if key in info:
            value = info[key]
            if isinstance(value, (tuple, list)):
                if key in ("num_heads", "num_kv_heads") and len(set(value)) == 1:
                    value = f"{value[0]} (all {len(value)} modules)"
                else:
                    value = ", ".join(str(x) if x != "" else "(model itself)" for x in value) or "–"
            out.append((label, str(value)))
    selection = info.get("selection")
    if isinstance(selection, dict):
        parts = []
        for k, v in selection.items():
            if v is None:
                v = "all" if k in ("layers", "heads") else "–"
            elif isinstance(v, (tuple, list)):
                v = ", ".join(map(str, v))
            parts.append(f"{k}: {v}")
        out.append(("capture selection", "; ".join(parts)))
    for key, value in info.items():
        if key not in names and key != "selection":
            out.append((str(key), str(value)))
    return out


def weights_note(records: list[AttentionRecord], info) -> dict[str, Any] | None:
    """What the page says when drawn records carry scores but no weights, and why they have none."""
    missing = [r for r in records if r.weights is None]
    if not missing:
        return None
    selection = info.get("selection") if isinstance(info, Mapping) else None
    keep = selection.get("keep") if isinstance(selection, Mapping) else None
    if keep is not None and "weights" not in keep:
        why = (
            f"weights were not asked for (keep={list(keep)!r}); capture with keep=[..., 'weights'] "
            "(or keep=None) to see them"
        )
    else:
        backends = ", ".join(sorted({str(r.backend) for r in missing}))
        why = (
            f"the attention code (backend: {backends}) computes none that could be observed; switch the model "
            "to eager attention or capture through an adapter that recomputes them"
        )
    return {
        "count": len(missing),
        "all": len(missing) == len(records),
        "layers": ", ".join(str(x) for x in dict.fromkeys(r.layer for r in missing)),
        "why": why,
    }


def layer_ranges(layers) -> str:
    """``[0, 1, 2, 3, 5]`` -> ``"0–3, 5"``."""
    out: list[str] = []
    run: list[int] = []
    for layer in sorted(set(layers)):
        if run and layer != run[-1] + 1:
            out.append(f"{run[0]}–{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)))
            run = []
        run.append(layer)
    if run:
        out.append(f"{run[0]}–{run[-1]}" if len(run) > 2 else ", ".join(map(str, run)))
    return ", ".join(out)


def _padded_positions(plan: PagePlan, row, b: int) -> set[int]:
    """Positions of ``row`` (batch row ``b``'s tokens) that some self-attention record marks as padding."""
    padded: set[int] = set()
    if row is None:
        return padded
    for r in plan.records:
        if r.kind == "cross" or r.query_padding is None:
            continue
        labels = record_labels(r, b, plan.tokens, plan.key_tokens, plan.image_tokens)
        if labels.query == row[r.query_offset : r.query_offset + matrix_shape(r)[0]]:
            marks = r.query_padding[min(b, r.query_padding.shape[0] - 1)]
            padded.update(int(p) + r.query_offset for p in marks.nonzero().flatten().tolist())
    return padded


def input_facts(plan: PagePlan, data: ReportData) -> dict[str, Any]:
    """What the overview says about the input: batch rows (those shown), sequence lengths and the layers that
    run over them, each shown row's tokens as given."""
    size = plan.records[0].batch_size or 1
    q_rows = None if plan.tokens is None else token_rows(plan.tokens, size, "tokens")
    k_rows = None if plan.key_tokens is None else token_rows(plan.key_tokens, size, "key_tokens")
    sequences: dict[int, list[int]] = {}
    keys: dict[int, list[int]] = {}
    for m in data.meta["records"]:
        sequences.setdefault(m["queryOffset"] + m["tq"], []).append(m["layer"])
        if m["kind"] == "cross":
            keys.setdefault(m["tk"], []).append(m["layer"])
    rows = []
    for b in plan.rows:
        q_row = None if q_rows is None else q_rows[b]
        k_row = None if k_rows is None else k_rows[b]
        rows.append(
            {
                "batch": b,
                "query_tokens": q_row,
                "key_tokens": k_row,
                "query_padded": _padded_positions(plan, q_row, b),
                "key_padded": _padded_positions(plan, k_row, b),
            }
        )
    plural = lambda n: "s" if n > 1 else ""  # noqa: E731
    return {
        "batch_size": size,
        "batch": plan.rows[0],
        "shown": plan.rows,
        "all_shown": len(plan.rows) == size,
        "max_rows": MAX_BATCH_ROWS,
        "sequences": [(n, f"layer{plural(len(set(ls)))} {layer_ranges(ls)}") for n, ls in sequences.items()],
        "key_sequences": [(n, f"layer{plural(len(set(ls)))} {layer_ranges(ls)}") for n, ls in keys.items()],
        "rows": rows,
        # the first shown row, as before (the diff page and older templates read these)
        "query_tokens": rows[0]["query_tokens"],
        "key_tokens": rows[0]["key_tokens"],
        "query_padded": rows[0]["query_padded"],
        "key_padded": rows[0]["key_padded"],
    }


def monitor_section(monitor, *, alerts=None, stats=None, report: bool = True) -> dict[str, Any] | None:
    """What a page's monitor part shows (``reports.monitor_data.monitor_context``, its data as the page's JSON in
    ``meta_json``): the Monitor section of ``to_html(monitor=)`` (``report=True``: errors name ``monitor_alerts=``
    and ``monitor_stats=``) or ``monitor_html``'s page. A report without a monitor: None (refusing alerts or
    statistics given without one). ``stats`` None: ``PAGE_STATS``."""
    from .monitor_data import PAGE_STATS, monitor_context

    if monitor is None and report:
        if alerts is not None or stats is not None:
            given = "monitor_alerts=" if alerts is not None else "monitor_stats="
            raise TypeError(f"{given} was given without monitor=: pass the monitor (or its history) as monitor=")
        return None
    context = monitor_context(monitor, alerts=alerts, stats=PAGE_STATS if stats is None else stats, report=report)
    context["meta_json"] = script_json(context.pop("meta"))
    return context


# ----------------------------------------------------------------------------------- the page
def _checks_of(plan: PagePlan) -> CheckResult | None:
    """The checks the page shows: ``attnprobe.check`` of the capture reported when the plan says True."""
    if plan.checks is True:
        from ..probe.checks import check

        return check(plan.capture)
    return None if plan.checks is False else plan.checks


def page_data(plan: PagePlan) -> PageData:
    """The data of a planned page, built once: for the report and the diff the encoded records of every batch row
    (``build_data``) and the overview's facts; the report adds its summary table and checks panel (the flags of
    every row), a diff's comparison table is ``reports.diff``'s; the long-input report has its records'
    statistics (``reports.long.build_long_data``) and the checks table."""
    checks = _checks_of(plan)
    if plan.layout == "long":
        return _long_data(plan, checks)
    data = build_data(plan)
    context = {
        "records": list(zip(plan.records, data.meta["records"])),
        "undrawn": plan.undrawn,
        "weightless": weights_note([r for records in plan.sources for r in records], plan.capture.info),
        "stitched": plan.stitched,
        "input": input_facts(plan, data),
        "precision": plan.precision,
        "masked_scores": plan.masked_scores,
    }
    if plan.layout == "report":
        context.update(_report_parts(plan, data, checks))
        image = context["image"] = _image_part(plan)
        if image is not None:  # the section's blobs (i0, i1, ...) beside the report's
            return PageData(data.meta, data.blobs + image.pop("blobs"), context)
    return PageData(data.meta, data.blobs, context)


def _image_part(plan: PagePlan) -> dict[str, Any] | None:
    """The Image section of a report with pictures (``to_html(image=)``): its page data as JSON and its blobs (ids
    ``i0``, ``i1``, ...); None without pictures, or when no record drawn holds their tokens."""
    if plan.image is None or plan.image_tokens is None:
        return None
    blobs = encoding.Blobs(prefix="i")
    try:
        section = image_section(
            list(enumerate(plan.records)),
            plan.image_tokens,
            plan.image,
            blobs=blobs,
            precision=plan.precision,
            labels=lambda record, batch: record_labels(record, batch, plan.tokens, None, plan.image_tokens).query,
        )
        blob_list = blobs.results()
    except BaseException:
        blobs.close()
        raise
    return None if section is None else {"meta_json": script_json(section), "blobs": blob_list}


def _report_parts(plan: PagePlan, data: ReportData, checks: CheckResult | None) -> dict[str, Any]:
    """What the report adds to a page's data: its overview of the model, its summary table and checks panel, and
    their data on the page (summary values, flagged cells of each batch row)."""
    # records without weights (a scores-only capture) have no summary row; the report says why elsewhere
    summary = Capture([r for r in plan.records if r.weights is not None], plan.capture.info).summary()
    rows = plan.rows
    panel = check_panel(checks, data.meta["records"], rows[0], rows)
    for b, row_meta in zip(rows, [data.meta, *data.meta["moreRows"]]):  # the cells to mark differ by row
        row_meta["flags"] = (
            check_panel(checks, row_meta["records"], b, rows)["flags"] if b != rows[0] else panel["flags"]
        )
    data.meta["summary"] = {
        f"{row.layer}-{row.head}": {
            c: page_number(getattr(row, c)) for c in summary.columns if c not in ("layer", "name", "head")
        }
        for row in summary.itertuples()
    }
    targets = {(m["layer"], h): f"#head-{m['id']}-{h}" for m in reversed(data.meta["records"]) for h in m["heads"]}
    info = describe_info(plan.capture.info)
    return {"mode": "report", "info": info, "summary": summary, "summary_targets": targets, "checks": panel}


def _long_data(plan: PagePlan, checks: CheckResult | None) -> PageData:
    """The long-input report's data: per record its statistics' blobs, and the checks table."""
    blobs = encoding.Blobs()
    try:
        records = build_long_data(plan.records, plan.rows[0], plan.precision, blobs)
        ids = blobs.results()
    except BaseException:
        blobs.close()
        raise
    meta = {"records": records, "precision": plan.precision}
    context = {
        "info": describe_info(plan.capture.info),
        "records": records,
        "batch": plan.rows[0],
        "precision": plan.precision,
        "checks_text": None if checks is None else checks.table(),
        "checks_ok": None if checks is None else checks.ok,
    }
    return PageData(meta, ids, context)


def render_plan(
    plan: PagePlan,
    *,
    title: str | None = None,
    monitor=None,
    started: float | None = None,
    analyses=None,
    spans=None,
):
    """The page of ``plan`` as text chunks (see ``render``): its data built once (``page_data``), rendered in one
    pass. ``monitor``: the Monitor section (``monitor_section``); ``started``: when the work began (the page says
    how long it took); ``analyses``, ``spans``: see ``to_html``."""
    started = time.perf_counter() if started is None else started
    data = page_data(plan)
    model = plan.capture.info.get("model_class", "model")
    context = dict(data.context)
    context.update(_analysis_context(plan, data, analyses, spans))
    return render(
        "long.html.j2" if plan.layout == "long" else "report.html.j2",
        script_name="long.js" if plan.layout == "long" else "report.js",
        title=title or f"attnprobe report: {model}",
        **context,
        monitor=monitor,
        page_scripts=("monitor.js",) * bool(monitor) + ("image.js",) * bool(data.context.get("image")),
        meta_json=script_json(data.meta),
        blobs=data.blobs,
        elapsed=time.perf_counter() - started,
    )


def _analysis_context(plan: PagePlan, data, analyses, spans) -> dict[str, Any]:
    """The Analyses section's parts (``reports.analysis_sections``) and the declared spans: a legend, each shown
    row's tokens marked by span (the overview's token lists; the token view reads ``meta["spans"]``)."""
    from .analysis_sections import SPAN_COLORS, analysis_context, span_tokens

    batch = plan.rows[0]
    rows = (data.context.get("input") or {}).get("rows") or []
    first = next((row["query_tokens"] for row in rows if row["batch"] == batch), None)
    parts = analysis_context(analyses or (), tokens=first, batch=batch)
    legend = []
    if spans is not None:
        from ..probe.analyses.spans import SpanSet

        if not isinstance(spans, SpanSet):
            raise TypeError(f"spans= takes declared spans (attnprobe.spans.ranges, sentences, ...), not {spans!r}")
        legend = [(label, SPAN_COLORS[i % len(SPAN_COLORS)]) for i, label in enumerate(spans.labels)]
        length = max((r.query_offset + (r.query_len or 0) for r in plan.records), default=0)
        data.meta["spans"] = {
            "labels": list(spans.labels),
            "colors": [color for _, color in legend],
            "rows": {
                str(b): spans.for_keys(1, length)[0].tolist()
                if spans.ids.shape[0] == 1
                else spans.for_keys(spans.ids.shape[0], length)[min(b, spans.ids.shape[0] - 1)].tolist()
                for b in plan.rows
            },
        }
        for row in rows:
            tokens = row.get("query_tokens")
            row["span_marks"] = None if tokens is None else span_tokens(spans, row["batch"], len(tokens))
    return {"analyses": parts, "span_legend": legend}


def to_html(
    capture,
    path=None,
    *,
    tokens=None,
    key_tokens=None,
    batch: int | list[int] | None = None,
    checks: CheckResult | bool | None = True,
    title: str | None = None,
    precision: str = "exact",
    masked_scores: bool = False,
    overwrite: bool = False,
    max_values: int | None = MAX_VALUES,
    monitor=None,
    monitor_alerts=None,
    monitor_stats=None,
    image=None,
    image_grid=None,
    analyses=None,
    spans=None,
):
    """Write one self-contained HTML report of ``capture``; return the document when ``path`` is None.

    ``tokens``: labels of the query sequence (and of the keys of self-attention), one list of strings
    or one list per batch row; ``key_tokens``: labels of the keys of cross-attention. ``batch``: the batch
    rows shown, with a selector above the grid: None (the default) every row up to ``MAX_BATCH_ROWS`` (8) that
    fits ``max_values`` (the page says when rows were left out), an int one row, a list those rows.
    ``checks``: the checks panel (violating heads are highlighted and linked): True (the default) runs
    ``attnprobe.check(capture)``; pass your own ``CheckResult`` (e.g. with ``causal=`` or ``attention_mask=``
    declared), or False for no panel. ``precision="exact"`` keeps every float32 value bit for bit; ``"bfloat16"``
    rounds values to about 3 significant digits for a file about half the size (the page says so). Scores of cells
    the query may not attend are left out unless ``masked_scores=True``. With ``path``, an existing file is
    replaced only with ``overwrite=True``; returns the path.

    ``monitor``: a training run watched by ``attnprobe.monitor`` (the monitor, an ``AttnprobeCallback``, or its
    history frame with ``monitor_alerts=mon.alerts`` beside it) adds a Monitor section with the plots and alerts
    table of ``monitor_html`` (``monitor_stats``: the statistics drawn, as its ``stats=``); its script is pinned by
    its own hash in the page's Content-Security-Policy, beside the report's.

    ``image``: the picture the processor took (a PIL image, a path, an array), or a list of them in its order, adds
    an Image section when the capture holds image tokens (``cap.image_tokens()``, or ``image_grid=`` here): each
    picture drawn from its own pixels (no request), a layer and head choice, pointing at a token tints the patches
    it attends to, pointing at a patch shades the tokens by their weight on it (see ``reports.image_section``).
    ``analyses``: results to show in an Analyses section (drawn on the server, no script needed): attention
    rollout or flow (``attnprobe.rollout``), value-weighted norms (``attnprobe.value_norms``), span x span attention
    (``attnprobe.spans.attention``), an eviction profile (``attnprobe.eviction_profile``). ``spans``: declared spans
    (``attnprobe.spans``): the token lists and the token view mark each token's span.

    Records captured under ``generate`` (with ``step``) are shown stitched (``attnprobe.stitch``).
    A statistics-only capture (``keep=("stats",)``, long inputs) gets the long-input page of ``reports.long``:
    pooled overviews, per-row statistics along the sequence and exact windows.

    Example::

        >>> import torch, attnprobe
        >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
        >>> out, cap = attnprobe.run(attn, torch.randn(1, 4, 8))
        >>> html = attnprobe.reports.to_html(cap, tokens=["a", "b", "c", "d"])
        >>> html.startswith("<!doctype html>")
        True
    """
    started = time.perf_counter()
    if path is not None:
        output_path(path, overwrite=overwrite)  # fail before the work
    monitor_part = monitor_section(monitor, alerts=monitor_alerts, stats=monitor_stats)
    plan = plan_page(
        capture,
        tokens=tokens,
        key_tokens=key_tokens,
        batch=batch,
        checks=checks,
        precision=precision,
        masked_scores=masked_scores,
        max_values=max_values,
        image=image,
        image_grid=image_grid,
    )
    chunks = render_plan(plan, title=title, monitor=monitor_part, started=started, analyses=analyses, spans=spans)
    return write_or_return(chunks, path, overwrite)
