"""`--modules` on every command: hand-written attention reached from the command line, and `info`'s candidates."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from test_cli import cli, one_line_error  # noqa: F401  (the fixture)

from attnprobe.probe.commandline.candidates import softmax_modules

NANO = "cli_factories:nanogpt"


def test_info_lists_softmax_modules_as_candidates(cli):
    result = cli("info", NANO)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "layers:   0 attention module(s)" in lines
    rows = [line.split() for line in lines if line.startswith("  h.")]
    assert [r[:2] for r in rows] == [["h.0", "CausalSelfAttention"], ["h.1", "CausalSelfAttention"]]
    assert all(r[2].startswith("wild_models.py:") for r in rows)  # the line of the softmax
    assert "read them with --modules h.0,h.1 (or --modules auto)" in result.output
    data = json.loads(cli("info", NANO, "--format", "json").output)
    assert [c["name"] for c in data["candidates"]] == ["h.0", "h.1"] and data["attention_modules"] == []


def test_info_with_modules_lists_the_named_modules(cli):
    result = cli("info", NANO, "--modules", "h.0,h.1")
    assert result.exit_code == 0, result.output
    assert "layers:   2 attention module(s)" in result.output
    assert "candidates" not in result.output and "read them with" not in result.output
    data = json.loads(cli("info", NANO, "--modules", "h.1", "--format", "json").output)
    assert [(m["layer"], m["name"]) for m in data["attention_modules"]] == [(0, "h.1")]
    assert [c["name"] for c in data["candidates"]] == ["h.0"]


def test_check_without_modules_says_which_to_pass(cli):
    line = one_line_error(cli("check", NANO, "--ids", "1 2 3 4", "-q"))
    assert "no attention found" in line and "--modules h.0,h.1 or --modules auto" in line
    assert "capture(model" not in line  # advice a command-line user can follow


@pytest.mark.parametrize("modules", ["h.0,h.1", "auto"])
def test_check_reads_hand_written_attention_with_modules(cli, modules):
    result = cli("check", NANO, "--ids", "1 2 3 4", "-q", "--modules", modules, "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["records"] == 2 and data["verified"]


def test_check_with_modules_finds_the_planted_bug(cli):
    # mask_eq_1 masks the past instead of the future: the declared causality fails
    result = cli(
        "check",
        "cli_factories:nanogpt_masks_the_past",
        "--ids",
        "1 2 3 4",
        "-q",
        "--modules",
        "h.0,h.1",
        "--causal",
        "--format",
        "json",
    )
    assert result.exit_code == 1, result.output
    assert {v["check"] for v in json.loads(result.output)["violations"]} >= {"causal"}


def test_report_and_export_take_modules(cli, tmp_path):
    result = cli("export", NANO, "--ids", "1 2 3 4", "--modules", "h.0,h.1", "--out", "f.csv", "-q")
    assert result.exit_code == 0, result.output
    frame = pd.read_csv(tmp_path / "f.csv")
    assert sorted(frame.layer.unique()) == [0, 1] and len(frame) == 2 * 4 * 4 * 4
    result = cli("report", NANO, "--ids", "1 2 3 4", "--modules", "auto", "--out", "r.html", "-q")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "r.html").stat().st_size > 0


def test_modules_that_are_not_in_the_model_are_one_line_errors(cli):
    line = one_line_error(cli("check", NANO, "--ids", "1 2 3 4", "--modules", "h.7", "-q"))
    assert line.startswith("attnprobe: error: --modules: 'h.7' is not a module of NanoGPT") and "h.0" in line
    line = one_line_error(cli("info", NANO, "--modules", "nope"))
    assert "--modules: 'nope' is not a module" in line
    line = one_line_error(cli("check", NANO, "--ids", "1 2", "--modules", " , ", "-q"))
    assert "--modules ' , ' names no module" in line


def test_padding_a_model_without_attention_mask_is_refused(cli):
    line = one_line_error(cli("check", NANO, "--ids", "1 2 3", "--ids", "4", "--modules", "auto", "-q"))
    assert "takes no attention_mask" in line and "one length" in line


def test_softmax_modules_follows_a_helper_function_and_skips_library_code():
    import torch
    from wild_models import MultiHeadedAttention

    model = torch.nn.Sequential(MultiHeadedAttention(), torch.nn.MultiheadAttention(8, 2), torch.nn.Softmax(-1))
    found = softmax_modules(model)
    assert [(c.name, c.module_class) for c in found] == [("0", "MultiHeadedAttention")]
    assert found[0].where.startswith("wild_models.py:")  # in the attention() helper it calls
