"""One road through reports/: a page is planned once (reports/page.py), its data built once, rendered in one pass."""

from __future__ import annotations

import base64
import re

import pytest
import torch
from reports_helpers import Stack, stack_capture
from test_generation_stitch import as_steps

import attnprobe
from attnprobe import AttnprobeError, MultiHeadAttention
from attnprobe.reports import diff_html, inline, page, to_html


def frame_document(view: str) -> str:
    return base64.b64decode(view.split("base64,", 1)[1].split('"', 1)[0]).decode()


def test_every_page_asks_once_whether_the_capture_is_statistics_only(assert_no_hooks, monkeypatch):
    cap = stack_capture(assert_no_hooks, layers=2, heads=2, length=5)
    stats = stack_capture(assert_no_hooks, layers=2, heads=2, length=5, keep=("stats",))
    asked = []
    original = page.stats_only
    monkeypatch.setattr(page, "stats_only", lambda c: asked.append(c) or original(c))
    for capture in (cap, stats):
        asked.clear()
        to_html(capture)
        assert asked == [capture]


def test_the_plan_refuses_before_any_value_is_encoded(assert_no_hooks, monkeypatch):
    cap = stack_capture(assert_no_hooks, layers=2, heads=2, length=5, batch=3)
    plan = page.plan_page(cap, max_values=2 * page.values_per_row([list(cap)]))
    assert plan.layout == "report" and plan.rows == [0, 1] and plan.batch_size == 3  # the rows that fit
    monkeypatch.setattr(page.encoding, "shuffled_floats", lambda *a: pytest.fail("encoded before the refusal"))
    with pytest.raises(AttnprobeError, match="more than max_values=10"):
        to_html(cap, max_values=10)
    with pytest.raises(AttnprobeError, match="batch row 5 does not exist"):
        to_html(cap, batch=5)
    with pytest.raises(AttnprobeError, match="more than max_values=10"):
        diff_html(cap, cap, max_values=10)


def test_a_notebook_view_is_planned_under_its_byte_bound(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=4, heads=2, length=6, batch=2)
    records = list(cap)
    plan, drawn = page.plan_view(cap, max_bytes=10**9)
    assert (plan.rows, plan.precision, len(plan.records), drawn) == ([0, 1], "exact", 4, 4)
    one_row = page.estimate_view_bytes(records, "exact")  # every record of one row fits exactly, two rows do not
    plan, _ = page.plan_view(cap, max_bytes=one_row)
    assert (plan.rows, plan.precision, len(plan.records)) == ([0], "exact", 4)
    plan, _ = page.plan_view(cap, max_bytes=page.estimate_view_bytes(records[:2], "bfloat16"))
    assert (plan.rows, plan.precision, len(plan.records)) == ([0], "bfloat16", 2)
    assert [r.layer for r in plan.capture] == [0, 1]  # the view's checks run over what it shows


def test_the_long_input_report_shows_failed_checks(assert_no_hooks):
    # the long-input page tested the CheckResult for truth: a failed result (falsy) read "No checks were run"
    model = Stack(2, heads=2, causal=False).eval()
    stats = stack_capture(assert_no_hooks, model=model, length=6, batch=1, padded=False, keep=("stats",))
    failed = attnprobe.check(stats, causal=True)
    assert not failed.ok
    document = to_html(stats, checks=failed)
    assert "Some check failed" in document and "No checks were run" not in document
    assert "Every check passed" in to_html(stats)
    assert "No checks were run" in to_html(stats, checks=False)


def test_notebook_view_and_report_both_say_generation_runs_were_stitched():
    attn = MultiHeadAttention(8, num_heads=2, causal=True)
    with attnprobe.capture(attn) as cap:
        attn(torch.randn(1, 6, 8), attention_mask=torch.ones(1, 6, dtype=torch.long))
    steps = attnprobe.Capture(as_steps(cap[0], prefill=3))
    said = "1 generation run(s): the per-step records are stitched"
    assert said in to_html(steps)
    assert said in frame_document(inline.repr_html(steps))
    assert re.search(r"<td>0 \(4 steps\)</td>", to_html(steps))
