"""Attention drawn over the picture: a head planted to attend to one patch lights exactly that patch's region.

The saved PNG is compared, pixel by pixel, with the same figure drawn with the tint switched off (``alpha=0``: the
picture, the grid lines and the colour bar alone): the pixels that differ must lie inside the planted patch's region
(where the test computes it from the figure's own transform), and that region must differ throughout.
"""

from __future__ import annotations

import dataclasses
import io

import matplotlib.image
import numpy as np
import pytest
import torch
from image_helpers import FAMILIES, build, located, picture

import attnprobe
from attnprobe.probe.capture import Capture
from attnprobe.probe.errors import AttnprobeError
from attnprobe.probe.outputs.image_tokens import ImageGrid, locate_image_tokens
from attnprobe.reports.overlay import overlay, save_overlay

PLANTED_HEAD = 1
SMALL = (3.2, 3.0)  # figure size: small figures draw and encode fast


def planted(cap: Capture, record, grid: ImageGrid, query_row: int, cell: tuple[int, int]) -> Capture:
    """``cap`` with ``record``'s head PLANTED_HEAD attending, from ``query_row``, to the one patch ``cell`` only."""
    weights = record.weights.clone()
    index = record.head_index(PLANTED_HEAD)
    weights[grid.batch, index, query_row] = 0.0
    weights[grid.batch, index, query_row, grid.position(*cell) - record.key_start] = 1.0
    swapped = dataclasses.replace(record, weights=weights)
    return Capture([swapped if r is record else r for r in cap], cap.info)


def png_pixels(fig) -> np.ndarray:
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    return matplotlib.image.imread(io.BytesIO(buffer.getvalue()), format="png")[..., :3]


def cell_pixels(fig, box) -> tuple[slice, slice]:
    """(rows, cols) of the PNG inside ``box`` (picture pixels), 2 pixels in from its edges (grid lines, rounding)."""
    ax = fig.axes[0]
    height = fig.get_size_inches()[1] * 100
    (x0, y0), (x1, y1) = ax.transData.transform([(box[0], box[1]), (box[2], box[3])])
    rows = slice(round(height - y0) + 2, round(height - y1) - 2)  # display y grows upwards, PNG rows downwards
    cols = slice(round(x0) + 2, round(x1) - 2)
    return rows, cols


def lit_pixels(cap, image, box, **options) -> tuple[np.ndarray, tuple[slice, slice]]:
    """(per-pixel difference between the overlay and the same figure without tint, the planted cell's pixels)."""
    fig = overlay(cap, image, figsize=SMALL, **options)
    lit = png_pixels(fig)
    blank = png_pixels(overlay(cap, image, alpha=0.0, figsize=SMALL, **options))
    return np.abs(lit - blank).max(-1), cell_pixels(fig, box)


def assert_only_region_lit(difference: np.ndarray, where: tuple[slice, slice]) -> None:
    inside = difference[where]
    assert inside.size > 50 and inside.min() > 0.02 and inside.mean() > 0.2, inside.min()  # the whole region tinted
    outside = difference.copy()
    rows, cols = where
    outside[rows.start - 3 : rows.stop + 3, cols.start - 3 : cols.stop + 3] = 0.0
    assert outside.max() < 0.02, np.unravel_index(outside.argmax(), outside.shape)  # nothing else


def plant_vit_head(model, patch: int) -> None:
    """Layer 0, head PLANTED_HEAD: every query attends to patch ``patch`` (its position embedding sticks out along
    hidden unit 0; the head's key reads that unit and its query is a large constant)."""
    d = model.config.hidden_size // model.config.num_attention_heads
    attention = model.layers[0].attention
    with torch.no_grad():
        model.embeddings.position_embeddings[0, 1 + patch, 0] += 100.0
        rows = slice(PLANTED_HEAD * d, (PLANTED_HEAD + 1) * d)
        for proj in (attention.q_proj, attention.k_proj):
            proj.weight[rows] = 0.0
            proj.bias[rows] = 0.0
        attention.k_proj.weight[PLANTED_HEAD * d, 0] = 1.0
        attention.q_proj.bias[PLANTED_HEAD * d] = 60.0


def test_a_planted_vit_head_lights_its_patch_in_the_png(tmp_path):
    built = build("vit")
    cell = (2, 1)
    plant_vit_head(built.model, patch=cell[0] * 4 + cell[1])
    tokens = locate_image_tokens(built.model, built.inputs, processor=built.processor, images=built.pictures)
    _, cap = attnprobe.run(built.model, dict(built.inputs))
    row = cap[0].weights[0, PLANTED_HEAD, 0]  # the CLS token's weights, from the model itself
    assert int(row.argmax()) == 1 + cell[0] * 4 + cell[1] and float(row.max()) > 0.99
    options = dict(layer=0, head=PLANTED_HEAD, query=0, image_grid=tokens)
    path = save_overlay(cap, built.pictures[0], tmp_path / "vit.png", **options)
    saved = matplotlib.image.imread(path)[..., :3]
    assert np.array_equal(saved, png_pixels(overlay(cap, built.pictures[0], **options)))  # the file is the figure
    difference, where = lit_pixels(cap, built.pictures[0], tokens[0].box(*cell), **options)
    assert_only_region_lit(difference, where)


@pytest.mark.parametrize("family", FAMILIES)
def test_a_head_planted_on_one_patch_lights_exactly_its_region(family):
    """The language model's last text token (a VLM) or the first token (a vision model) attends to one patch."""
    built, tokens, cap = located(family)
    grid = [g for g in tokens if "language_model" in g.modules][-1:] or [tokens[0]]
    grid = grid[0]
    record = next(r for r in reversed(list(cap)) if grid.applies_to(r) and r.query_len == r.key_len)
    cell = (grid.rows - 1, grid.cols // 2)
    query = (record.query_len or 0) - 1 if "language_model" in grid.modules else 0
    cap = planted(cap, record, grid, query, cell)
    options = dict(layer=record.layer, head=PLANTED_HEAD, query=query, image_grid=tokens)
    difference, where = lit_pixels(cap, built.pictures[0], grid.box(*cell), **options)
    assert_only_region_lit(difference, where)


def test_qwen2_vl_vision_tower_patches_follow_the_merge_window_order():
    """In the vision tower the sequence runs window by window: position 2 is patch (1, 0), not (0, 2)."""
    built, tokens, cap = located("qwen2-vl")
    grid = tokens[0]
    assert grid.position(1, 0) == 2 and grid.position(0, 2) == 4
    record = cap.record(0, call=0)
    cap = planted(cap, record, grid, 0, (1, 0))
    difference, where = lit_pixels(
        cap, built.pictures[0], grid.box(1, 0), layer=0, head=PLANTED_HEAD, query=0, image_grid=tokens
    )
    assert_only_region_lit(difference, where)


def test_heads_mean_every_head_and_rollout():
    built, tokens, cap = located("vit")
    mean = overlay(cap, built.pictures[0], layer=1, query=0, image_grid=tokens)
    assert "mean of heads" in mean.axes[0].get_title() and len(mean.axes) == 2
    every = overlay(cap, built.pictures[0], layer=1, query=0, head="all", image_grid=tokens)
    assert [ax.get_title() for ax in every.axes] == [f"head {h}" for h in range(4)]
    from attnprobe.probe.analyses.image_attention import image_attention

    rolled = image_attention(cap, layer=1, query=0, rollout=True, image_grid=tokens)
    eye = torch.eye(17, dtype=torch.float64)
    a0, a1 = (0.5 * cap[i].weights[0].double().mean(0) + 0.5 * eye for i in (0, 1))
    expected = (a1 @ a0)[0, 1:].reshape(4, 4)
    assert torch.allclose(rolled.values, expected) and rolled.method == "rollout"
    with pytest.raises(AttnprobeError, match="rollout averages the heads"):
        image_attention(cap, layer=1, head=0, rollout=True, image_grid=tokens)


def test_mistakes_are_one_line_errors():
    built, tokens, cap = located("siglip-vision")
    with pytest.raises(AttnprobeError, match="rollout multiplies whole"):  # the pooling head: one probe query
        overlay(cap, built.pictures[0], layer=-1, query=0, rollout=True, image_grid=tokens)
    with pytest.raises(AttnprobeError, match="query=16 is not a query of layer 0"):
        overlay(cap, built.pictures[0], layer=0, query=16, image_grid=tokens)
    with pytest.raises(AttnprobeError, match="600x512 picture, but the image given is 300x512"):
        overlay(cap, picture().crop((0, 0, 512, 300)), layer=0, image_grid=tokens)
    with pytest.raises(AttnprobeError, match=r"holds no image tokens.*image_grid="):
        overlay(cap, built.pictures[0], layer=0)
    _, stats = attnprobe.run(built.model, dict(built.inputs), keep=("stats",))
    with pytest.raises(AttnprobeError, match=r"no weights.*statistics capture"):
        overlay(stats, built.pictures[0], layer=0, image_grid=tokens)


def test_regions_in_input_pixels_are_stretched_with_a_warning():
    built, _, cap = located("vit")
    tokens = locate_image_tokens(built.model, built.inputs)  # no processor: regions in the 32 x 32 input
    with pytest.warns(attnprobe.AttnprobeWarning, match="stretched over the 600x512 picture"):
        overlay(cap, built.pictures[0], layer=0, image_grid=tokens)
