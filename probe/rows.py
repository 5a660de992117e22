"""Which query rows a capture keeps (``capture(..., rows=)``).

A row selection picks rows among each attention call's query rows:

- an int or a list of ints: row indices of the call (negative: from its end);
- a ``slice``: rows of the call as Python slices them (``slice(-64, None)``: its last 64);
- ``"last"``: the call's last row; ``"last:N"``: its last ``N`` rows;
- ``"generated"``: under ``generate``, every row of the steps after the prompt (the prompt's rows, and calls
  outside generation, keep none).

A full capture (one that keeps a ``(query x key)`` tensor or ``q``/``output``) stores one record per run of
consecutive selected rows, whose ``query_offset`` places it in the sequence, so memory grows as rows x keys; a
statistics capture computes the statistics of the selected rows only (``record.stats_positions`` lists them).
"""

from __future__ import annotations

import itertools
import operator
import re
from collections.abc import Iterable
from dataclasses import dataclass

import torch

from .errors import SelectionError

_LAST = re.compile(r"last(?::(\d+))?")


@dataclass(frozen=True)
class RowSelection:
    """A validated ``rows=``: one of ``indices`` (ints), ``window`` (a slice), ``last`` (a count) or ``generated``."""

    indices: tuple[int, ...] | None = None
    window: tuple[int | None, int | None, int | None] | None = None
    last: int | None = None
    generated: bool = False

    @property
    def scattered(self) -> bool:
        """Whether the selected rows of a call may have gaps (a list that is not one run, a slice with a step)."""
        if self.indices is not None:
            ordered = sorted(self.indices)
            runs = all(b == a + 1 for a, b in itertools.pairwise(ordered))
            return not runs or (min(ordered) < 0 <= max(ordered))
        if self.window is not None:
            return self.window[2] not in (None, 1)
        return False

    def resolve(self, length: int, *, step: int | None = None) -> torch.Tensor | None:
        """``(n,)`` long, ascending, unique: the selected rows of a call of ``length`` query rows (``step``: its
        generation step, None outside generation); None when every row is selected."""
        if self.generated:
            return None if step is not None and step > 0 else torch.zeros(0, dtype=torch.long)
        if self.last is not None:
            return None if self.last >= length else torch.arange(length - self.last, length)
        if self.window is not None:
            picked = range(length)[slice(*self.window)]
            if self.window[2] is not None and self.window[2] < 0:
                picked = picked[::-1]
            rows = torch.tensor(list(picked), dtype=torch.long)
        else:
            wanted = {i + length if i < 0 else i for i in self.indices or ()}
            rows = torch.tensor(sorted(i for i in wanted if 0 <= i < length), dtype=torch.long)
        return None if len(rows) == length else rows

    def describe(self) -> str | list[int]:
        if self.generated:
            return "generated"
        if self.last is not None:
            return f"last:{self.last}"
        if self.window is not None:
            return "slice({}, {}, {})".format(*self.window)
        return list(self.indices or ())


def row_selection(rows) -> RowSelection | None:
    """``capture(rows=)`` validated: None (every row), an int, ints, a slice, ``"last"``, ``"last:N"`` or
    ``"generated"``.

    Example::

        >>> row_selection("last:3").resolve(10).tolist(), row_selection(slice(2, 8, 3)).resolve(10).tolist()
        ([7, 8, 9], [2, 5])
        >>> row_selection([0, -1]).resolve(5).tolist(), row_selection("generated").resolve(5, step=2)
        ([0, 4], None)
    """
    if rows is None:
        return None
    if isinstance(rows, str):
        if rows == "generated":
            return RowSelection(generated=True)
        m = _LAST.fullmatch(rows.strip())
        if not m or (m.group(1) is not None and int(m.group(1)) < 1):
            raise SelectionError(
                f"rows={rows!r} is not a row selection: give 'last', 'last:N' (N >= 1), 'generated', row numbers "
                "or a slice",
                argument="rows",
                value=rows,
            )
        return RowSelection(last=int(m.group(1) or 1))
    if isinstance(rows, slice):
        parts = []
        for name in ("start", "stop", "step"):
            value = getattr(rows, name)
            if value is not None and (isinstance(value, bool) or not hasattr(value, "__index__")):
                raise SelectionError(
                    f"rows= slice {name} must be a whole number or None, got {value!r}", argument="rows", value=rows
                )
            parts.append(None if value is None else operator.index(value))
        if parts[2] == 0:
            raise SelectionError("rows= slice step cannot be zero", argument="rows", value=rows)
        return RowSelection(window=(parts[0], parts[1], parts[2]))
    items = [rows] if hasattr(rows, "__index__") and not isinstance(rows, Iterable) else rows
    if isinstance(rows, bool) or not isinstance(items, Iterable):
        raise SelectionError(
            f"rows= takes row numbers, a slice, 'last', 'last:N' or 'generated', got {rows!r}",
            argument="rows",
            value=rows,
        )
    values = []
    for item in items:
        if isinstance(item, bool) or not hasattr(item, "__index__"):
            raise SelectionError(
                f"rows= row numbers must be integers, got {item!r} in {rows!r}", argument="rows", value=item
            )
        values.append(operator.index(item))
    if not values:
        raise SelectionError("rows=[] selects no row; leave rows out to keep every row", argument="rows", value=rows)
    return RowSelection(indices=tuple(dict.fromkeys(values)))


def runs(rows: torch.Tensor) -> list[tuple[int, int]]:
    """``rows`` (ascending) as runs of consecutive rows ``[(start, stop), ...]``.

    Example::

        >>> runs(torch.tensor([1, 2, 3, 7, 9, 10]))
        [(1, 4), (7, 8), (9, 11)]
    """
    out: list[tuple[int, int]] = []
    for r in rows.tolist():
        if out and out[-1][1] == r:
            out[-1] = (out[-1][0], r + 1)
        else:
            out.append((r, r + 1))
    return out
