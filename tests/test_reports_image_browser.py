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


def canvas_pixels(page, grid: int):
    return page.evaluate(
        """(g) => {
            const c = document.querySelectorAll('#img-pictures canvas')[g];
            return {w: c.width, h: c.height, data: Array.from(c.getContext('2d').getImageData(0, 0, c.width, c.height).data)};
        }""",
        grid,
    )


def changed_box(before, after) -> tuple[int, int, int, int] | None:
    """(x0, y0, x1, y1) bounding the canvas pixels that changed, or None."""
    xs, ys = [], []
    w = before["w"]
    for i in range(0, len(before["data"]), 4):
        if any(abs(before["data"][i + k] - after["data"][i + k]) > 8 for k in range(3)):
            ys.append((i // 4) // w)
            xs.append((i // 4) % w)
    return (min(xs), min(ys), max(xs) + 1, max(ys) + 1) if xs else None


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
    path = to_html(cap, tmp_path / "report.html", image=built.pictures[0], image_grid=tokens, tokens=[names])
    report = open_report(path, "#image")
    page = report.page
    page.evaluate("window.attnprobe.imageReady")
    page.select_option("#img-record", label=next(o for o in page.locator("#img-record option").all_text_contents() if f"layer {record.layer}" in o))
    page.select_option("#img-head", value=str(HEAD))
    page.evaluate("window.attnprobe.imageRender()")
    before = canvas_pixels(page, 0)
    page.hover(f"#img-tokens span.tok >> nth={query}")
    page.evaluate("window.attnprobe.imageRender()")
    view = page.evaluate("window.attnprobe.imageView()")
    assert view["top"]["row"] == cell[0] and view["top"]["col"] == cell[1] and view["top"]["weight"] == 1.0
    assert f"row {cell[0]} col {cell[1]}" in page.text_content("#img-readout")
    after = canvas_pixels(page, 0)
    scale = before["w"] / 512
    x0, y0, x1, y1 = (v * scale for v in grid.box(*cell))
    box = changed_box(before, after)
    assert box is not None and abs(box[0] - x0) <= 2 and abs(box[1] - y0) <= 2 and abs(box[2] - x1) <= 2 and abs(box[3] - y1) <= 2, (box, (x0, y0, x1, y1))
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
    path = to_html(cap, tmp_path / "two.html", image=pictures)
    report = open_report(path, "#image")
    page = report.page
    page.evaluate("window.attnprobe.imageReady")
    assert page.locator("#img-pictures canvas").count() == 2
    sizes = page.evaluate("Array.from(document.querySelectorAll('#img-pictures canvas')).map(c => [c.width, c.height])")
    assert sizes == [[438, 512], [512, 300]]
    report.assert_clean()
