"""The HTML report in a real browser (Debian's Chromium, headless, offline, opened from file://)."""

from __future__ import annotations

import json

import numpy as np
import torch
from reports_helpers import (  # noqa: F401  (browser and open_report: fixtures)
    Stack,
    browser,
    canvas_colours,
    cross_capture,
    generation_capture,
    hover_cell,
    open_report,
    stack_capture,
    wait_until,
    words,
)

import attnprobe
from attnprobe import CheckResult, Violation
from attnprobe.reports import diff_html, to_html

# wait_for_function predicates are written as functions ("() => ..."): for a bare expression Playwright calls
# eval() on every poll, which the report's Content-Security-Policy forbids, so a predicate not yet true at the
# first try (a loaded machine) failed with an EvalError instead of waiting.


def as_float32(text: str) -> np.float32:
    return np.float32(float(text))


def test_grid_and_head_view_render_exact_values_offline(tmp_path, open_report, assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=3, heads=3, length=7)
    path = to_html(cap, tmp_path / "report.html", tokens=words(7), batch=0)
    report = open_report(path)
    page = report.page
    # every head has a thumbnail, and the thumbnails are drawn (lazily, once visible)
    assert page.locator("a.thumb").count() == 9
    wait_until(page, "() => document.querySelectorAll('a.thumb canvas[data-drawn]').length === 9")
    assert canvas_colours(page, 'a.thumb[data-rid="1"][data-head="2"] canvas') >= 4
    # opening a head by clicking its thumbnail draws the matrix
    page.click('a.thumb[data-rid="1"][data-head="2"]')
    wait_until(page, "() => window.attnprobe.state().head === 2 && window.attnprobe.state().rid === 1")
    assert "layer 1" in page.text_content("#detail-title") and "head 2" in page.text_content("#detail-title")
    page.wait_for_timeout(100)  # one animation frame
    assert canvas_colours(page, "#viewers canvas.view") > 10
    # the cell under the pointer shows its exact stored values
    rec = cap[1]
    for q, k in ((4, 3), (6, 6), (5, 2)):
        readout = hover_cell(page, q, k)
        row = readout["rows"][0]
        assert as_float32(row["weight"]) == rec.weights[0, 2, q, k].item(), (q, k, row)
        assert as_float32(row["score"]) == rec.scores[0, 2, q, k].item(), (q, k, row)
        assert readout["q"] == json.dumps(f"w{q}") and readout["k"] == json.dumps(f"w{k}")
    # a masked cell says so, and its (never used) score is not claimed
    readout = hover_cell(page, 2, 5)
    assert "masked" in readout["rows"][0]["notes"] and readout["rows"][0]["score"] == "not stored (masked)"
    assert readout["rows"][0]["weight"] == "0"
    # a padded query row (batch row 0 is left-padded by two) is marked
    assert "padded query row" in hover_cell(page, 0, 0)["rows"][0]["notes"]
    # click pins a cell; the arrow keys move the pin; the pinned cell stays while the pointer leaves
    point = page.evaluate("window.attnprobe.cellCenter(4, 2)")
    page.mouse.click(point["x"], point["y"])
    page.keyboard.press("ArrowRight")
    page.mouse.move(0, 0)
    assert page.text_content("#readout .k-token") == json.dumps("w3")
    assert as_float32(page.text_content("#readout td.weight")) == rec.weights[0, 2, 4, 3].item()
    # colouring by score repaints the matrix with another scale
    before = page.evaluate("document.querySelector('#viewers canvas.view').toDataURL()")
    page.select_option("#colour-by", "scores")
    page.wait_for_timeout(100)
    assert page.evaluate("document.querySelector('#viewers canvas.view').toDataURL()") != before
    assert "score" in page.text_content("#colourbars")
    report.assert_clean()


def test_detail_title_names_the_batch_row_it_shows(tmp_path, open_report, assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=2, heads=2, length=5)
    report = open_report(to_html(cap, tmp_path / "row1.html", tokens=words(5), batch=1))
    page = report.page
    page.click('a.thumb[data-rid="1"][data-head="0"]')
    wait_until(
        page,
        "() => window.attnprobe.state().rid === 1 && !document.querySelector('#detail-title')"
        ".textContent.includes('loading')",
    )
    title = page.text_content("#detail-title")
    assert "layer 1" in title and "head 0" in title and "batch row 1" in title, title
    assert "--batch" in page.text_content("#overview")  # how to pick another row, also from the command line
    readout = hover_cell(page, 3, 1)  # and the matrix is that row's
    assert as_float32(readout["rows"][0]["weight"]) == cap[1].weights[1, 0, 3, 1].item()
    assert cap[1].weights[1, 0, 3, 1].item() != cap[1].weights[0, 0, 3, 1].item()
    report.assert_clean()


HOSTILE = [
    "<script>window.__pwned = 1</script>",
    '"><img src=x onerror="window.__pwned = 2">',
    "</script><script>window.__pwned = 3</script>",
    "<!--",
    "{{ 7 * 7 }}",
    "${window.__pwned = 4}",
    "<b>bold</b>",
    "&amp; &lt;",
]


def test_hostile_tokens_show_as_text_and_never_run(tmp_path, open_report, assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=1, heads=2, length=len(HOSTILE), batch=1, padded=False)
    title = '<img src=x onerror="window.__pwned = 5"> report'
    path = to_html(cap, tmp_path / "hostile.html", tokens=HOSTILE, title=title)
    report = open_report(path, "#head-0-1")
    page = report.page
    wait_until(page, "() => window.attnprobe.state().head === 1")
    assert page.evaluate("window.__pwned") is None
    assert page.locator("img").count() == 0 and page.locator("b:text('bold')").count() == 0
    # the document has exactly the report's own scripts: the data blocks and the one program
    kinds = page.evaluate("Array.from(document.scripts).map(s => s.type || 'js')")
    assert kinds.count("js") == 1 and set(kinds) <= {"js", "application/json", "application/x-attnprobe-blob"}
    # tokens appear verbatim as text: in the token list, and in the readout of a hovered cell
    shown = page.evaluate("Array.from(document.querySelectorAll('.tokenlist .tok')).map(e => e.textContent)")
    assert shown == HOSTILE
    assert page.title() == title
    for q in range(len(HOSTILE)):
        readout = hover_cell(page, q, 0)
        assert readout["q"] == f'"{HOSTILE[q]}"' and readout["k"] == f'"{HOSTILE[0]}"'
    assert page.evaluate("window.__pwned") is None
    report.assert_clean()


def test_cross_attention_has_query_and_key_tokens_on_their_own_axes(tmp_path, open_report, assert_no_hooks):
    cap = cross_capture(assert_no_hooks, queries=5, keys=9)
    queries, keys = words(5, "dec"), words(9, "enc")
    path = to_html(cap, tmp_path / "cross.html", tokens=queries, key_tokens=keys)
    cross = next(i for i, r in enumerate(cap) if r.kind == "cross")
    report = open_report(path, f"#head-{cross}-1")
    page = report.page
    wait_until(page, f"() => window.attnprobe.state().rid === {cross}")
    assert "context" in page.text_content("#viewers .vtitle")
    key_chips = page.evaluate("Array.from(document.querySelectorAll('.tokenlist .tok.key')).map(e => e.textContent)")
    assert key_chips == keys
    rec = cap[cross]
    readout = hover_cell(page, 3, 6)
    assert readout["q"] == json.dumps("dec3") and readout["k"] == json.dumps("enc6")
    assert as_float32(readout["rows"][0]["weight"]) == rec.weights[0, 1, 3, 6].item()
    assert "masked" in hover_cell(page, 1, 8)["rows"][0]["notes"]  # padded context key
    # the token view: the decoder's query tokens and the context's key tokens, two rows of their own
    page.evaluate(f"window.attnprobe.openTokens({cross})")
    assert page.locator("#tv-body .tv-tok.q .text").all_text_contents() == queries
    assert page.locator("#tv-body .tv-tok.k .text").all_text_contents() == keys
    assert "context" in page.text_content("#tv-body .tv-col.k .vtitle")
    hover_token(page, "q", 2)
    rows = token_view_readout(page)["rows"]
    for h in (0, 1):
        for i, text in rows[str(h)]:
            assert as_float32(text) == rec.weights[0, h, 2, i].item()
            assert i < 7  # the two padded context keys carry no weight, so are never among the top
    report.assert_clean()


def test_generation_capture_shows_the_stitched_matrix(tmp_path, open_report, assert_no_hooks):
    steps, full = generation_capture(assert_no_hooks, length=8, prefill=4)
    path = to_html(steps, tmp_path / "gen.html", tokens=words(8))
    report = open_report(path, "#head-1-1")
    page = report.page
    wait_until(page, "() => window.attnprobe.state().rid === 1")
    assert "stitched" in page.text_content("#grid-body") and "5 generation steps stitched" in page.text_content(
        "#detail-title"
    )
    assert page.locator("a.thumb").count() == 4  # two layers x two heads, not one per step
    rec = full.record(1)
    for q, k in ((6, 2), (7, 7), (3, 0)):  # rows from decode steps and from the prefill
        assert as_float32(hover_cell(page, q, k)["rows"][0]["weight"]) == rec.weights[0, 1, q, k].item()
    report.assert_clean()


def test_checks_panel_highlights_and_links_violating_heads(tmp_path, open_report, assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=2, heads=3, length=6, batch=1, padded=False)
    checks = CheckResult(
        violations=(
            Violation(
                "causal",
                "error",
                "layers.1",
                1,
                head=2,
                batch=0,
                queries=(3,),
                keys=(5,),
                count=1,
                worst=0.25,
                message="weight 0.25 on a future key <script>",
            ),
            Violation(
                "row_sum",
                "warning",
                "layers.0",
                0,
                head=0,
                batch=0,
                queries=(1, 2),
                count=2,
                worst=1e-3,
                message="rows do not sum to one",
            ),
        ),
        checks=("causal", "row_sum"),
        records=2,
    )
    path = to_html(cap, tmp_path / "checks.html", checks=checks)
    report = open_report(path)
    page = report.page
    assert "failed" in page.text_content("#checks .verdict")
    assert page.locator('a.thumb.bad[data-rid="1"][data-head="2"]').count() == 1
    assert page.locator('a.thumb.warned[data-rid="0"][data-head="0"]').count() == 1
    assert page.locator("a.thumb.bad, a.thumb.warned").count() == 2
    assert "<script>" in page.text_content("table.violations")  # a message is text too
    page.click("table.violations a:text('layer 1 head 2')")
    wait_until(page, "() => window.attnprobe.state().rid === 1 && window.attnprobe.state().head === 2")
    assert "1 error(s)" in page.text_content("#head-facts")
    report.assert_clean()


def test_summary_table_sorts_by_a_column(tmp_path, open_report, assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=2, heads=3, length=6)
    report = open_report(to_html(cap, tmp_path / "summary.html"))
    page = report.page
    column = list(cap.summary().columns).index("entropy")

    def entropies():
        return page.evaluate(
            "Array.from(document.querySelectorAll('table.summary tbody tr'))"
            f".map(tr => Number(tr.cells[{column}].dataset.v))"
        )

    header = page.locator("table.summary th", has_text="entropy")
    header.click()
    assert entropies() == sorted(entropies()) and header.get_attribute("aria-sort") == "ascending"
    header.click()
    assert entropies() == sorted(entropies(), reverse=True)
    report.assert_clean()


def test_long_input_renders_scrolls_and_zooms_without_freezing(tmp_path, open_report):
    torch.manual_seed(0)
    attn = attnprobe.MultiHeadAttention(16, num_heads=2, causal=True).eval()
    _, cap = attnprobe.run(attn, torch.randn(1, 1024, 16), keep=["scores", "weights"])
    path = to_html(cap, tmp_path / "long.html", tokens=words(1024))
    # proportionate: no more than the float32 values themselves in base64 (weights + allowed scores)
    values = 2 * (1024 * 1024 + 1024 * 1025 // 2)
    assert path.stat().st_size < values * 4 * 4 / 3
    report = open_report(path)
    page = report.page
    page.evaluate("""() => { window.__longest = 0; new PerformanceObserver(list => { for (const e of list.getEntries())
        window.__longest = Math.max(window.__longest, e.duration); }).observe({type: 'longtask', buffered: true}); }""")
    page.evaluate("window.attnprobe.openHead(0, 1)")
    assert canvas_colours(page, "#viewers canvas.view") > 10
    page.click("#zoom-cells")
    for _ in range(2):
        page.click("#zoom-in")
    assert page.evaluate("window.attnprobe.state().cell") > 30
    page.evaluate(
        "() => { const s = document.querySelector('.scroller');"
        " s.scrollTop = s.scrollHeight; s.scrollLeft = s.scrollWidth; }"
    )
    page.wait_for_timeout(100)
    rec = cap[0]
    for q, k in ((1020, 1000), (1023, 1023), (512, 3)):
        row = hover_cell(page, q, k)["rows"][0]
        assert as_float32(row["weight"]) == rec.weights[0, 1, q, k].item()
        assert as_float32(row["score"]) == rec.scores[0, 1, q, k].item()
    page.click("#zoom-fit")
    # canvases, not one element per cell; no task blocked the page for long
    assert page.evaluate("document.getElementsByTagName('*').length") < 3000
    assert page.evaluate("window.__longest") < 3000
    report.assert_clean()


def test_thinned_token_labels_say_their_positions(tmp_path, open_report):
    torch.manual_seed(0)
    attn = attnprobe.MultiHeadAttention(16, num_heads=1, causal=True).eval()
    _, cap = attnprobe.run(attn, torch.randn(1, 200, 16), keep=["weights"])
    tokens = ["beta", "delta"] * 100  # thinned to every n-th, bare tokens read as neighbours
    report = open_report(to_html(cap, tmp_path / "thin.html", tokens=[tokens]))
    page = report.page
    page.evaluate("""() => { window.__labels = []; const draw = CanvasRenderingContext2D.prototype.fillText;
        CanvasRenderingContext2D.prototype.fillText = function (t, ...rest) { window.__labels.push(String(t));
        return draw.call(this, t, ...rest); }; }""")
    page.evaluate("window.attnprobe.openHead(0, 0)")
    page.click("#zoom-fit")
    page.wait_for_timeout(100)
    assert page.evaluate("window.attnprobe.state().cell") < 5
    drawn = [t for t in page.evaluate("window.__labels") if "beta" in t or "delta" in t]
    assert len(drawn) > 4
    for label in drawn:  # "10 beta": the position, and the token really at that position
        pos, token = label.split(" ")
        assert tokens[int(pos)] == token, label
    page.evaluate("window.__labels = []")
    page.click("#zoom-cells")  # every row labelled: the tokens alone
    page.wait_for_timeout(100)
    assert {t for t in page.evaluate("window.__labels") if "beta" in t or "delta" in t} == {"beta", "delta"}
    report.assert_clean()


def test_bfloat16_report_says_values_are_rounded(tmp_path, open_report, assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=1, heads=2, length=6, batch=1, padded=False)
    path = to_html(cap, tmp_path / "bf16.html", precision="bfloat16")
    report = open_report(path, "#head-0-0")
    page = report.page
    wait_until(page, "() => window.attnprobe.state().rid === 0")
    readout = hover_cell(page, 4, 2)
    expected = cap[0].weights[0, 0, 4, 2].to(torch.bfloat16).float().item()
    assert as_float32(readout["rows"][0]["weight"]) == expected
    assert "rounded to bfloat16" in readout["text"]
    report.assert_clean()


def test_diff_report_shows_both_captures_and_the_difference_side_by_side(tmp_path, open_report, assert_no_hooks):
    torch.manual_seed(0)
    model = Stack(2, heads=3).eval()
    before = stack_capture(assert_no_hooks, model=model, length=6, batch=1, padded=False)
    with torch.no_grad():  # change head 1 of layer 1 only: its query projection rows
        model.layers[1].q_proj.weight[4:8] *= 3
    after = stack_capture(assert_no_hooks, model=model, length=6, batch=1, padded=False)
    path = diff_html(before, after, tmp_path / "diff.html", labels=("old", "new"), tokens=words(6))
    report = open_report(path)
    page = report.page
    assert page.locator("a.thumb.warned").count() == 1
    assert page.locator('a.thumb.warned[data-rid="1"][data-head="1"]').count() == 1
    first = page.locator("table.summary tbody tr").first  # ranked by the largest change
    assert first.locator("td").nth(0).text_content() == "1" and first.locator("td").nth(2).text_content() == "1"
    page.click('a.thumb[data-rid="1"][data-head="1"]')
    wait_until(page, "() => window.attnprobe.state().viewers === 3")
    page.wait_for_timeout(100)
    for i in range(3):
        assert canvas_colours(page, f"#viewers .viewer:nth-child({i + 1}) canvas.view") > 5
    readout = hover_cell(page, 4, 2, viewer=2)
    names = [r["name"] for r in readout["rows"]]
    assert names == ["old", "new", "difference"]
    w_old, w_new = before[1].weights[0, 1, 4, 2].item(), after[1].weights[0, 1, 4, 2].item()
    assert as_float32(readout["rows"][0]["weight"]) == w_old and as_float32(readout["rows"][1]["weight"]) == w_new
    assert float(readout["rows"][2]["weight"]) == w_new - w_old
    report.assert_clean()


def test_infinite_change_and_scores_only_capture_render(tmp_path, open_report, assert_no_hooks):
    from dataclasses import replace

    before = stack_capture(assert_no_hooks, layers=1, heads=2, length=5, batch=1, padded=False)
    weights = before[0].weights.clone()
    weights[0, 1, 3, 0] = float("nan")
    after = attnprobe.Capture([replace(before[0], weights=weights)], before.info)
    report = open_report(diff_html(before, after, tmp_path / "diff.html"))
    page = report.page
    caption = page.locator('a.thumb[data-rid="0"][data-head="1"]')
    assert caption.text_content().strip().endswith("inf") and "max |\u0394 weight| inf" in caption.get_attribute(
        "title"
    )
    assert "inf" in page.locator("table.summary tbody tr").first.text_content()  # ranked first, shown as inf
    report.assert_clean()

    scores_only = stack_capture(assert_no_hooks, layers=1, heads=2, length=5, batch=1, keep=["scores"])
    report = open_report(to_html(scores_only, tmp_path / "scores.html"), "#head-0-1")
    page = report.page
    wait_until(page, "() => window.attnprobe.state().viewers === 1")
    assert page.eval_on_selector("#colour-by", "e => e.value") == "scores"
    assert canvas_colours(page, "#viewers canvas.view") > 3
    readout = hover_cell(page, 4, 2)
    assert readout["rows"][0]["weight"] == "not captured"
    assert as_float32(readout["rows"][0]["score"]) == scores_only[0].scores[0, 1, 4, 2].item()
    report.assert_clean()


# ------------------------------------------------------------------------------------------ notebook views
def test_notebook_views_open_offline_and_a_head_opens_on_click(assert_no_hooks, browser, tmp_path):
    cap = stack_capture(assert_no_hooks)
    result = attnprobe.check(cap, causal=True)
    notebook = tmp_path / "notebook.html"  # a page holding the three outputs, as a notebook does
    notebook.write_text(
        "<!doctype html><html><body><h1>cell outputs</h1>"
        f"{cap._repr_html_()}{cap[0]._repr_html_()}{result._repr_html_()}</body></html>"
    )
    page = browser.new_page()
    requests, errors = [], []
    page.on("request", lambda r: requests.append(r.url))
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    try:
        page.goto(notebook.as_uri())
        wait_until(page, "() => document.querySelectorAll('iframe').length === 3")
        page.wait_for_timeout(300)
        reports = [f for f in page.frames[1:] if f.evaluate("() => document.querySelector('#grid') !== null")]
        assert len(reports) == 2
        for frame in reports:
            frame.evaluate("() => window.attnprobe.ready")
        report = reports[0]
        assert report.locator("a.thumb").count() == 9
        report.click('a.thumb[data-rid="1"][data-head="2"]')
        wait_until(report, "() => window.attnprobe.state().head === 2 && window.attnprobe.state().rid === 1")
        assert "layer 1" in report.text_content("#detail-title")
        checks = [f for f in page.frames[1:] if f not in reports]
        assert checks and "passed" in checks[0].text_content("#checks")
        for frame in reports:
            assert frame.evaluate("() => window.attnprobe.errors") == []
        assert not errors, errors
        foreign = [u for u in requests if u != notebook.as_uri() and not u.startswith(("data:", "blob:"))]
        assert foreign == [], foreign
    finally:
        page.close()


def test_bidi_and_invisible_tokens_are_drawn_escaped(tmp_path, browser, assert_no_hooks):
    from test_safety_tokens import ESCAPED, TRICKY

    cap = stack_capture(assert_no_hooks, layers=1, heads=2, length=len(TRICKY), batch=1, padded=False)
    path = to_html(cap, tmp_path / "tricky.html", tokens=TRICKY)
    text = path.read_text(encoding="utf-8")
    assert not any(ch in text for ch in "\u202e\u200b\u2066\u2069\u3164\ufe0f\u200f")  # nowhere in the file
    page = browser.new_page()
    try:
        # record every label the canvases draw
        page.add_init_script("""(() => {
            window.__drawn = [];
            const fill = CanvasRenderingContext2D.prototype.fillText;
            CanvasRenderingContext2D.prototype.fillText = function (t, ...rest) {
                window.__drawn.push(String(t)); return fill.call(this, t, ...rest); };
        })()""")
        page.goto(path.resolve().as_uri() + "#head-0-1")
        page.evaluate("window.attnprobe.ready")
        wait_until(page, "() => window.attnprobe.state().head === 1")
        wait_until(page, "() => window.__drawn.length > 0")
        drawn = set(page.evaluate("window.__drawn"))
        assert set(ESCAPED) <= drawn, drawn
        assert not any(ch in t for t in drawn for ch in "\u202e\u200b\u2066\u3164\ufe0f\u200f")
        shown = page.evaluate("Array.from(document.querySelectorAll('.tokenlist .tok')).map(e => e.textContent)")
        assert shown == ESCAPED
        for q in range(len(TRICKY)):
            readout = hover_cell(page, q, 0)
            assert readout["q"] == f'"{ESCAPED[q]}"' and readout["k"] == f'"{ESCAPED[0]}"'
    finally:
        page.close()


# ------------------------------------------------------------------------------------------ token view
def token_view_readout(page) -> dict:
    """The token view's readout: per head row, its links as (index, exact weight text)."""
    return page.evaluate(
        """() => {
            const box = document.getElementById('tv-readout');
            const rows = {};
            for (const tr of box.querySelectorAll('table.tv-top tr')) {
                rows[tr.dataset.head] = Array.from(tr.querySelectorAll('td.tv-link'))
                    .map(td => [+td.dataset.i, td.dataset.w]);
            }
            const pair = box.querySelector('.tv-pair');
            return {text: box.textContent, rows, pair: pair && pair.textContent};
        }"""
    )


def hover_token(page, side: str, i: int) -> None:
    page.locator(f'#tv-body .tv-tok.{side}[data-i="{i}"]').hover()


def test_token_view_shows_where_a_token_attends_with_exact_weights(tmp_path, open_report, assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=2, heads=3, length=7)
    path = to_html(cap, tmp_path / "report.html", tokens=words(7), batch=0)
    report = open_report(path)
    page = report.page
    wait_until(page, "() => window.attnprobe.tokenView().ready")
    # the first record with weights is shown: one row of query tokens, one of key tokens, a canvas between
    assert page.evaluate("window.attnprobe.tokenView().rid") == 0
    assert page.locator("#tv-body .tv-tok.q").count() == 7 and page.locator("#tv-body .tv-tok.k").count() == 7
    assert page.locator("#tv-body .tv-tok.q .text").all_text_contents() == words(7)
    page.select_option("#tv-record", "1")
    wait_until(page, "() => window.attnprobe.tokenView().rid === 1 && window.attnprobe.tokenView().ready")
    rec = cap[1]
    blank = page.evaluate("document.getElementById('tv-canvas').toDataURL()")
    q = 5
    hover_token(page, "q", q)
    assert page.evaluate("window.attnprobe.tokenView().focus") == {"side": "q", "i": q}
    assert page.evaluate("document.getElementById('tv-canvas').toDataURL()") != blank  # lines were drawn
    readout = token_view_readout(page)
    assert f'query {q} "w{q}" attends to' in readout["text"]
    assert sorted(readout["rows"]) == ["0", "1", "2"]
    for h in range(3):
        w = rec.weights[0, h, q].numpy()
        top = np.argsort(-w, kind="stable")[:5]
        shown = readout["rows"][str(h)]
        # the strongest keys, largest first, each with its exact stored weight
        assert [w[i] for i, _ in shown] == w[top].tolist(), (h, shown, top)
        for i, text in shown:
            assert as_float32(text) == w[i], (h, i, text, w[i])
    # one head: its top keys are outlined in the key row
    page.select_option("#tv-head", "2")
    hover_token(page, "q", q)
    outlined = page.evaluate("Array.from(document.querySelectorAll('#tv-body .tv-tok.k.top')).map(e => +e.dataset.i)")
    w = rec.weights[0, 2, q].numpy()
    assert sorted(outlined) == sorted(i for i in np.argsort(-w, kind="stable")[:5].tolist() if w[i] > 0)
    assert list(token_view_readout(page)["rows"]) == ["2"]
    # the key side: what attends to key 3 (causal: queries 3 and later)
    hover_token(page, "k", 3)
    readout = token_view_readout(page)
    assert 'key 3 "w3" is attended by' in readout["text"]
    for i, text in readout["rows"]["2"]:
        assert as_float32(text) == rec.weights[0, 2, i, 3].item()
    # pin a query, point at a key: the exact weight between them
    page.locator('#tv-body .tv-tok.q[data-i="6"]').click()
    hover_token(page, "k", 4)
    pair = token_view_readout(page)["pair"]
    assert pair.startswith('query 6 "w6" \u2192 key 4 "w4"')
    assert as_float32(pair.split("H2 ")[1]) == rec.weights[0, 2, 6, 4].item()
    report.assert_clean()


def test_token_view_of_a_long_input_points_to_the_heatmap(tmp_path, open_report, assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=1, heads=1, length=300, batch=1, padded=False)
    path = to_html(cap, tmp_path / "long.html")
    report = open_report(path)
    page = report.page
    wait_until(page, "() => !document.getElementById('tv-note').hidden")
    assert "heatmap" in page.text_content("#tv-note") and "300" in page.text_content("#tv-note")
    assert page.locator("#tv-body .tv-tok").count() == 0
    report.assert_clean()


def test_token_view_works_in_the_notebook_view(assert_no_hooks, browser, tmp_path):
    cap = stack_capture(assert_no_hooks, layers=2, heads=2, length=6)
    notebook = tmp_path / "notebook.html"
    notebook.write_text(f"<!doctype html><html><body>{cap[1]._repr_html_()}</body></html>")
    page = browser.new_page()
    errors, requests = [], []
    page.on("request", lambda r: requests.append(r.url))
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    try:
        page.goto(notebook.as_uri())
        wait_until(page, "() => document.querySelectorAll('iframe').length === 1")
        page.wait_for_timeout(300)
        frame = page.frames[1]
        frame.evaluate("() => window.attnprobe.ready")
        wait_until(frame, "() => window.attnprobe.tokenView().ready")
        frame.locator('#tv-body .tv-tok.q[data-i="4"]').hover()
        rows = token_view_readout(frame)["rows"]
        assert sorted(rows) == ["0", "1"]
        for h in (0, 1):
            for i, text in rows[str(h)]:
                assert as_float32(text) == cap[1].weights[0, h, 4, i].item()
        assert frame.evaluate("() => window.attnprobe.errors") == [] and not errors, errors
        assert [u for u in requests if u != notebook.as_uri() and not u.startswith(("data:", "blob:"))] == []
    finally:
        page.close()


def test_batch_row_selector_switches_grid_and_detail(tmp_path, open_report, assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=2, heads=2, length=5, batch=2)
    report = open_report(to_html(cap, tmp_path / "rows.html", tokens=[words(5, "a"), words(5, "b")]))
    page = report.page
    wait_until(page, "() => document.querySelectorAll('a.thumb canvas[data-drawn]').length === 4")
    page.click('a.thumb[data-rid="1"][data-head="0"]')
    wait_until(
        page,
        "() => window.attnprobe.state().rid === 1 && !document.querySelector('#detail-title')"
        ".textContent.includes('loading') && document.querySelector('#detail-title')"
        ".textContent.includes('batch row 0')",
    )
    assert as_float32(hover_cell(page, 3, 1)["rows"][0]["weight"]) == cap[1].weights[0, 0, 3, 1].item()
    thumb = page.evaluate('document.querySelector(\'a.thumb[data-rid="1"][data-head="0"] canvas\').toDataURL()')
    page.select_option("#batch-row", "1")
    wait_until(
        page,
        "() => window.attnprobe.state().batch === 1 && location.hash === '#head-1-0-b1' && "
        "!document.querySelector('#detail-title').textContent.includes('loading') && "
        "document.querySelector('#detail-title').textContent.includes('batch row 1')",
    )
    readout = hover_cell(page, 3, 1)
    assert as_float32(readout["rows"][0]["weight"]) == cap[1].weights[1, 0, 3, 1].item()
    assert readout["q"] == '"b3"'
    # the thumbnails are redrawn for row 1 (the old canvases may still say drawn for a moment: wait for the change)
    wait_until(
        page,
        '() => document.querySelector(\'a.thumb[data-rid="1"][data-head="0"] canvas\').toDataURL() !== '
        + json.dumps(thumb),
    )
    wait_until(page, "() => document.querySelectorAll('a.thumb canvas[data-drawn]').length === 4")
    # a link into another row (the checks table's) switches the row too
    page.evaluate("location.hash = '#head-0-1-b0'")
    wait_until(page, "() => window.attnprobe.state().batch === 0 && window.attnprobe.state().rid === 0")
    assert page.eval_on_selector("#batch-row", "s => s.value") == "0"
    report.assert_clean()


def test_token_view_follows_the_batch_row(tmp_path, open_report, assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=1, heads=2, length=5, batch=2)
    report = open_report(to_html(cap, tmp_path / "rows.html", tokens=[words(5, "a"), words(5, "b")]))
    page = report.page
    wait_until(page, "() => window.attnprobe.tokenView().ready")
    assert page.locator("#tv-body .tv-tok.q .text").all_text_contents() == words(5, "a")
    page.evaluate("window.attnprobe.useBatchRow(1)")
    wait_until(
        page,
        "() => window.attnprobe.tokenView().ready && "
        "document.querySelector('#tv-body .tv-tok.q .text').textContent === 'b0'",
    )
    assert "batch row 1" in page.text_content("#tv-title")
    hover_token(page, "q", 4)
    for h in (0, 1):
        for i, text in token_view_readout(page)["rows"][str(h)]:
            assert as_float32(text) == cap[0].weights[1, h, 4, i].item()
    report.assert_clean()
