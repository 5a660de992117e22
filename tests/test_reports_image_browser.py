"""The report's Image section in a real browser (Debian's Chromium, headless, offline, opened from file://).

A LLaVA language-model head is planted so that the prompt's last token attends to one patch: pointing at that token
must tint that patch's region of the picture (the canvas pixels there change, nowhere else) and the readout must name
it; pointing at the patch must name the token. Two pictures in one input each get their canvas.
"""

from __future__ import annotations

import dataclasses

from image_helpers import build, located, picture
from reports_helpers import browser, open_report  # noqa: F401  (fixtures)

import attnprobe
from attnprobe.probe.outputs.image_tokens import locate_image_tokens
from attnprobe.reports import to_html

HEAD = 1


SNAPSHOT = """(g) => {
    const c = document.querySelectorAll('#img-pictures canvas')[g];
    window.__pixels = c.getContext('2d').getImageData(0, 0, c.width, c.height).data.slice();
    return [c.width, c.height];
}"""
# (x0, y0, x1, y1) bounding the canvas pixels that changed since SNAPSHOT by more than 8 levels, or null
CHANGED = """(g) => {
    const c = document.querySelectorAll('#img-pictures canvas')[g];
    const now = c.getContext('2d').getImageData(0, 0, c.width, c.height).data, was = window.__pixels;
    let x0 = Infinity, y0 = Infinity, x1 = -1, y1 = -1;
    for (let i = 0; i < now.length; i += 4) {
        const change = Math.max(...[0, 1, 2].map((k) => Math.abs(now[i + k] - was[i + k])));
        if (change > 8) {
            const x = (i / 4) % c.width, y = Math.floor(i / 4 / c.width);
            x0 = Math.min(x0, x); y0 = Math.min(y0, y); x1 = Math.max(x1, x + 1); y1 = Math.max(y1, y + 1);
        }
    }
    return x1 < 0 ? null : [x0, y0, x1, y1];
}"""


def test_pointing_at_a_token_lights_its_patch_and_a_patch_names_its_token(tmp_path, open_report):
    built, tokens, cap = located("llava")
    grid = tokens[1]  # the language model's
    record = cap.record(-1)
    cell, query = (2, 3), record.query_len - 1
    weights = record.weights.clone()
    weights[0, HEAD, query] = 0.0
    weights[0, HEAD, query, grid.position(*cell)] = 1.0
    cap = attnprobe.Capture([dataclasses.replace(r, weights=weights) if r is record else r for r in cap], cap.info)
    names = built.processor.tokenizer.convert_ids_to_tokens(built.inputs["input_ids"][0].tolist())
    path = to_html(
        cap, tmp_path / "report.html", image=built.pictures[0], image_grid=tokens, tokens=[names], checks=False
    )
    report = open_report(path, "#image")
    page = report.page
    page.evaluate("window.attnprobe.imageReady")
    labels = page.locator("#img-record option").all_text_contents()
    page.select_option("#img-record", label=next(o for o in labels if o.startswith(f"layer {record.layer} ")))
    page.select_option("#img-head", value=str(HEAD))
    page.evaluate("window.attnprobe.imageRender()")
    width, height = page.evaluate(SNAPSHOT, 0)  # the picture, no patch tinted
    page.hover(f"#img-tokens span.tok >> nth={query}")
    page.evaluate("window.attnprobe.imageRender()")
    view = page.evaluate("window.attnprobe.imageView()")
    assert view["top"]["row"] == cell[0] and view["top"]["col"] == cell[1] and view["top"]["weight"] == 1.0
    assert f"row {cell[0]} col {cell[1]}" in page.text_content("#img-readout")
    scale = width / 512  # the picture is embedded at most 512 pixels a side
    x0, y0, x1, y1 = (v * scale for v in grid.box(*cell))
    expected = (max(x0, 0), max(y0, 0), min(x1, width), min(y1, height))  # LLaVA padded the sides
    box = page.evaluate(CHANGED, 0)  # the pixels that changed: exactly the patch's region of the picture
    assert box is not None and max(abs(a - b) for a, b in zip(box, expected)) <= 1.5, (box, expected)
    # pointing at the patch names the token that attends to it
    point = page.evaluate("([r, c]) => window.attnprobe.imageCellCenter(0, r, c)", list(cell))
    page.mouse.move(point["x"], point["y"])
    page.evaluate("window.attnprobe.imageRender()")
    assert f"most attended by token {names[query]}" in page.text_content("#img-readout")
    report.assert_clean()


def test_two_pictures_get_a_canvas_each(tmp_path, open_report):
    pictures = [picture(), picture().crop((0, 0, 512, 300))]
    built = build("llava", pictures=pictures, text="<image> one <image> two")
    tokens = locate_image_tokens(built.model, built.inputs, processor=built.processor, images=pictures)
    _, cap = attnprobe.run(built.model, dict(built.inputs), image_grid=tokens)
    path = to_html(cap, tmp_path / "two.html", image=pictures, checks=False)
    report = open_report(path, "#image")
    page = report.page
    page.evaluate("window.attnprobe.imageReady")
    labels = page.locator("#img-record option").all_text_contents()
    # the vision tower attends each picture in its own batch row; the language model sees both in one row
    assert [label.split(" (")[0] for label in labels] == [
        "layer 0",
        "layer 0",
        "layer 1",
        "layer 1",
        "layer 2",
        "layer 3",
    ]
    tokens = page.locator("#img-tokens span.tok").all_text_contents()  # the vision tower: its patches by name
    assert tokens[:3] == ["img0 [0]", "img0 r0c0", "img0 r0c1"] and len(tokens) == 17
    page.select_option("#img-record", label=labels[4])
    page.evaluate("window.attnprobe.imageRender()")
    assert page.locator("#img-pictures canvas").count() == 2
    sizes = page.evaluate("Array.from(document.querySelectorAll('#img-pictures canvas')).map(c => [c.width, c.height])")
    assert sizes == [[437, 512], [512, 300]]  # at most 512 pixels a side
    report.assert_clean()


def test_the_notebook_view_shows_the_image_section(tmp_path, browser):
    built, tokens, cap = located("vit")
    _, cap = attnprobe.run(built.model, dict(built.inputs), image_grid=tokens)
    notebook = tmp_path / "notebook.html"  # a page holding the cell's output, as a notebook does
    notebook.write_text(
        f"<!doctype html><html><body>{attnprobe.reports.view(cap, image=built.pictures[0])._repr_html_()}"
    )
    page = browser.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(f"pageerror: {e}"))
    page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
    try:
        page.goto(notebook.as_uri())
        page.wait_for_timeout(300)
        frame = page.frames[1]
        frame.evaluate("() => window.attnprobe.imageReady")
        assert frame.locator("#img-pictures canvas").count() == 1
        assert frame.evaluate("() => window.attnprobe.errors") == [] and not errors, errors
    finally:
        page.close()
