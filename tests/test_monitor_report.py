"""The monitor's HTML page (``attnprobe.reports.monitor_html``): its data, its refusals, and the page in Chromium."""

from __future__ import annotations

import json
import math
import re
import warnings

import pytest
import torch
from torch import nn

import attnprobe
from attnprobe.probe.errors import AttnprobeWarning

from reports_helpers import wait_until, browser, open_report  # noqa: F401  (the shared browser fixtures)


class Layers(nn.Module):
    def __init__(self, layers=3, heads=2, d=8):
        super().__init__()
        self.layers = nn.ModuleList(attnprobe.MultiHeadAttention(d, num_heads=heads, causal=True) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def watched(steps=12, every=2, alerts=None):
    torch.manual_seed(0)
    model = Layers()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", AttnprobeWarning)
        with attnprobe.monitor(model, every=every, alerts=alerts) as mon:
            for _ in range(steps):
                model(torch.randn(2, 6, 8))
    return mon


def page_meta(page: str) -> dict:
    text = re.search(r'<script type="application/json" id="attnprobe-meta">(.*?)</script>', page, re.S).group(1)
    return json.loads(text)


def test_page_data_is_the_history_per_layer_and_per_head_and_the_alerts():
    mon = watched(alerts={"entropy_below": 1.4})
    page = attnprobe.reports.monitor_html(mon)
    meta = page_meta(page)
    plots = {p["name"]: p for p in meta["plots"]}
    assert list(plots) == ["entropy_min", "max_score_max", "entropy"]
    history = mon.history
    # per layer: the heads aggregated as monitor_plot does (lowest entropy_min, highest max_score_max)
    for name, how in (("entropy_min", "min"), ("max_score_max", "max")):
        assert [line["layer"] for line in plots[name]["layers"]] == [0, 1, 2]
        want = history.groupby(["layer", "step"])[name].agg(how)
        for line in plots[name]["layers"]:
            assert line["steps"] == [0, 2, 4, 6, 8, 10]
            assert line["values"] == pytest.approx(want.loc[line["layer"]].tolist())
    assert len(plots["entropy"]["heads"]) == 3 * 2
    # the alerts table: the first firing of each (layer, head, alert)
    first = mon.alerts.groupby(["layer", "head", "alert"])["step"].min()
    assert len(meta["alerts"]) == len(first) > 0
    assert page.count('class="alert-row"') == len(first)
    assert all(a["step"] == first.loc[(a["layer"], a["head"], a["alert"])] for a in meta["alerts"])


def test_page_from_a_history_frame_writes_atomically_and_refuses_what_it_cannot_draw(tmp_path):
    mon = watched()
    path = attnprobe.reports.monitor_html(mon.history, tmp_path / "run.html", alerts=mon.alerts, stats="entropy")
    assert path.read_text().startswith("<!doctype html>") and "No alert fired" in path.read_text()
    with pytest.raises(FileExistsError):
        attnprobe.reports.monitor_html(mon.history, path)
    assert attnprobe.reports.monitor_html(mon.history, path, overwrite=True) == path
    with pytest.raises(ValueError, match="no statistic 'loss'.*entropy_min"):
        attnprobe.reports.monitor_html(mon, stats=("loss",))
    with pytest.raises(TypeError, match="mon.history"):
        attnprobe.reports.monitor_html([1, 2, 3])
    with pytest.raises(ValueError, match="no step, layer, head column"):
        attnprobe.reports.monitor_html(mon.history.drop(columns=["step", "layer", "head"]))


def test_monitor_page_in_chromium_draws_one_line_per_layer_and_shows_the_alerts(tmp_path, open_report):
    mon = watched(alerts={"entropy_below": 1.4, "max_score_above": 0.5})
    history = mon.history.copy()
    history.loc[history["step"] == 4, "max_score_max"] = math.nan  # a gap: the line breaks, the page does not fail
    path = attnprobe.reports.monitor_html(history, tmp_path / "monitor.html", alerts=mon.alerts)
    page = open_report(path)
    wait_until(page.page, "() => window.attnprobe.plots.entropy_min !== undefined")
    page.assert_clean()  # no request beyond the file itself, no console or page error
    for stat in ("entropy_min", "max_score_max", "entropy"):
        assert page.page.locator(f"#plot-{stat} svg g.series").count() == 3  # one line per layer
        labels = page.page.locator(f"#plot-{stat} svg g.series").evaluate_all("gs => gs.map(g => g.dataset.label)")
        assert labels == ["layer 0", "layer 1", "layer 2"]
    assert page.page.locator("#plot-max_score_max g.series").first.locator("polyline").count() == 2  # broken at step 4
    # per head on demand
    page.page.select_option("#monitor-by", "layer 1")
    wait_until(page.page, "() => window.attnprobe.plots.entropy.by === 'layer 1'")
    assert page.page.locator("#plot-entropy svg g.series").count() == 2
    assert page.page.locator("#plot-entropy .monitor-legend").text_content() == "layer 1 head 0layer 1 head 1"
    # the alerts table
    rows = page.page.locator("#alerts tr.alert-row")
    assert rows.count() > 0
    assert "entropy_below" in page.page.locator("#alerts").text_content()
    assert page.page.locator("#plot-entropy line.alert-mark").count() >= 1
    # hovering reads the values at a step
    plot = page.page.locator("#plot-entropy svg")
    box = plot.bounding_box()
    plot.hover(position={"x": box["width"] - 20, "y": box["height"] / 2})
    assert "at step 10" in page.page.locator("#plot-entropy .monitor-readout").text_content()
    page.assert_clean()
