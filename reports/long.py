"""Reports of long inputs: a statistics capture (``capture(keep=("stats",), overview=...)``) has no
``(query x key)`` matrix, and the report never makes one.

Per record and head the page holds (``to_html`` switches here by itself for a statistics-only capture):

- the overview: the weights pooled (max and mean) to at most ``Overview.cells`` cells a side, computed by the
  statistics engine block by block from q and k (``probe.pooling``), exact float32 values of the pooling;
- per-row statistics along the sequence (``ROW_PLOTS``: entropy, max weight, first-key, diagonal and
  previous-token mass, ...), one value per query row;
- the exact weights of the windows chosen at capture time (``Overview.windows``, ``--window`` on the command line).

``reports.html.to_html_long`` writes the page from ``build_long_data``; ``reports.png.save_long_grid`` draws the
overviews (mean) and the windows of every head.
"""

from __future__ import annotations

import functools
from typing import Any

from ..probe.capture import Capture
from ..probe.engine.stats import OVERVIEW_STATS
from ..probe.record import AttentionRecord
from . import encoding
from ._common import check_batch

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


def build_long_data(
    records: list[AttentionRecord], batch: int, precision: str, blobs: encoding.Blobs, tokens=None
) -> list[dict[str, Any]]:
    """Per record: its facts and, per head, the blob ids of its overviews, row statistics and windows."""
    out = []
    for rid, r in enumerate(records):
        check_batch(r, batch)
        st = r.stats
        q_len, k_len = int(st["entropy"].shape[2]), int(st["key_weight"].shape[2])
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
        }
        ov = st.get("overview_mean")
        meta["cells"] = None if ov is None else [int(ov.shape[2]), int(ov.shape[3])]
        meta["cellSize"] = None if ov is None else [-(-q_len // int(ov.shape[2])), -(-k_len // int(ov.shape[3]))]
        meta["windows"] = [list(w) for w in windows_of(r)]
        meta["plots"] = [name for name in ROW_PLOTS if name in st]
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
        out.append(meta)
    return out
