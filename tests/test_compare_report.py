"""The first divergence of attnprobe.compare drawn, and the aligned captures the diff report draws side by side."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from reports_helpers import browser, open_report, wait_until  # noqa: F401  (browser and open_report: fixtures)
from torch import nn

import attnprobe
from attnprobe.probe.errors import AttnprobeError
from attnprobe.reports.comparison import divergence_axes, divergence_matrices, divergence_png, save_divergence

compare = attnprobe.compare

pytest.importorskip("matplotlib")


class Attention(nn.Module):
    """Hand-written causal attention; ``offset=1`` lets every query see the next key too (a mask off by one)."""

    def __init__(self, d=8, h=2, offset=0):
        super().__init__()
        self.h, self.offset = h, offset
        self.qkv = nn.Linear(d, 3 * d)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, C // self.h).permute(2, 0, 3, 1, 4)  # (B, h, T, hd)
        att = (q @ k.transpose(-2, -1)) * (C // self.h) ** -0.5  # (B, h, T, T)
        att = att.masked_fill(torch.ones(T, T).tril(self.offset) == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v  # (B, h, T, hd)
        return y.transpose(1, 2).reshape(B, T, C)


X = torch.randn(1, 5, 8, generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def result():
    torch.manual_seed(0)
    ref = Attention().eval()
    cand = copy.deepcopy(ref)
    cand.offset = 1
    return compare(ref, cand, X, reference_options={"modules": "auto"}, candidate_options={"modules": "auto"})


def test_the_divergence_matrices_are_the_diverged_head_side_by_side(result):
    assert (result.first.tensor, result.diagnosis) == ("weights", "mask")
    ref, cand, diff = divergence_matrices(result)
    assert ref.shape == cand.shape == diff.shape == (5, 5)
    assert np.allclose(np.tril(ref, 1)[np.triu_indices(5, 1)], 0)  # the reference keeps the future at zero
    assert cand[0, 1] > 0 and diff[result.first.query, result.first.key] > result.first.tolerance


def test_the_figure_draws_three_panels_and_writes_a_png(result, tmp_path):
    from matplotlib.figure import Figure

    axes = divergence_axes(result, Figure().subplots(1, 3))
    assert [a.get_title().split(":")[0] for a in axes] == ["reference", "candidate", "|candidate - reference|"]
    path = save_divergence(result, tmp_path / "first.png")
    assert path.read_bytes().startswith(b"\x89PNG")
    with pytest.raises(FileExistsError):
        save_divergence(result, tmp_path / "first.png")


def test_nothing_to_draw_when_they_agree():
    model = Attention().eval()
    same = compare(model, model, X, reference_options={"modules": "auto"}, candidate_options={"modules": "auto"})
    with pytest.raises(AttnprobeError, match="agree within tolerance: there is no divergence to draw"):
        divergence_png(same)


def test_the_aligned_captures_share_one_layout_for_the_diff_report(result):
    ref, cand = result.aligned()
    assert [r.name for r in ref] == [r.name for r in cand] and ref[0].heads == cand[0].heads
    frame = attnprobe.reports.compare(ref, cand)
    assert frame["changed"].all()  # the mask changed in every head
    assert attnprobe.reports.diff_html(ref, cand, labels=("reference", "candidate")).startswith("<!doctype html>")


def test_the_divergence_section_context(result):
    from attnprobe.reports.comparison import divergence_context

    context = divergence_context(result, {(0, 0): 7})
    assert context["diagnosis"] == "mask" and context["target"] == f"#head-7-{result.first.head}"
    assert context["where"] == "batch 0, query 0, key 0" and context["png"].startswith("iVBORw0KGgo")  # a PNG


def test_the_diff_report_of_a_comparison_opens_with_the_first_divergence(result, tmp_path):
    page = attnprobe.reports.diff_html(result)
    assert '<section id="divergence">' in page and "Diagnosis: mask" in page
    assert "img-src data:" in page and 'src="data:image/png;base64,' in page
    assert page.index('id="divergence"') < page.index('id="grid"')  # after the overview, before the heads
    assert '<b class="src-label">reference</b>' in page and "two implementations" in page
    path = attnprobe.reports.diff_html(result, path=tmp_path / "compare.html")
    assert path.read_text().count('id="divergence"') == 1
    with pytest.raises(AttnprobeError, match="pass no second capture"):
        attnprobe.reports.diff_html(result, result.aligned()[1])
    with pytest.raises(AttnprobeError, match="needs two captures"):
        attnprobe.reports.diff_html(result.aligned()[0])


def test_the_diff_report_of_two_agreeing_implementations_says_so():
    model = Attention().eval()
    same = compare(model, model, X, reference_options={"modules": "auto"}, candidate_options={"modules": "auto"})
    page = attnprobe.reports.diff_html(same)
    assert "agree within tolerance" in page and "img-src" not in page


def test_the_divergence_section_in_a_browser(result, tmp_path, open_report):
    report = open_report(attnprobe.reports.diff_html(result, path=tmp_path / "compare.html"))
    page = report.page
    assert page.evaluate("document.querySelector('#divergence img.divergence').naturalWidth") > 0  # allowed, decoded
    page.click("#divergence a[href^='#head-']")
    wait_until(page, f"() => window.attnprobe.state().head === {result.first.head}")
    report.assert_clean()
