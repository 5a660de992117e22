"""`attnprobe compare REF CAND`: exit 0 when two implementations agree, 1 with the first divergence on one line,
2 on usage errors."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from attnprobe.cli import main
from attnprobe.probe.analyses.diagnoses import DIAGNOSES

pytest.importorskip("transformers")
REF, PORT, BUGGY = "port_models:tiny_llama", "port_models:llama_port", "port_models:llama_port_interleaved"
IDS = ["--ids", "5 17 3 88 41 9 60", "--ids", "12 7 7 30 99 2 45"]


@pytest.fixture
def cli(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)

    def invoke(*args):
        return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)

    return invoke


def test_two_implementations_that_agree_exit_0(cli):
    result = cli("compare", REF, PORT, *IDS, "--candidate-modules", "auto")
    assert result.exit_code == 0, result.output
    assert result.stdout.startswith("agree within tolerance: 2 attention calls")


def test_a_divergence_exits_1_with_one_line_and_writes_the_report(cli, tmp_path):
    result = cli("compare", REF, BUGGY, *IDS, "--candidate-modules", "auto", "--html", "out/compare.html")
    assert result.exit_code == 1, result.output
    (line,) = result.stdout.strip().splitlines()
    assert line.startswith("first divergence: layer 1 (model.layers.1.self_attn) head 0 q at batch 0, query 1")
    assert "diagnosis rope_layout" in line
    assert 'id="divergence"' in (tmp_path / "out" / "compare.html").read_text()


def test_json_carries_the_divergence_as_data(cli):
    result = cli("compare", REF, BUGGY, *IDS, "--candidate-modules", "auto", "--format", "json", "--stats")
    assert result.exit_code == 1, result.output
    data = json.loads(result.stdout)
    assert data["ok"] is False and data["reference"] == REF and data["candidate"] == BUGGY
    assert data["first"]["layer"] == 1 and data["first"]["tensor"] == "max_score"  # statistics: no q to fit RoPE on
    assert data["diagnosis"] in DIAGNOSES and data["evidence"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--mapping", "0"], "each item is REFERENCE=CANDIDATE"),
        (["--mapping", "7=0"], "mapping names 7, which is no attention call of the reference"),
        ([], "no attention found in port_models:llama_port"),  # a hand-written port needs --candidate-modules
    ],
)
def test_usage_errors_exit_2_with_one_line(cli, args, message):
    extra = [] if args == [] else ["--candidate-modules", "auto"]
    result = cli("compare", REF, PORT, *IDS, *extra, *args)
    assert result.exit_code == 2, result.output
    (line,) = result.stderr.strip().splitlines()
    assert message in line and "Traceback" not in result.output


def test_help_has_examples_and_the_exit_codes(cli):
    result = cli("compare", "--help")
    assert result.exit_code == 0 and "Examples:" in result.stdout and "attnprobe compare ./gpt2" in result.stdout
    text = " ".join(result.stdout.split())
    assert "Exit code 0 when they agree within tolerance, 1 when they differ, 2 on bad usage" in text
    assert "attnprobe compare REF CAND" in cli("--help").stdout
