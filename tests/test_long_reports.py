"""Long inputs: pooled overviews and exact windows from the statistics engine, the CLI's statistics mode
(--stats, and the switch to it when a full capture would not fit), and the long-input report in Chromium."""

from __future__ import annotations

import json
import math
import re

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from reports_helpers import browser, open_report, wait_until  # noqa: F401  (the shared browser fixtures)

import attnprobe
from attnprobe.cli import main
from attnprobe.probe.engine.pooling import pool_weights
from attnprobe.probe.engine.stats import Overview
from attnprobe.probe.errors import SelectionError
from attnprobe.reports import encoding
from attnprobe.reports.long import ROW_PLOTS

transformers = pytest.importorskip("transformers")


def tiny_llama(tokens: int, *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        vocab_size=100,
        max_position_embeddings=tokens,
    )
    return transformers.LlamaModel._from_config(config, attn_implementation="sdpa").eval()


def naive_pool(w: np.ndarray, rq: int, rk: int) -> tuple[np.ndarray, np.ndarray]:
    """Max and mean of every (rq x rk) cell of a full (B, h, Tq, Tk) matrix, written independently of Pooler."""
    B, h, Tq, Tk = w.shape
    nq, nk = math.ceil(Tq / rq), math.ceil(Tk / rk)
    mx, mean = np.zeros((B, h, nq, nk)), np.zeros((B, h, nq, nk))
    for i in range(nq):
        for j in range(nk):
            cell = w[:, :, i * rq : (i + 1) * rq, j * rk : (j + 1) * rk]
            mx[:, :, i, j] = cell.max(axis=(-1, -2))
            mean[:, :, i, j] = cell.mean(axis=(-1, -2))
    return mx, mean


# ------------------------------------------------------------------------------------- engine pooling
@pytest.mark.parametrize("block_bytes", [None, 1 << 13])  # 1 << 13: rows and keys both in many blocks
def test_pooled_overview_and_windows_equal_a_full_captures_weights(block_bytes, assert_no_hooks):
    T = 151  # cells of 10 (and 5) tokens: the last one is short
    llama = tiny_llama(T)
    ids = torch.randint(0, 100, (2, T))
    mask = torch.ones(2, T, dtype=torch.long)
    mask[1, :23] = 0  # left padding: masked keys, rows the engine must still pool
    windows = ((0, 40, 0, 40), (140, 151, 3, 151), (17, 18, 0, 151))
    for cells in (16, 32):
        overview = Overview(cells=cells, windows=windows)
        with (
            torch.no_grad(),
            attnprobe.capture(llama, keep=("stats",), overview=overview, block_bytes=block_bytes) as cap,
        ):
            llama(input_ids=ids, attention_mask=mask)
        with torch.no_grad(), attnprobe.capture(llama, keep=("weights",)) as full:
            llama(input_ids=ids, attention_mask=mask)
        assert_no_hooks(llama)
        size = math.ceil(T / cells)
        for rec, ref in zip(cap, full):
            assert rec.weights is None and rec.meta["stats_source"] == "blockwise"
            w = ref.weights.double().numpy()
            mx, mean = naive_pool(w, size, size)
            assert rec.stats["overview_max"].shape == (2, 4, math.ceil(T / size), math.ceil(T / size))
            np.testing.assert_allclose(rec.stats["overview_max"].numpy(), mx, rtol=1e-5, atol=1e-7)
            np.testing.assert_allclose(rec.stats["overview_mean"].numpy(), mean, rtol=1e-5, atol=1e-8)
            assert rec.meta["stats_windows"] == [list(x) for x in windows]
            for i, (q0, q1, k0, k1) in enumerate(windows):
                np.testing.assert_allclose(
                    rec.stats[f"window_{i}"].numpy(), w[:, :, q0:q1, k0:k1], rtol=1e-5, atol=1e-7
                )
            # a padded row (batch 1, query 0) attends nothing but itself under HF's mask: its window row says so
            assert float(rec.stats["window_2"][0].sum(-1).max()) == pytest.approx(1.0, abs=1e-5)


def test_pool_weights_of_a_full_tensor_matches_the_naive_pooling():
    torch.manual_seed(1)
    w = torch.rand(2, 3, 37, 29)
    out = pool_weights(w, Overview(cells=8, windows=((5, 9, 2, 29),)), rows_per_block=3)
    mx, mean = naive_pool(w.double().numpy(), 5, 4)
    np.testing.assert_allclose(out["overview_max"].numpy(), mx, rtol=1e-6)
    np.testing.assert_allclose(out["overview_mean"].numpy(), mean, rtol=1e-6)
    assert torch.equal(out["window_0"], w[:, :, 5:9, 2:29])


def test_own_modules_get_overviews_from_their_weights():
    attn = attnprobe.MultiHeadAttention(16, num_heads=2, causal=True)
    x = torch.randn(1, 50, 16)
    with attnprobe.capture(attn, keep=("stats",), overview=Overview(cells=10, windows=((3, 7, 0, 50),))) as cap:
        attn(x)
    with attnprobe.capture(attn, keep=("weights",)) as full:
        attn(x)
    mx, mean = naive_pool(full[0].weights.double().numpy(), 5, 5)
    assert cap[0].meta["stats_source"] == "weights"
    np.testing.assert_allclose(cap[0].stats["overview_max"].numpy(), mx, rtol=1e-6)
    np.testing.assert_allclose(cap[0].stats["overview_mean"].numpy(), mean, rtol=1e-6)
    assert torch.equal(cap[0].stats["window_0"], full[0].weights[:, :, 3:7])
    assert attnprobe.check(cap, causal=True).ok  # the checks read only the per-row statistics


@pytest.mark.parametrize(
    "options, message",
    [
        ({"keep": ("weights",), "overview": 64}, 'add "stats" to keep='),
        ({"keep": ("stats",), "overview": "big"}, "overview= takes a number of cells"),
    ],
)
def test_bad_overview_requests_are_refused(options, message):
    with pytest.raises(SelectionError, match=re.escape(message)):
        attnprobe.capture(torch.nn.Identity(), **options)
    with pytest.raises(ValueError, match="0 <= q0 < q1"):
        Overview(windows=((5, 5, 0, 1),))


# ------------------------------------------------------------------------------------------------ CLI
TINY = "cli_factories:tiny"
LONG_IDS = ["--ids", " ".join(str(i % 50) for i in range(64))]


@pytest.fixture
def cli(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return lambda *args: CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def test_check_switches_to_statistics_when_a_full_capture_would_pass_max_bytes(cli):
    # 2 layers x 4 heads x 64 x (2 x 64 + 4 x 4) float32 = 288 KiB full; the statistics are far below 150 KB
    result = cli("check", TINY, *LONG_IDS, "--max-bytes", "150KB", "--causal", "-q")
    assert result.exit_code == 0, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnprobe: a full capture of this input needs at least 288.0 KiB")
    assert "more than --max-bytes 150KB" in lines[0] and "used the statistics mode" in lines[0]
    assert "causal" in result.stdout
    quiet = cli("check", TINY, *LONG_IDS, "--max-bytes", "150KB", "--causal", "--stats", "-q")
    assert quiet.exit_code == 0 and quiet.stderr == ""  # asked for: nothing to say
    fits = cli("check", TINY, *LONG_IDS, "--max-bytes", "1MB", "-q")
    assert fits.exit_code == 0 and fits.stderr == ""
    refused = cli("check", TINY, *LONG_IDS, "--max-bytes", "150KB", "--full", "-q")
    assert refused.exit_code == 2 and "capture budget exceeded" in refused.stderr


def test_check_stats_finds_a_leaky_mask(cli):
    result = cli("check", "cli_factories:leaky", *LONG_IDS, "--stats", "--causal", "--format", "json", "-q")
    assert result.exit_code == 1
    assert any(v["check"] == "causal" for v in json.loads(result.stdout)["violations"])


def test_report_switches_by_itself_and_writes_the_long_report(cli, tmp_path):
    # 300 tokens: 5.6 MiB full; statistics, 150 x 150-cell overviews and two 128 x 128 windows about 2.6 MB
    ids = ["--ids", " ".join(str(i % 50) for i in range(300))]
    result = cli("report", TINY, *ids, "--max-bytes", "4MB", "--out", "r.html", "-q")
    assert result.exit_code == 0, result.output
    assert len(result.stderr.strip().splitlines()) == 1 and "statistics mode" in result.stderr
    page = (tmp_path / "r.html").read_text()
    assert 'data-mode="long"' in page and "no (query x key) matrix was stored or made" in page
    meta = json.loads(re.search(r'id="attnprobe-meta">(.*?)</script>', page, re.S).group(1))
    rec = meta["records"][0]
    assert rec["queries"] == 300 and rec["cells"] == [150, 150] and rec["cellSize"] == [2, 2]
    assert rec["windows"] == [[0, 128, 0, 128], [172, 300, 172, 300]]


def test_report_window_is_computed_exactly_for_png_and_html(cli, tmp_path):
    result = cli("report", TINY, *LONG_IDS, "--window", "10:20,0:30", "--format", "all", "--out", "out", "-q")
    assert result.exit_code == 0, result.output
    assert result.stderr == ""  # --window asked for the statistics mode: nothing switched by itself
    assert (tmp_path / "out" / "report.html").exists() and (tmp_path / "out" / "heads.png").exists()
    page = next((tmp_path / "out").glob("*.html")).read_text()
    meta = json.loads(re.search(r'id="attnprobe-meta">(.*?)</script>', page, re.S).group(1))
    rec = meta["records"][1]
    assert rec["windows"] == [[10, 20, 0, 30]]
    blob = re.search(rf'id="{rec["heads_data"][2]["windows"][0]}">([^<]*)<', page).group(1)
    shown = encoding.decode_floats(blob, 10 * 30, "exact").reshape(10, 30)
    # the same window of a full capture of the same model and input
    import cli_factories

    net = cli_factories.tiny()
    ids = torch.tensor([[i % 50 for i in range(64)]])
    with torch.no_grad(), attnprobe.capture(net, keep=("weights",)) as full:
        net(ids)
    np.testing.assert_allclose(shown, full[1].weights[0, 2, 10:20, 0:30].numpy(), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--window", "0:99,0:4"], "--window '0:99,0:4' is outside the input (64 queries x 64 keys)"),
        (["--window", "0-9"], "write query rows and keys as Q0:Q1,K0:K1"),
        (["--window", "0:9,0:9", "--full"], "--window and --cells belong to the statistics mode"),
        (["--cells", "600"], "600 is not in the range 1<=x<=512"),
    ],
)
def test_bad_window_or_cells_is_one_line(cli, args, message):
    result = cli("report", TINY, *LONG_IDS, *args, "-q")
    assert result.exit_code == 2
    assert message in result.stderr and "Traceback" not in result.output
    if "range" not in message:  # click's own usage errors come with its usage lines
        assert len(result.stderr.strip().splitlines()) == 1, result.stderr


# -------------------------------------------------------------------------------------------- browser
def long_report(tmp_path, tokens: int, name: str):
    llama = tiny_llama(tokens)
    ids = torch.randint(0, 100, (1, tokens))
    n = 64
    overview = Overview(cells=128, windows=((0, n, 0, n), (tokens - n, tokens, tokens - n, tokens)))
    with torch.no_grad(), attnprobe.capture(llama, keep=("stats",), overview=overview) as cap:
        llama(input_ids=ids)
    return cap, attnprobe.reports.to_html(cap, tmp_path / name)


def test_long_report_opens_in_chromium_and_its_size_grows_as_the_input(tmp_path, open_report):
    _, small = long_report(tmp_path, 1024, "small.html")
    cap, path = long_report(tmp_path, 2048, "long.html")
    heads = sum(len(r.heads) for r in cap)
    # the size: a fixed part (overviews, windows: no larger with more tokens) plus the per-row statistics
    per_row_head = (path.stat().st_size - small.stat().st_size) / 1024 / heads
    assert per_row_head <= len(ROW_PLOTS) * 4 * 4 / 3 * 1.02  # at most float32 in base64 per row, statistic, head
    fixed = small.stat().st_size - per_row_head * 1024 * heads
    # scaled to the benchmark's 32k tokens and 4 x 8 heads at 128 cells (the same overview and window sizes as here
    # per head, windows 2 x 128 x 128 instead of 2 x 64 x 64): under 30 MB
    at_32k = fixed / heads * 32 * 4 + per_row_head * 32768 * 32
    assert at_32k < 30e6, f"{at_32k / 1e6:.1f} MB at 32k tokens"

    page = open_report(path)
    wait_until(page.page, "() => Object.keys(window.attnprobe.drawn).length >= 1")
    page.page.evaluate("Promise.all(Object.values(window.attnprobe.drawn))")
    page.assert_clean()
    first = page.page.locator("details.long-head").first
    canvases = first.locator("canvas")
    assert canvases.count() == 2 + len(ROW_PLOTS) + 2  # max and mean, the row plots, two windows
    # hover the second window (the last 64 x 64) at its last row and first key: the exact weight
    window = canvases.nth(2 + len(ROW_PLOTS) + 1)
    box = window.bounding_box()
    window.hover(position={"x": 0.5 * box["width"] / 64, "y": box["height"] - 0.5 * box["height"] / 64})
    text = page.page.locator(".long-readout").first.text_content()
    match = re.search(r"query (\d+), key (\d+) = (\S+)", text)
    assert match and (int(match.group(1)), int(match.group(2))) == (2047, 1984), text
    want = cap[0].stats["window_1"][0, 0, 63, 0].item()
    assert np.float32(float(match.group(3))) == np.float32(want)
    # another head draws on demand
    page.page.locator("details.long-head summary").nth(5).click()
    wait_until(page.page, "() => Object.keys(window.attnprobe.drawn).length >= 2")
    page.page.evaluate("Promise.all(Object.values(window.attnprobe.drawn))")
    page.assert_clean()
