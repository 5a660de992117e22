"""CSV that survives hostile tokens: every text cell quoted, spreadsheet formulas neutralised, Parquet exact."""

from __future__ import annotations

import csv
import io

import pandas as pd
import pytest
import torch

import attnprobe
from attnprobe import MultiHeadAttention
from attnprobe.probe.outputs.frames import formula_safe_text, write_frame

HOSTILE = [
    "a\rb",
    "line\nfeed",
    'say "hi"',
    "x,y",
    '=HYPERLINK("http://e.vil","x")',
    "+1",
    "-2",
    "@SUM(A1)",
    "\tTab",
    "\rCR",
    "plain",
]


@pytest.fixture
def cap():
    model = MultiHeadAttention(8, num_heads=2)
    with attnprobe.capture(model) as cap:
        model(torch.randn(1, len(HOSTILE), 8))
    return cap


def rows_of(text: str) -> list[list[str]]:
    return list(csv.reader(io.StringIO(text, newline="")))


def test_every_token_stays_in_its_cell(cap, tmp_path):
    rows = 2 * len(HOSTILE) ** 2
    for formula_safe in (True, False):
        text = cap.to_csv(tokens=HOSTILE, formula_safe=formula_safe)
        assert len(rows_of(text)) == rows + 1  # csv module: CR and LF inside a cell do not end the row
        assert len(pd.read_csv(io.StringIO(text))) == rows  # nor for pandas (the reader of the issue: 162 vs 198)
        path = cap.to_csv(tmp_path / f"f{formula_safe}.csv", tokens=HOSTILE, formula_safe=formula_safe)
        with open(path, newline="", encoding="utf-8") as f:
            assert len(list(csv.reader(f))) == rows + 1
    raw = rows_of(cap.to_csv(tokens=HOSTILE, formula_safe=False))
    column = raw[0].index("query_token")
    assert {r[column] for r in raw[1:]} == set(HOSTILE)  # opt-out: exactly the tokens


def test_formula_cells_are_neutralised_by_default(cap):
    table = rows_of(cap.to_csv(tokens=HOSTILE))
    column = table[0].index("key_token")
    seen = {r[column] for r in table[1:]}
    for token in HOSTILE:
        dangerous = token[0] in "=+-@\t\r"
        assert (("'" + token) in seen) is dangerous and (token in seen) is not dangerous, token
    assert not any(cell.startswith(("=", "+", "@", "\t", "\r")) for r in table[1:] for cell in r)
    # numbers stay numbers: a negative score is not text and gets no quote mark
    scores = [r[table[0].index("score")] for r in table[1:]]
    assert all(not s.startswith("'") for s in scores) and any(s.startswith("-") for s in scores)


def test_frame_writer_neutralises_module_names_and_duplicates():
    frame = pd.DataFrame(
        {"name": pd.Categorical(["=cmd", "'=cmd", "ok"]), "text": ["@x", "-", None], "value": [-1.5, 2.0, 3.0]}
    )
    text = write_frame(frame, None)
    assert rows_of(text)[1:] == [["'=cmd", "'@x", "-1.5"], ["'=cmd", "'-", "2.0"], ["ok", "", "3.0"]]
    assert formula_safe_text(-3) == -3 and formula_safe_text("a=b") == "a=b"


def test_parquet_is_exact(cap, tmp_path):
    path = cap.to_parquet(tmp_path / "frame.parquet", tokens=HOSTILE)
    back = pd.read_parquet(path)
    assert set(back.query_token) == set(HOSTILE) and len(back) == 2 * len(HOSTILE) ** 2


def test_cli_export_csv_safe_and_raw(tmp_path, monkeypatch):
    from click.testing import CliRunner

    from attnprobe.cli import main

    monkeypatch.chdir(tmp_path)
    run = CliRunner().invoke
    base = ["export", "cli_factories:tiny", "--ids", "1 2 3"]
    assert run(main, base + ["--out", "safe.csv"]).exit_code == 0
    assert run(main, base + ["--out", "raw.csv", "--raw-csv"]).exit_code == 0
    safe, raw = (pd.read_csv(tmp_path / n) for n in ("safe.csv", "raw.csv"))
    assert len(safe) == len(raw) > 0
    result = run(main, base + ["--out", "x.parquet", "--raw-csv"])
    assert result.exit_code == 2 and "--raw-csv applies to .csv" in result.output
