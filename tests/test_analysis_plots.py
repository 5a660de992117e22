"""reports.analysis_plots: the eviction, attribution and span figures draw what they are given (ax=None convention)."""

from __future__ import annotations

import pytest
import torch
from matplotlib.figure import Figure

import attnprobe
from attnprobe.probe.analyses import spans
from attnprobe.probe.analyses.eviction import eviction_profile
from attnprobe.probe.analyses.rollout import rollout
from attnprobe.probe.engine.kept_mass import EvictionPlan
from attnprobe.reports.analysis_plots import attribution_plot, eviction_plot, span_plot


@pytest.fixture(scope="module")
def cap():
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[attnprobe.MultiHeadAttention(8, num_heads=2, causal=True) for _ in range(2)])
    with torch.no_grad(), attnprobe.capture(model, keep=("weights",)) as cap:
        model(torch.randn(1, 48, 8))
    return cap


def test_eviction_plot_draws_one_line_per_policy_with_the_mean_over_heads(cap):
    profile = eviction_profile(cap, budgets=[2, 4, 8, 16], plan=EvictionPlan(observe=8, window=4))
    ax = eviction_plot(profile, ax=Figure().add_subplot())
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines) == ["streaming", "h2o", "snapkv", "oracle"]
    want = profile[profile.policy == "oracle"].groupby("budget")["kept"].mean()
    assert list(lines["oracle"].get_xdata()) == [2, 4, 8, 16]
    assert list(lines["oracle"].get_ydata()) == pytest.approx(list(want))
    assert ax.get_xscale() == "log"
    one = eviction_plot(profile, layers=[1], heads=[0], ax=Figure().add_subplot())
    got = profile[(profile.layer == 1) & (profile["head"] == 0) & (profile.policy == "h2o")]["kept"].tolist()
    assert list(one.get_lines()[1].get_ydata()) == pytest.approx(got)
    with pytest.raises(ValueError, match="select none"):
        eviction_plot(profile, layers=[7], ax=Figure().add_subplot())
    with pytest.raises(TypeError, match="eviction_profile"):
        eviction_plot(cap, ax=Figure().add_subplot())


def test_attribution_and_span_plots(cap):
    ax = attribution_plot(rollout(cap), ax=Figure().add_subplot())
    assert ax.get_images()[0].get_array().shape == (48, 48) and "layer 1" in ax.get_title()
    table = spans.attention(cap, spans.ranges({"a": (0, 16), "b": (16, 48)}))
    ax = span_plot(table, layer=1, head=0, ax=Figure().add_subplot())
    grid = ax.get_images()[0].get_array()
    assert grid.shape == (2, 2) and float(grid[0, 0]) == pytest.approx(1.0)  # causal: a sees only a
    assert [t.get_text() for t in ax.texts][:2] == ["1.00", "0.00"]
    with pytest.raises(ValueError, match="no rows for layer 5"):
        span_plot(table, layer=5, ax=Figure().add_subplot())
