"""Ranges, budgets and inputs are validated before anything is allocated: one line, exit 2."""

from __future__ import annotations

import tracemalloc

import pytest
import torch
from click.testing import CliRunner

import attnprobe
from attnprobe import SelectionError
from attnprobe.cli import main
from attnprobe.probe.commandline import loading, sizing
from attnprobe.probe.commandline.memory_plan import planned_attention_bytes

TINY = "cli_factories:tiny"


def one_line(args, tmp_path, monkeypatch, code=2) -> str:
    monkeypatch.chdir(tmp_path)
    tracemalloc.start()
    try:
        result = CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert result.exit_code == code, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    assert peak < 200 * 2**20, f"{peak / 2**20:.0f} MiB allocated before the error"
    return lines[0]


@pytest.mark.parametrize(
    "option, value, expected",
    [
        ("--layers", "0-2000000000", "--layers '0-2000000000' names 2,000,000,001 numbers"),
        ("--heads", "0-5000000000", "--heads '0-5000000000' names 5,000,000,001 numbers"),
        ("--heads", "0-40000,50000-90000", "names 80,002 numbers"),
        ("--layers", "-5000000000--1", "names 5,000,000,000 numbers"),
        ("--max-bytes", "1e400", "size '1e400' is beyond any memory"),
        ("--max-bytes", "0.5", "max_bytes must be a positive size: '0.5' is less than one byte"),
    ],
)
def test_cli_ranges_and_budgets(tmp_path, monkeypatch, option, value, expected):
    line = one_line(["check", TINY, "--ids", "1 2 3", f"{option}={value}"], tmp_path, monkeypatch)
    assert expected in line and line.startswith("attnprobe: error: ")


@pytest.mark.parametrize(
    "options, expected",
    [
        ({"layers": range(2_000_000_000)}, "names 2,000,000,000 numbers"),
        ({"heads": range(5_000_000_000)}, "names 5,000,000,000 numbers"),
        ({"heads": {0: range(5_000_000_000)}}, "names 5,000,000,000 numbers"),
        ({"layers": (i for i in range(10**12))}, "names more than 65,536 numbers"),
        ({"max_bytes": 1e400}, "max_bytes=inf is not a number of bytes"),
        ({"max_bytes": float("nan")}, "max_bytes=nan is not a number of bytes"),
        ({"max_bytes": "1e400"}, "beyond any memory"),
    ],
)
def test_python_ranges_and_budgets(options, expected):
    attn = attnprobe.MultiHeadAttention(8, num_heads=2)
    tracemalloc.start()
    try:
        with pytest.raises(SelectionError, match=expected):
            with attnprobe.capture(attn, **options):
                pass
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 50 * 2**20


def test_a_large_file_is_refused_before_the_forward_with_the_figure(tmp_path, monkeypatch):
    (tmp_path / "many.txt").write_text("\n".join(f"line {i} of many" for i in range(3000)))

    def never(*a, **k):
        raise AssertionError("the forward ran")

    def unread(self):
        raise AssertionError("the texts were read whole")

    monkeypatch.setattr(attnprobe, "run", never)
    monkeypatch.setattr(sizing.TextInputs, "__iter__", unread)  # refused from the line count and the longest line
    line = one_line(["check", "--file", "many.txt", "--max-bytes", "50MB", "--full"], tmp_path, monkeypatch)
    assert (
        line.startswith("attnprobe: error: capture budget exceeded: the input (3,000 row(s), padded to at least ")
        and "needs at least " in line
    )
    assert "more than --max-bytes 50MB (47.7 MiB)" in line and "give fewer inputs" in line


def test_without_a_budget_the_machine_memory_is_the_limit(tmp_path, monkeypatch):
    from attnprobe.probe.commandline import memory_plan

    (tmp_path / "many.txt").write_text("\n".join(f"line {i}" for i in range(200)))
    monkeypatch.setattr(memory_plan, "available_memory", lambda: 10 * 2**20)
    line = one_line(["report", "--file", "many.txt", "--full"], tmp_path, monkeypatch)
    assert line.startswith("attnprobe: error: too large an input: the input (200 row(s)")
    assert "more than the memory available on this machine (10.0 MiB)" in line


@pytest.mark.parametrize("spec, keep", [(None, None), (TINY, None), (TINY, ["weights"])])
def test_the_planned_figure_is_a_lower_bound(spec, keep):
    net, tokenizer, source = loading.load_model(spec)
    texts = ["a short one", "and a somewhat longer second input"] if tokenizer else []
    work = loading.build_workload(
        net, tokenizer, source, texts=texts, decoder_texts=[], ids=[] if tokenizer else [[1, 2, 3, 4], [5, 6]]
    )
    options = {"layers": [0, -1], "heads": [0, 1], "keep": keep}
    planned = planned_attention_bytes(work, options, attnprobe.attention_modules(work.model))
    with torch.no_grad():
        _, cap = attnprobe.run(work.model, work.inputs, **options)
    assert 0 < planned <= cap.nbytes, (planned, cap.nbytes)
    assert planned > cap.nbytes / 3  # and close enough to mean something
