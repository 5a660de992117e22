"""Watch attention while a model trains: per-head statistics every N forward calls, alerts, TensorBoard.

``Monitor`` counts the model's top-level forward calls. On calls 0, ``every``, ``2 * every``, ... it opens a
statistics capture (``keep=("stats",)``: computed blockwise from the q and k the forward made, under
``torch.no_grad()``, detached, no (query x key) tensor kept) for that one forward and closes it when the
forward returns (or raises). Between sampled calls nothing is attached, computed or copied: the only cost is
one counter in a forward pre-hook. Statistics never touch the graph, the gradients or the random stream
(dropout masks are the same with the monitor on and off). With ``hook=False`` nothing is put on the model: the caller
counts the calls it means (``begin_call``, ``end_call``: the Trainer callback counts training micro-batches), and
where compiled code calls the model the sampled call's capture opens before the graph runs.

On a sampled call the statistics are those of ``rows`` query rows per head (``capture(stats_rows=rows)``: evenly
spaced from the first row to the last, the same positions every step for the same length; every row when the
sequence is shorter, or with ``rows=None``). Each sampled call adds one row per (layer, head) to ``history``: the
statistics averaged over the sampled real query rows (``rows`` counts them; ``entropy``, ``max_weight``,
``first_key_mass``, ``diagonal_mass``, ``previous_mass``, ``masked_mass``, ``row_sum_error``, ``max_score``), and
the extremes that matter (``entropy_min``, over rows that may attend more than one key, ``max_weight_max``,
``max_score_max``, ``nonfinite_rows``), over the same rows. The history is kept by column (``History``).

The capture itself is not made here: probe/ never imports the adapters; ``attnprobe.monitor`` passes the wired
``attnprobe.capture``.
"""

from __future__ import annotations

import math
import operator
import threading
import warnings
from array import array
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ..errors import AttnprobeError, AttnprobeWarning, warn_user

#: per-row statistics averaged over a call's real query rows
MEANS = (
    "entropy",
    "max_weight",
    "first_key_mass",
    "diagonal_mass",
    "previous_mass",
    "masked_mass",
    "row_sum_error",
    "max_score",
)
#: row-level extremes: (column, statistic, how)
EXTREMES = (
    ("entropy_min", "entropy", "min"),
    ("max_weight_max", "max_weight", "max"),
    ("max_score_max", "max_score", "max"),
)
#: alert name -> (history column, comparison, what it means)
ALERTS = {
    "entropy_below": (
        "entropy",
        "<",
        "the head's mean attention entropy (nats) fell below the threshold: entropy collapse",
    ),
    "max_score_above": ("max_score_max", ">", "the largest attention logit passed the threshold: logit growth"),
    "max_weight_above": ("max_weight_max", ">", "one key took more than this share of a row's weight"),
    "nonfinite": ("nonfinite_rows", ">", "a row had a NaN or infinite weight or logit"),
}


#: the history's columns, in order
COLUMNS = ("step", "call", "layer", "head", "module", "rows", "nonfinite_rows", *MEANS, *(c for c, _, _ in EXTREMES))
_WHOLE = ("step", "call", "layer", "head", "rows", "nonfinite_rows")


class History(Sequence):
    """The monitor's rows, kept by column: 8 bytes a value, as in the frame, so resident memory grows as the frame
    does (a dict per row took about 0.8 KB). Reads as a sequence of dicts (``mon.rows``), oldest first; a slice
    builds only the rows it names."""

    def __init__(self) -> None:
        self._columns: dict[str, Any] = {
            c: [] if c == "module" else array("q" if c in _WHOLE else "d") for c in COLUMNS
        }
        self._names: dict[str, str] = {}  # one string object per module name

    def append(self, row: Mapping[str, Any]) -> None:
        for c in COLUMNS:
            value = row[c]
            self._columns[c].append(self._names.setdefault(value, value) if c == "module" else value)

    def __len__(self) -> int:
        return len(self._columns["step"])

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._row(i) for i in range(*index.indices(len(self)))]
        i = operator.index(index)
        i = i + len(self) if i < 0 else i
        if not 0 <= i < len(self):
            raise IndexError(f"history row {index} out of range ({len(self)} rows)")
        return self._row(i)

    def _row(self, i: int) -> dict:
        row = {c: self._columns[c][i] for c in COLUMNS}
        return {c: math.nan if isinstance(v, float) and v != v else v for c, v in row.items()}  # NaN: one object

    def frame(self):
        import numpy as np
        import pandas as pd

        data = {
            c: list(col) if c == "module" else np.array(col, dtype=np.int64 if c in _WHOLE else np.float64)
            for c, col in self._columns.items()
        }
        return pd.DataFrame(data, columns=list(COLUMNS))


def _missed_pre_hooks(module: nn.Module, known: set, args: tuple, kwargs: dict):
    """Run the forward pre-hooks a capture opened inside ``module``'s own pre-hook registered on it: torch calls the
    hooks a module had when its call began, so this call would miss them (an old-style model's request for
    ``output_attentions``, a stack's reading of its mask). In order, as torch would; ``(args, kwargs)`` where one
    changed them, else None."""
    changed = False
    for hook_id, hook in list(module._forward_pre_hooks.items()):
        if hook_id in known:
            continue
        if hook_id in module._forward_pre_hooks_with_kwargs:
            result = hook(module, args, kwargs)
            if result is not None:
                args, kwargs, changed = result[0], result[1], True
        else:
            result = hook(module, args)
            if result is not None:
                args, changed = (result if isinstance(result, tuple) else (result,)), True
    return (args, kwargs) if changed else None


class MonitorError(AttnprobeError, ValueError):
    """A monitor option cannot be used; the message says what to do."""


class AttentionAlert(AttnprobeError, RuntimeError):
    """An alert named in ``raise_on`` fired (for CI jobs and training scripts that should stop)."""


def _alert_spec(alerts: Mapping[str, Any] | None) -> dict[str, float]:
    spec = {}
    for name, value in (alerts or {}).items():
        if name not in ALERTS:
            raise MonitorError(f"no alert {name!r}; the alerts are {', '.join(ALERTS)}")
        if name == "nonfinite":
            if value:
                spec[name] = 0.0
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise MonitorError(f"alert {name!r} needs a finite number as its threshold, not {value!r}")
        spec[name] = float(value)
    return spec


class Monitor:
    """See ``attnprobe.monitor``."""

    def __init__(
        self,
        capture: Callable,
        model: nn.Module,
        *,
        every: int = 100,
        rows: int | None = 64,
        layers=None,
        heads=None,
        log_dir=None,
        alerts: Mapping[str, Any] | None = None,
        raise_on: Iterable[str] = (),
        block_bytes: int | None = None,
        writer=None,
        on_step: Callable | None = None,
        hook: bool = True,
        compiled: bool | None = None,
    ):
        if not isinstance(model, nn.Module):
            raise MonitorError(f"monitor watches a torch.nn.Module, not {type(model).__name__}")
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise MonitorError(f"every must be a positive whole number of forward calls, not {every!r}")
        if rows is not None and (isinstance(rows, bool) or not isinstance(rows, int) or rows < 1):
            raise MonitorError(
                f"rows must be a positive whole number of query rows per head (such as 64), or None "
                f"for every row, not {rows!r}"
            )
        self.alert_spec = _alert_spec(alerts)
        self.raise_on = set(raise_on)
        unknown = self.raise_on - set(ALERTS)
        if unknown:
            raise MonitorError(
                f"raise_on names no alert {', '.join(sorted(unknown))}; the alerts are {', '.join(ALERTS)}"
            )
        self._capture, self.model, self.every, self.query_rows = capture, model, every, rows
        self._options = {"keep": ("stats",), "layers": layers, "heads": heads, "stats_rows": rows}
        if block_bytes is not None:
            self._options["block_bytes"] = block_bytes
        # checked now, not at the first sampled step: a wrong layer or head fails before training starts
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", AttnprobeWarning)  # "saw no attention call": none was made, on purpose
            with capture(model, **self._options):
                pass
        self.calls = 0
        self.step: int | None = None  # set by integrations (the Trainer's global step); else the call number
        self._rows = History()
        self._alert_rows: list[dict] = []
        self._fired: set = set()
        self._open: Any = None  # (capture session, Capture, call number) of the sampled call in progress
        self._closing: Any = None  # the hook that closes it when the model returns (not with hook=False)
        self._thread: int | None = None
        self._in_graph = False  # the model ran inside torch.compile'd code (unmonitored)
        self._handles: list = []
        self._writer = writer
        self._own_writer = False
        self._on_step = on_step
        if log_dir is not None and writer is None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise MonitorError(
                    "log_dir= writes TensorBoard files: that needs the tensorboard package (pip install tensorboard)"
                ) from None
            self._writer = SummaryWriter(log_dir=str(log_dir))
            self._own_writer = True
        # the hook that closes a sampled step's capture is registered with it, after the capture's own hooks on
        # the model: they all run before it closes. hook=False: no hook; the caller counts the calls itself, outside
        # any graph (begin_call, end_call: the Trainer callback)
        self._driven = not hook
        self._closed = False
        if compiled if compiled is not None else not hook:  # compiled code calls the model: make it run the hooks
            self._options["compiled"] = True
        if hook:
            self._handles = [model.register_forward_pre_hook(self._before, with_kwargs=True)]

    # ------------------------------------------------------------------ hooks
    def _before(self, module, args, kwargs):
        if torch.compiler.is_compiling():
            # the model is called from a compiled graph, where no capture can open: say so when the monitor closes
            self._in_graph = True
            return None
        call = self._count()
        if call is None:
            return None
        known = set(module._forward_pre_hooks)
        self._open_capture(call)
        self._closing = module.register_forward_hook(self._after, always_call=True)  # after the capture's hooks
        return _missed_pre_hooks(module, known, args, kwargs)

    def _after(self, module, args, output):
        if self._open is None or self._thread != threading.get_ident():
            return None
        self._close_capture(record=output is not None)  # None: the forward raised (a hook called always)
        return None

    def _count(self) -> int | None:
        """Count a forward call; its number where it is sampled (and no capture is open), else None."""
        call = self.calls
        self.calls += 1
        return None if call % self.every or self._open is not None else call

    def _open_capture(self, call: int) -> None:
        session = self._capture(self.model, **self._options)
        cap = session.__enter__()
        self._open = (session, cap, call)
        self._thread = threading.get_ident()

    def _close_capture(self, *, record: bool) -> None:
        """Close the open capture; record its statistics, or (``record=False``: the forward raised) close quietly."""
        session, cap, call = self._open
        self._open = None
        if self._closing is not None:
            self._closing.remove()
            self._closing = None
        if not record:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", AttnprobeWarning)
                session.__exit__(None, None, None)
            return
        session.__exit__(None, None, None)
        self._record(cap, call)

    # ------------------------------------------------------------------ driven from outside (hook=False)
    def begin_call(self) -> None:
        """A forward call of the model is about to run: count it, and open a capture where it is sampled.

        For a monitor made with ``hook=False``, driven by a training loop or integration (the Trainer callback): it
        counts what it is told, not every forward call, and where compiled code calls the model, it is called
        outside the graph, so the capture opens before it and records inside it (the graph is compiled once with the
        capture's hooks and once without)."""
        if not self._driven:
            raise MonitorError("begin_call drives a monitor made with hook=False; this one counts calls itself")
        if self._closed:
            raise MonitorError("this monitor is closed; make a new one to go on monitoring")
        call = self._count()
        if call is not None:
            self._open_capture(call)

    def end_call(self) -> None:
        """The call counted by ``begin_call`` returned (its backward may have run too): record a sampled call."""
        if self._open is not None:
            self._close_capture(record=True)

    @property
    def driven(self) -> bool:
        """Whether the caller counts the calls (``hook=False``)."""
        return self._driven

    # ------------------------------------------------------------------ results
    def _record(self, cap, call: int) -> None:
        step = call if self.step is None else self.step
        new = per_head_rows(cap, step=step, call=call)
        for row in new:
            self._rows.append(row)
        if self._writer is not None:
            for row in new:
                base = f"attention/layer {row['layer']:02d}/head {row['head']:02d}"
                for name in ("entropy", "entropy_min", "max_score_max", "max_weight", "first_key_mass"):
                    value = row[name]
                    if value is not None and math.isfinite(value):
                        self._writer.add_scalar(f"{base}/{name}", value, step)
            self._writer.flush()
        fired = self._alerts(new)
        if self._on_step is not None:
            self._on_step(new, fired)
        raising = [a for a in fired if a["alert"] in self.raise_on]
        if raising:
            a = raising[0]
            raise AttentionAlert(
                f"attnprobe alert {a['alert']} at step {a['step']}: layer {a['layer']} head {a['head']} "
                f"{a['column']} = {a['value']:.6g} (threshold {a['threshold']:.6g})"
            )

    def _alerts(self, rows: list[dict]) -> list[dict]:
        fired = []
        for row in rows:
            for name, threshold in self.alert_spec.items():
                column, how, meaning = ALERTS[name]
                value = row[column]
                if value is None or (isinstance(value, float) and math.isnan(value)):
                    continue
                if (value < threshold) if how == "<" else (value > threshold):
                    alert = {
                        "step": row["step"],
                        "layer": row["layer"],
                        "head": row["head"],
                        "alert": name,
                        "column": column,
                        "value": float(value),
                        "threshold": threshold,
                    }
                    fired.append(alert)
                    self._alert_rows.append(alert)
                    key = (row["layer"], row["head"], name)
                    if key not in self._fired and name not in self.raise_on:  # those raise instead
                        self._fired.add(key)
                        warn_user(
                            f"attnprobe alert {name} at step {row['step']}: layer {row['layer']} head "
                            f"{row['head']} {column} = {value:.6g} (threshold {threshold:.6g}; {meaning})"
                        )
        return fired

    @property
    def rows(self) -> History:
        """The history as a sequence of plain dicts, oldest first (``mon.rows[-72:]``: the latest 72)."""
        return self._rows

    @property
    def history(self):
        """One row per sampled step, layer and head: the statistics (a pandas DataFrame)."""
        return self._rows.frame()

    @property
    def alerts(self):
        """Every alert that fired (step, layer, head, alert, column, value, threshold), a pandas DataFrame."""
        import pandas as pd

        return pd.DataFrame(
            self._alert_rows, columns=["step", "layer", "head", "alert", "column", "value", "threshold"]
        )

    def to_parquet(self, path, *, overwrite: bool = False):
        """Write ``history`` to a Parquet file and return its path. The file appears complete or not at all, and an
        existing file is replaced only with ``overwrite=True`` (as ``Capture.to_parquet`` and ``to_html`` do)."""
        from ..outputs.frames import write_frame

        return write_frame(self.history, path, format="parquet", overwrite=overwrite)

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Detach from the model (and close an open capture and the TensorBoard writer). Safe to call twice."""
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._closed = True
        if self._open is not None:  # a sampled call that never returned
            self._close_capture(record=False)
        if self._writer is not None and self._own_writer:
            self._writer.close()
        self._writer = None
        if self._in_graph:
            self._in_graph = False
            warn_user(
                f"the monitored {type(self.model).__name__} was called from torch.compile'd code, where a capture "
                "cannot open: those calls were not monitored (nor counted). Monitor the compiled module instead, "
                "attnprobe.monitor(compiled): its hook runs before the graph, and the capture it opens records "
                "inside it; or count the calls in the loop, outside the graph: monitor(model, hook=False), then "
                "mon.begin_call() and mon.end_call() around each call"
            )

    def __enter__(self) -> Monitor:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Monitor(every={self.every}, rows={self.query_rows}, calls={self.calls}, "
            f"sampled={len(set(self._rows._columns['call']))}, alerts={len(self._alert_rows)}, "
            f"{'closed' if self._closed else 'open'})"
        )


def per_head_rows(cap, *, step: int, call: int) -> list[dict]:
    """One dict per (layer, head) of a statistics capture: means over real query rows and the extremes."""
    rows = []
    for rec in cap:
        stats = getattr(rec, "stats", None)
        if not stats:
            continue
        real = rec.stats_real_rows  # every query row the statistics describe, less padding
        values = {name: stats[name].detach().double().cpu() for name in MEANS if name in stats}
        finite = stats["finite"].detach().cpu().bool()
        # a row that may attend one key has entropy 0 by construction (a causal row 0): not a collapse
        informative = stats["allowed_keys"].detach().cpu() > 1 if "allowed_keys" in stats else None
        for h, head in enumerate(rec.heads):
            mask = real[:, h]
            row = {
                "step": step,
                "call": call,
                "layer": rec.layer,
                "head": int(head),
                "module": rec.name,
                "rows": int(mask.sum()),
                "nonfinite_rows": int((~finite[:, h] & mask).sum()),
            }
            for name in MEANS:
                v = values.get(name)
                if v is None:
                    row[name] = math.nan
                    continue
                picked = v[:, h][mask]
                if name == "max_score":
                    picked = picked[picked.isfinite()]
                row[name] = float(picked.nanmean()) if picked.numel() else math.nan
            for column, name, how in EXTREMES:
                v = values.get(name)
                keep = mask if informative is None or name != "entropy" else mask & informative[:, h]
                picked = v[:, h][keep] if v is not None else torch.empty(0)
                picked = picked[~picked.isnan() & (picked.isfinite() if name == "max_score" else True)]
                row[column] = (
                    (float(picked.min()) if how == "min" else float(picked.max())) if picked.numel() else math.nan
                )
            rows.append(row)
    return rows
