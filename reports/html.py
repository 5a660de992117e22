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

from .. import __version__
from ..probe.capture import Capture
from ..probe.errors import AttnprobeError
from ..probe.files import atomic_open
from ..probe.record import AttentionRecord
from ..probe.violations import CheckResult, Violation
from . import encoding
from ..probe.tokens import token_rows
from ._common import check_batch, display_token, head_view, output_path, record_labels

#: Refuse reports that would hold more matrix values than this (about 4 bytes each, exact precision).
MAX_VALUES = 80_000_000


# ----------------------------------------------------------------------------------- records shown
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
        from ..probe.generation import shown

        records, stitched_runs = shown(records)
    drawable = [r for r in records if r.weights is not None or r.scores is not None]
    if not drawable:
        raise AttnprobeError(
            "nothing to report: no record has weights or scores. Capture with keep=None (everything) or "
            "keep=['scores', 'weights']" + (" (this capture is empty)" if not records else "")
        )
    return drawable, [r for r in records if r.weights is None and r.scores is None], stitched_runs


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


def check_precision(precision: str) -> None:
    if precision not in encoding.PRECISIONS:
        raise AttnprobeError(f"precision must be one of {encoding.PRECISIONS}, got {precision!r}")


def build_data(
    sources: list[list[AttentionRecord]],
    *,
    batch: int,
    tokens,
    key_tokens,
    precision: str,
    masked_scores: bool,
    max_values: int | None,
) -> ReportData:
    """Encode the records of one capture (``sources`` of length 1) or of two matched captures (diff).

    Steps: refuse a page past ``max_values``; per record (a group of matched records), its facts
    (``_record_meta``), per source its encoded heads and their colour statistics (``_source_meta``), per head
    its thumbnail (``_Thumbnails``); then the page's meta. Blobs are encoded lazily, in the order added.
    """
    check_precision(precision)
    _refuse_past_budget(sources, batch, max_values)
    diff = len(sources) == 2
    tok = _Tokens()
    blobs = encoding.Blobs()
    thumbs = _Thumbnails(diff)
    records_meta = []
    try:
        for rid, group in enumerate(zip(*sources)):
            r = group[0]
            meta = _record_meta(rid, r, record_labels(r, batch, tokens, key_tokens), tok)
            views = []  # per source, the head views of its record
            for rec in group:
                views.append([head_view(rec, h, batch) for h in r.heads])
                meta["sources"].append(_source_meta(rec, views[-1], blobs, precision, masked_scores))
            for i in range(len(r.heads)):
                meta["thumbs"].append(thumbs.add([vs[i] for vs in views]))
                meta["thumbShape"] = thumbs.shape
            records_meta.append(meta)
        thumb_blob = blobs.add(thumbs.encoded().tobytes)
        blob_list = blobs.results()
    except BaseException:
        blobs.close()
        raise
    meta = {
        "records": records_meta,
        "tokens": tok.lists,
        "thumbBlob": thumb_blob,
        "thumbMax": thumbs.max,
        "precision": precision,
        "maskedScores": masked_scores,
        "batch": batch,
        "mode": "diff" if diff else "report",
    }
    return ReportData(meta, blob_list, tok.lists)


def _refuse_past_budget(sources: list[list[AttentionRecord]], batch: int, max_values: int | None) -> None:
    """Check the batch row exists in every record, and the page's weights and scores fit ``max_values``."""
    values = 0
    for rows in sources:
        for r in rows:
            check_batch(r, batch)
            per_head = r.query_len * r.key_len
            values += per_head * len(r.heads) * ((r.weights is not None) + (r.scores is not None))
    if max_values is not None and values > max_values:
        raise AttnprobeError(
            f"this report would hold {values:,} values (~{values * 4 / 2**20:,.0f} MiB before compression), more "
            f"than max_values={max_values:,}. Report fewer layers or heads (cap.select(layers=..., heads=...)), "
            "use precision='bfloat16', or raise max_values="
        )


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


def _source_meta(rec: AttentionRecord, views: list, blobs: encoding.Blobs, precision: str,
                 masked_scores: bool) -> dict[str, Any]:
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


def check_panel(checks: CheckResult | None, records_meta: list[dict], batch: int) -> dict[str, Any]:
    """Rows of the checks table, and which (record id, head) are flagged."""
    if checks is None:
        return {"given": False, "rows": [], "flags": {}}
    if not isinstance(checks, CheckResult):
        raise TypeError(f"checks must be an attnprobe.CheckResult (from attnprobe.check(capture)), got {type(checks).__name__}")
    by_call = {(m["layer"], m["call"]): m for m in records_meta}
    by_layer: dict[int, dict] = {}
    for m in records_meta:
        by_layer.setdefault(m["layer"], m)
    rows: list[CheckRow] = []
    flags: dict[str, dict[str, Any]] = {}
    for v in checks.violations:
        m = None if v.layer is None else (by_call.get((v.layer, v.call)) or by_layer.get(v.layer))
        target = None
        if m is not None:
            heads = [v.head] if v.head is not None and v.head in m["heads"] else ([] if v.head is not None else m["heads"])
            for h in heads:
                key = f"{m['id']}-{h}"
                flag = flags.setdefault(key, {"errors": 0, "other": 0, "marks": []})
                flag["errors" if v.severity == "error" else "other"] += 1
                if v.batch in (None, batch):
                    flag["marks"].append({"check": v.check, "queries": list(v.queries), "keys": list(v.keys)})
            if heads:
                target = f"#head-{m['id']}-{heads[0]}"
        rows.append(CheckRow(v, target, v.batch is not None and v.batch != batch))
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


@functools.lru_cache(maxsize=None)
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


def render(template: str, *, script_name: str = "report.js", **context):
    """Render ``template`` with the page script (``static/<script_name>``) and style inlined and a CSP that pins
    the script.

    Returns an iterator of text chunks (a file is written without holding the whole document twice).
    """
    script = _static(script_name)
    if "</script" in script.lower() or "<!--" in script:
        raise AssertionError("the report script must not contain '</script' or '<!--'")
    digest = base64.b64encode(hashlib.sha256(script.encode("utf-8")).digest()).decode("ascii")
    csp = (
        "default-src 'none'; "
        f"script-src 'sha256-{digest}'; "
        "style-src 'unsafe-inline'; "
        "base-uri 'none'; form-action 'none'"
    )
    env = _environment()
    return env.get_template(template).generate(
        csp=csp,
        style=_static("report.css"),
        script=script,
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
        "<!doctype html><html lang=\"en\"><head><meta charset=\"utf-8\">"
        "<meta http-equiv=\"Content-Security-Policy\" content=\"default-src 'none'; style-src 'unsafe-inline'\">"
        f"<style>{_static('report.css')}</style></head><body data-mode=\"report\"><main>{body}</main></body></html>"
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
        why = (f"weights were not asked for (keep={list(keep)!r}); capture with keep=[..., 'weights'] "
               "(or keep=None) to see them")
    else:
        backends = ", ".join(sorted({str(r.backend) for r in missing}))
        why = (f"the attention code (backend: {backends}) computes none that could be observed; switch the model "
               "to eager attention or capture through an adapter that recomputes them")
    return {
        "count": len(missing),
        "all": len(missing) == len(records),
        "layers": ", ".join(str(x) for x in dict.fromkeys(r.layer for r in missing)),
        "why": why,
    }


def input_facts(records: list[AttentionRecord], batch: int, data: ReportData, tokens, key_tokens) -> dict[str, Any]:
    """What the overview says about the input: batch, sequence lengths, the tokens as given."""
    size = records[0].batch_size or 1
    q_row = None if tokens is None else token_rows(tokens, size, "tokens")[batch]
    k_row = None if key_tokens is None else token_rows(key_tokens, size, "key_tokens")[batch]
    sequences: dict[int, list[str]] = {}
    keys: dict[int, list[str]] = {}
    padded: dict[int | None, set[int]] = {}
    for m in data.meta["records"]:
        name = m["name"] or "(model itself)"
        sequences.setdefault(m["queryOffset"] + m["tq"], []).append(name + (" queries" if m["kind"] == "cross" else ""))
        if m["kind"] == "cross":
            keys.setdefault(m["tk"], []).append(name)
        else:
            padded.setdefault(m["qTokens"], set()).update(p + m["queryOffset"] for p in m["sources"][0]["padding"])

    def padded_of(row):
        if row is None or row not in data.token_lists:
            return set()
        return padded.get(data.token_lists.index(row), set())

    return {
        "batch_size": size,
        "batch": batch,
        "sequences": [(n, ", ".join(dict.fromkeys(names))) for n, names in sequences.items()],
        "key_sequences": [(n, ", ".join(dict.fromkeys(names))) for n, names in keys.items()],
        "query_tokens": q_row,
        "key_tokens": k_row,
        "query_padded": padded_of(q_row),
        "key_padded": padded_of(k_row),
    }


def to_html_long(capture, path=None, *, batch: int = 0, checks: CheckResult | bool | None = True,
                 title: str | None = None, precision: str = "exact", overwrite: bool = False):
    """The HTML report of a statistics-only capture (see the module doc); ``to_html`` calls it for one."""
    from .long import build_long_data, stats_only

    started = time.perf_counter()
    check_precision(precision)
    if path is not None:
        output_path(path, overwrite=overwrite)
    records = list(capture)
    if not stats_only(capture):
        raise AttnprobeError("to_html_long takes a statistics-only capture (keep=('stats',)); use to_html")
    if checks is True:
        from ..probe.checks import check

        checks = check(capture)
    blobs = encoding.Blobs()
    try:
        data = build_long_data(records, batch, precision, blobs)
        ids = blobs.results()
    except BaseException:
        blobs.close()
        raise
    model = capture.info.get("model_class", "model")
    chunks = render(
        "long.html.j2",
        script_name="long.js",
        title=title or f"attnprobe report: {model}",
        info=describe_info(capture.info),
        records=data,
        batch=batch,
        precision=precision,
        checks_text=None if not checks else checks.table(),
        checks_ok=None if not checks else checks.ok,
        meta_json=script_json({"records": data, "precision": precision}),
        blobs=ids,
        elapsed=time.perf_counter() - started,
    )
    return write_or_return(chunks, path, overwrite)


def to_html(
    capture,
    path=None,
    *,
    tokens=None,
    key_tokens=None,
    batch: int = 0,
    checks: CheckResult | bool | None = True,
    title: str | None = None,
    precision: str = "exact",
    masked_scores: bool = False,
    overwrite: bool = False,
    max_values: int | None = MAX_VALUES,
):
    """Write one self-contained HTML report of ``capture``; return the document when ``path`` is None.

    ``tokens``: labels of the query sequence (and of the keys of self-attention), one list of strings
    or one list per batch row; ``key_tokens``: labels of the keys of cross-attention; ``batch``: the
    batch row shown. ``checks``: the checks panel (violating heads are highlighted and linked):
    True (the default) runs ``attnprobe.check(capture)``; pass your own ``CheckResult`` (e.g. with
    ``causal=`` or ``attention_mask=`` declared), or False for no panel. ``precision="exact"`` keeps
    every float32 value bit for bit; ``"bfloat16"`` rounds values to about 3 significant digits for a file about half the size (the page
    says so). Scores of cells the query may not attend are left out unless ``masked_scores=True``.
    With ``path``, an existing file is replaced only with ``overwrite=True``; returns the path.

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
    from .long import stats_only

    if stats_only(capture):  # a long input: statistics, pooled overviews and windows, no (query x key) matrix
        return to_html_long(capture, path, batch=batch, checks=checks, title=title, precision=precision,
                            overwrite=overwrite)
    started = time.perf_counter()
    if path is not None:
        output_path(path, overwrite=overwrite)  # fail before the work
    records, undrawn, stitched = shown_records(capture)
    data = build_data([records], batch=batch, tokens=tokens, key_tokens=key_tokens, precision=precision,
                      masked_scores=masked_scores, max_values=max_values)
    # records without weights (a scores-only capture) have no summary row; the report says why elsewhere
    summary = Capture([r for r in records if r.weights is not None], capture.info).summary()
    if checks is True:
        from ..probe.checks import check

        checks = check(capture)
    panel = check_panel(None if checks is False else checks, data.meta["records"], batch)
    data.meta["flags"] = panel["flags"]
    data.meta["summary"] = {
        f"{row.layer}-{row.head}": {c: page_number(getattr(row, c)) for c in summary.columns if c not in ("layer", "name", "head")}
        for row in summary.itertuples()
    }
    model = capture.info.get("model_class", "model")
    chunks = render(
        "report.html.j2",
        title=title or f"attnprobe report: {model}",
        mode="report",
        info=describe_info(capture.info),
        records=list(zip(records, data.meta["records"])),
        undrawn=undrawn,
        weightless=weights_note(records, capture.info),
        stitched=stitched,
        input=input_facts(records, batch, data, tokens, key_tokens),
        precision=precision,
        masked_scores=masked_scores,
        summary=summary,
        summary_targets={(m["layer"], h): f"#head-{m['id']}-{h}" for m in reversed(data.meta["records"]) for h in m["heads"]},
        checks=panel,
        meta_json=script_json(data.meta),
        blobs=data.blobs,
        elapsed=time.perf_counter() - started,
    )
    return write_or_return(chunks, path, overwrite)
