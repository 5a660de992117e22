"""The monitor's HTML page (``attnprobe.reports.monitor_html``): its data, its refusals, and the page in Chromium."""

from __future__ import annotations

import json
import math
import re
import warnings

import pytest
import torch
from reports_helpers import browser, open_report, wait_until  # noqa: F401  (the shared browser fixtures)
from torch import nn

import attnprobe
from attnprobe.probe.errors import AttnprobeWarning


class Layers(nn.Module):
    def __init__(self, layers=3, heads=2, d=8):
        super().__init__()
        self.layers = nn.ModuleList(
            attnprobe.MultiHeadAttention(d, num_heads=heads, causal=True) for _ in range(layers)
        )

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
    with pytest.raises(ValueError, match=r"no statistic 'loss'.*entropy_min"):
        attnprobe.reports.monitor_html(mon, stats=("loss",))
    with pytest.raises(TypeError, match=r"mon\.history"):
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


# ------------------------------------------------------------------------ the Monitor section of a capture's report
def programs_and_csp(page: str) -> tuple[list[str], str]:
    """The page's inline programs (script elements without a type) and its Content-Security-Policy."""
    programs = re.findall(r"<script>(.*?)</script>", page, re.S)
    csp = re.search(r'http-equiv="Content-Security-Policy" content="([^"]*)"', page).group(1).replace("&#39;", "'")
    return programs, csp


def script_hashes(csp: str) -> list[str]:
    script_src = next(part for part in csp.split(";") if part.strip().startswith("script-src")).split()[1:]
    return script_src


def sha256(text: str) -> str:
    import base64
    import hashlib

    return "'sha256-" + base64.b64encode(hashlib.sha256(text.encode()).digest()).decode() + "'"


def small_capture(assert_no_hooks, **options):
    torch.manual_seed(1)
    model = Layers(layers=2, heads=2)
    _, cap = attnprobe.run(model, torch.randn(1, 5, 8), **options)
    assert_no_hooks(model)
    return cap


def test_report_with_a_monitor_pins_both_scripts_and_without_one_is_as_before(assert_no_hooks):
    cap = small_capture(assert_no_hooks)
    mon = watched(alerts={"entropy_below": 1.4})
    plain = attnprobe.reports.to_html(cap)
    page = attnprobe.reports.to_html(cap, monitor=mon)
    # with a monitor: two programs (report.js, monitor.js), each pinned by its own hash, nothing else allowed
    programs, csp = programs_and_csp(page)
    assert len(programs) == 2 and "window.attnprobeMonitor" in programs[1]
    assert script_hashes(csp) == [sha256(programs[0]), sha256(programs[1])]
    assert "unsafe-inline" not in " ".join(script_hashes(csp)) and "unsafe-eval" not in csp
    assert '<section id="monitor">' in page and '<a href="#monitor">Monitor</a>' in page
    monitor_meta = json.loads(re.search(r'id="attnprobe-monitor-meta">(.*?)</script>', page, re.S).group(1))
    assert monitor_meta == page_meta(attnprobe.reports.monitor_html(mon))  # the same data as the monitor's own page
    assert page.count('class="alert-row"') == len(monitor_meta["alerts"]) > 0
    # without: one program, one hash, no trace of a monitor
    programs, csp = programs_and_csp(plain)
    assert len(programs) == 1 and script_hashes(csp) == [sha256(programs[0])]
    assert "monitor" not in plain.lower()
    # the monitor's own page is still one program
    programs, csp = programs_and_csp(attnprobe.reports.monitor_html(mon))
    assert len(programs) == 1 and script_hashes(csp) == [sha256(programs[0])]


def test_report_refuses_what_is_not_a_monitor(assert_no_hooks, tmp_path):
    cap = small_capture(assert_no_hooks)
    mon = watched()
    with pytest.raises(TypeError, match=r"to_html\(monitor=\) takes a monitor .*mon.history.*not list"):
        attnprobe.reports.to_html(cap, monitor=[1, 2])
    with pytest.raises(TypeError, match=r"to_html\(monitor=\) takes .* not str"):
        attnprobe.reports.to_html(cap, monitor="run.parquet")
    with pytest.raises(ValueError, match="no step, layer, head column"):
        attnprobe.reports.to_html(cap, monitor=mon.history.drop(columns=["step", "layer", "head"]))
    with pytest.raises(ValueError, match="no statistic 'loss'"):
        attnprobe.reports.to_html(cap, monitor=mon, monitor_stats=("loss",))
    with pytest.raises(TypeError, match="monitor_alerts= takes the monitor's alerts frame"):
        attnprobe.reports.to_html(cap, monitor=mon.history, monitor_alerts={"entropy_below": 1.0})
    with pytest.raises(TypeError, match="monitor_stats= was given without monitor="):
        attnprobe.reports.to_html(cap, monitor_stats="entropy")
    with pytest.raises(TypeError, match="monitor_alerts= was given without monitor="):
        attnprobe.reports.to_html(cap, monitor_alerts=mon.alerts)
    assert not list(tmp_path.iterdir())


def test_report_with_a_monitor_in_chromium_draws_the_grid_and_the_monitor(tmp_path, open_report, assert_no_hooks):
    cap = small_capture(assert_no_hooks)
    mon = watched(alerts={"entropy_below": 1.4})
    path = attnprobe.reports.to_html(cap, tmp_path / "report.html", monitor=mon.history, monitor_alerts=mon.alerts)
    opened = open_report(path)  # waits for window.attnprobe.ready: the report's script
    page = opened.page
    wait_until(
        page, "() => window.attnprobeMonitor !== undefined && window.attnprobeMonitor.plots.entropy !== undefined"
    )
    page.evaluate("window.attnprobeMonitor.ready")
    wait_until(page, "() => document.querySelectorAll('a.thumb canvas[data-drawn]').length === 4")  # 2 layers x 2 heads
    opened.assert_clean()  # report.js: no error; no request, no console error
    assert page.evaluate("window.attnprobeMonitor.errors") == []
    assert page.evaluate("window.attnprobe.plots") is None  # each script keeps to its own API
    for stat in ("entropy_min", "max_score_max", "entropy"):
        labels = page.locator(f"#monitor #plot-{stat} svg g.series").evaluate_all("gs => gs.map(g => g.dataset.label)")
        assert labels == ["layer 0", "layer 1", "layer 2"]  # one line per layer of the monitored model
    page.select_option("#monitor-by", "layer 2")
    wait_until(page, "() => window.attnprobeMonitor.plots.entropy.by === 'layer 2'")
    assert page.locator("#plot-entropy svg g.series").count() == 2
    assert page.locator("#monitor-alerts tr.alert-row").count() > 0
    assert "entropy_below" in page.locator("#monitor-alerts").text_content()
    page.click('a[href="#monitor"]')
    page.click('a.thumb[data-rid="1"][data-head="0"]')  # the report's own views still work beside it
    wait_until(page, "() => window.attnprobe.state().rid === 1")
    opened.assert_clean()
    assert page.evaluate("window.attnprobeMonitor.errors") == []


def test_statistics_report_takes_a_monitor_too(tmp_path, open_report, assert_no_hooks):
    cap = small_capture(assert_no_hooks, keep=("stats",))
    mon = watched()
    page = attnprobe.reports.to_html(cap, monitor=mon, monitor_stats="entropy_min")
    programs, csp = programs_and_csp(page)
    assert 'data-mode="long"' in page and len(programs) == 2
    assert "built-in method" not in page  # the keys column: the number of keys, not dict.keys
    assert script_hashes(csp) == [sha256(programs[0]), sha256(programs[1])]
    with pytest.raises(TypeError, match=r"to_html\(monitor=\) takes"):
        attnprobe.reports.to_html(cap, monitor=3)
    path = tmp_path / "long.html"
    path.write_text(page)
    opened = open_report(path)  # the long report's own script is ready
    wait_until(
        opened.page,
        "() => window.attnprobeMonitor !== undefined && window.attnprobeMonitor.plots.entropy_min !== undefined",
    )
    assert opened.page.locator("#monitor #plot-entropy_min svg g.series").count() == 3
    assert opened.page.locator("#monitor .monitor-plot").count() == 1
    opened.assert_clean()
    assert opened.page.evaluate("window.attnprobeMonitor.errors") == []
