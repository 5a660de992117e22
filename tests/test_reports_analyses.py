"""The report's Analyses section (rollout, value norms, spans, eviction) and declared spans in its token lists and
token view; the long-input page shows a statistics capture's eviction profile."""

from __future__ import annotations

import re

import pytest
import torch
from reports_helpers import browser, open_report, wait_until  # noqa: F401  (browser and open_report: fixtures)

import attnprobe
from attnprobe.reports import to_html


@pytest.fixture(scope="module")
def stack():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[attnprobe.MultiHeadAttention(8, num_heads=2, causal=True) for _ in range(2)])
    with torch.no_grad(), attnprobe.capture(model, keep=("weights", "v")) as cap:
        model(torch.randn(1, 12, 8))
    return model, cap


def analyses_of(model, cap, spans):
    plan = attnprobe.EvictionPlan(observe=4, window=2)
    return [
        attnprobe.rollout(cap),
        attnprobe.value_norms(cap, model=model),
        attnprobe.spans.attention(cap, spans),
        attnprobe.eviction_profile(cap, budgets=[2, 4], plan=plan),
    ]


def test_the_analyses_section_shows_each_result(stack):
    model, cap = stack
    spans = attnprobe.spans.ranges({"first": (0, 5), "second": (5, 12)})
    results = analyses_of(model, cap, spans)
    html = to_html(cap, tokens=list("abcdefghijkl"), analyses=results, spans=spans)
    for part in ("rollout", "norms", "spans", "eviction"):
        assert f'id="analyses-{part}"' in html
    assert '<a href="#analyses">Analyses</a>' in html
    # the rollout's cells carry their values; the eviction table its means, the span grid its masses
    assert f'title="{float(results[0].values[0, -1, 11, 0]):.3f}"' in html
    profile = results[3]
    mean = profile[(profile.policy == "oracle") & (profile.budget == 4)]["kept"].mean()
    assert f"{mean:.3f}" in html
    assert "0.out_proj" in html  # where the output projection came from
    # every token of the overview's token list is marked by its span
    marked = re.findall(r'<span class="tok" style="border-bottom:3px solid (#[0-9a-f]{6})" title="position', html)
    assert len(marked) == 12 and len(set(marked)) == 2
    assert "no section" not in to_html(cap) and 'id="analyses"' not in to_html(cap)
    with pytest.raises(TypeError, match="analyses= takes results of"):
        to_html(cap, analyses=[cap])


def test_a_long_input_page_shows_a_statistics_captures_eviction_profile():
    torch.manual_seed(0)
    attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
    plan = attnprobe.EvictionPlan(budgets=(4, 16), observe=8, window=4)
    with torch.no_grad(), attnprobe.capture(attn, keep=("stats",), eviction=plan) as cap:
        attn(torch.randn(1, 64, 8))
    html = to_html(cap, analyses=[attnprobe.eviction_profile(cap)])
    assert 'data-mode="long"' in html and 'id="analyses-eviction"' in html


def test_the_token_view_marks_each_tokens_span(stack, tmp_path, open_report):
    _, cap = stack
    spans = attnprobe.spans.ranges({"first": (0, 5), "second": (5, 12)})
    path = to_html(cap, tmp_path / "report.html", tokens=list("abcdefghijkl"), spans=spans)
    report = open_report(path)
    page = report.page
    page.evaluate("document.querySelector('#tokens').scrollIntoView()")
    wait_until(page, "() => document.querySelectorAll('.tv-tok.q').length === 12")
    titles = page.eval_on_selector_all(".tv-tok.q", "els => els.map(e => e.title)")
    assert all("span first" in t for t in titles[:5]) and all("span second" in t for t in titles[5:])
    bars = page.eval_on_selector_all(".tv-tok.k", "els => els.map(e => e.style.boxShadow)")
    assert len(set(bars[:5])) == 1 and bars[0] != bars[-1] and bars[0]
    report.assert_clean()
