"""Reports of long inputs: a statistics capture (``capture(keep=("stats",), overview=...)``) has no
``(query x key)`` matrix, and the report never makes one.

Per record and head the page holds (``to_html`` switches here by itself for a statistics-only capture):

- the overview: the weights pooled (max and mean) to at most ``Overview.cells`` cells a side, computed by the
  statistics engine block by block from q and k (``probe.pooling``), exact float32 values of the pooling;
- per-row statistics along the sequence (``ROW_PLOTS``: entropy, max weight, first-key, diagonal and
  previous-token mass, ...), one value per query row;
- the exact weights of the windows chosen at capture time (``Overview.windows``, ``--window`` on the command line).

``reports.page.plan_page`` plans the page (its batch row, every record), ``reports.html.page_data`` builds its data
with ``build_long_data``; ``reports.png.save_long_grid`` draws the overviews (mean) and the windows of every head.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from typing import Any

from torch import Tensor

from ..probe.capture import Capture
from ..probe.engine.stats import OVERVIEW_STATS
from ..probe.errors import AttnprobeError
from ..probe.record import AttentionRecord
from . import encoding

#: Per-row statistics drawn along the sequence, in the page's order.
ROW_PLOTS: tuple[str, ...] = (
    "entropy",
    "max_weight",
    "first_key_mass",
    "diagonal_mass",
    "previous_mass",
    "masked_mass",
)


def stats_only(capture) -> bool:
    """Whether ``capture`` is a Capture whose every record carries statistics and no weights or scores (a
    long-input capture); False for anything else (the caller's own checks name what was wrong)."""
    if not isinstance(capture, Capture):
        return False
    records = list(capture)
    return bool(records) and all(r.stats is not None and r.weights is None and r.scores is None for r in records)


def windows_of(record: AttentionRecord) -> list[tuple[int, int, int, int]]:
    """The windows ``(q0, q1, k0, k1)`` whose exact weights ``record.stats["window_<i>"]`` holds."""
    return [tuple(w) for w in (record.meta or {}).get("stats_windows", [])]


def _floats(t, precision: str) -> bytes:
    return encoding.shuffled_floats(t.float().numpy(), precision)


def _statistics(record: AttentionRecord) -> Mapping[str, Tensor]:
    if record.stats is None:
        raise AttnprobeError(
            f"layer {record.layer} ({record.name!r}) has no statistics: the long-input report draws a statistics "
            "capture (keep=('stats',))"
        )
    return record.stats


def build_long_data(records: list[AttentionRecord], batch: int, precision: str, blobs: encoding.Blobs) -> list[dict]:
    """Per record: its facts and, per head, the blob ids of its overviews, row statistics and windows."""
    return [_long_record(rid, r, batch, precision, blobs) for rid, r in enumerate(records)]


def _long_record(rid: int, r: AttentionRecord, batch: int, precision: str, blobs: encoding.Blobs) -> dict[str, Any]:
    """One record of the long-input page: its place, sizes, overview cells, windows and plots, and per head the
    blob ids of its data."""
    st = _statistics(r)
    q_len, k_len = int(st["entropy"].shape[2]), int(st["key_weight"].shape[2])
    ov = st.get("overview_mean")  # (batch, head, cells, cells)
    meta: dict[str, Any] = {
        "id": rid,
        "layer": r.layer,
        "call": r.call,
        "name": r.name,
        "kind": r.kind,
        "heads": list(r.heads),
        "queries": q_len,
        "keys": k_len,
        "source": (r.meta or {}).get("stats_source"),
        "heads_data": [],
        "cells": None if ov is None else [int(ov.shape[2]), int(ov.shape[3])],
        "cellSize": None if ov is None else [-(-q_len // int(ov.shape[2])), -(-k_len // int(ov.shape[3]))],
        "windows": [list(w) for w in windows_of(r)],
        "plots": [name for name in ROW_PLOTS if name in st],
    }
    for i, head in enumerate(r.heads):
        hd: dict[str, Any] = {"head": head}
        if ov is not None:
            for name in OVERVIEW_STATS:
                hd[name] = blobs.add(functools.partial(_floats, st[name][batch, i], precision))
        hd["rows"] = {
            name: blobs.add(functools.partial(_floats, st[name][batch, i], "exact")) for name in meta["plots"]
        }
        hd["windows"] = [
            blobs.add(functools.partial(_floats, st[f"window_{w}"][batch, i], precision))
            for w in range(len(meta["windows"]))
            if f"window_{w}" in st
        ]
        meta["heads_data"].append(hd)
    return meta
