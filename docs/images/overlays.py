"""Redraw docs/images/overlay-<family>.png, the pictures of docs/images.md: one overlay per family.

Each family is the tiny random-weight model of the tests (tests/image_helpers.py: transformers' own processors, the
picture matplotlib ships) — no checkpoint is downloaded. Random weights attend almost evenly, so to show where a
patch's region falls, head 1 of the drawn layer is set to attend, from the drawn query, to the one patch over the
sitter's face (the cell holding the point x=256, y=230 of the 512 x 600 picture): the tint must sit on the face in
every family, whatever its processor cropped, padded, resized or merged.

    python docs/images/overlays.py
"""

import dataclasses
import sys
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parents[1] / "tests"))
warnings.filterwarnings("ignore")

from image_helpers import FAMILIES, build  # noqa: E402

import attnprobe  # noqa: E402

FACE = (256.0, 230.0)


def face_cell(grid):
    for i, (x0, y0, x1, y1) in enumerate(grid.boxes()):
        if x0 <= FACE[0] < x1 and y0 <= FACE[1] < y1:
            return divmod(i, grid.cols)
    raise AssertionError("no cell holds the face")


for family in FAMILIES:
    built = build(family)
    tokens = attnprobe.locate_image_tokens(built.model, built.inputs, processor=built.processor, images=built.pictures)
    _, cap = attnprobe.run(built.model, dict(built.inputs), image_grid=tokens)
    grid = [g for g in tokens if "language_model" in g.modules][-1:] or [tokens[0]]
    grid = grid[0]
    record = next(r for r in reversed(list(cap)) if grid.applies_to(r) and r.query_len == r.key_len)
    query = record.query_len - 1 if "language_model" in grid.modules else 0
    weights = record.weights.clone()
    weights[grid.batch, 1, query] = 0.0
    weights[grid.batch, 1, query, grid.position(*face_cell(grid)) - record.key_start] = 1.0
    cap = attnprobe.Capture([dataclasses.replace(r, weights=weights) if r is record else r for r in cap], cap.info)
    token_rows = None
    if "input_ids" in built.inputs:
        ids = built.inputs["input_ids"].tolist()
        token_rows = [built.processor.tokenizer.convert_ids_to_tokens(row) for row in ids]
    path = HERE / f"overlay-{family}.png"
    attnprobe.reports.save_overlay(
        cap, built.pictures[0], path, layer=record.layer, head=1, query=query, tokens=token_rows, overwrite=True, dpi=64
    )
    print(f"wrote {path}")
