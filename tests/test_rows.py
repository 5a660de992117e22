"""capture(rows=): the row selection's forms and how each resolves against a call's query rows."""

from __future__ import annotations

import pytest
import torch

from attnprobe import SelectionError
from attnprobe.probe.rows import row_selection, runs


@pytest.mark.parametrize(
    ("rows", "length", "step", "want"),
    [
        ("last", 10, None, [9]),
        ("last:3", 10, None, [7, 8, 9]),
        ("last:30", 10, None, None),  # more than the call has: every row
        (slice(-4, None), 10, None, [6, 7, 8, 9]),
        (slice(1, 9, 3), 10, None, [1, 4, 7]),
        (slice(None, None, -2), 6, None, [1, 3, 5]),  # ascending whatever the step's sign
        ([5, 0, -1, 5], 10, None, [0, 5, 9]),
        (3, 10, None, [3]),
        ([12], 10, None, []),  # past the call's rows: none of them
        ("generated", 10, None, []),  # outside generation, and the prompt: none
        ("generated", 10, 0, []),
        ("generated", 1, 3, None),  # a step after the prompt: all its rows
        ("last", 1, 4, None),
    ],
)
def test_each_form_resolves_to_ascending_rows(rows, length, step, want):
    got = row_selection(rows).resolve(length, step=step)
    assert (got if got is None else got.tolist()) == want


def test_scattered_selections_are_told_apart_from_runs():
    assert not row_selection("last:4").scattered and not row_selection(slice(2, 9)).scattered
    assert not row_selection([3, 4, 5]).scattered and not row_selection([-2, -1]).scattered
    assert row_selection([3, 7]).scattered and row_selection(slice(0, 9, 2)).scattered
    assert row_selection([0, -1]).scattered
    assert runs(torch.tensor([0, 1, 5, 6, 7, 9])) == [(0, 2), (5, 8), (9, 10)]


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ("first", "is not a row selection"),
        ("last:0", "is not a row selection"),
        (slice(0, 4, 0), "step cannot be zero"),
        (slice(0.5, 4), "start must be a whole number"),
        ([1, 2.0], "must be integers"),
        ([], "selects no row"),
        (True, "takes row numbers"),
    ],
)
def test_bad_selections_say_what_to_give(rows, match):
    with pytest.raises(SelectionError, match=match):
        row_selection(rows)
