"""The report's Image section: the pictures, and every record's weights on their patches, for the page's script.

``to_html(cap, path, image=...)`` adds the section when the capture holds image tokens (``cap.image_tokens()``). The
page shows each picture (drawn on a canvas from its own pixels: no image file, no request), a layer and head choice,
the record's tokens: pointing at a token tints the patches it attends to (every picture of its row), pointing at a
patch shades the tokens by how much they attend to it. The data is small next to the report's matrices: per record
and picture, the ``(head, query, cell)`` weights at the picture's patch positions of the grid's batch row, one
compressed blob each (the report's own encoding, ``encoding.shuffled_floats``), and each picture as a JPEG
(quality ``JPEG_QUALITY``; the browser decodes it from bytes with ``createImageBitmap``, no image URL), downscaled to
at most ``MAX_PICTURE_SIDE`` pixels a side (its cells' boxes scaled with it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..probe.errors import AttnprobeError
from ..probe.outputs.image_tokens import ImageGrid, ImageTokens
from ..probe.record import AttentionRecord
from . import encoding
from ._common import display_token
from .overlay import picture_array

#: Pictures are embedded at most this many pixels a side (their aspect kept), as JPEG of this quality.
MAX_PICTURE_SIDE = 512
JPEG_QUALITY = 90


@dataclass(frozen=True)
class Picture:
    """One embedded picture: its JPEG at the embedded size and the scale from the picture's own pixels."""

    image: int
    width: int
    height: int
    scale: float
    original: tuple[int, int]  # (height, width) of the picture given
    jpeg: bytes


def embedded_picture(image: int, picture) -> Picture:
    """``picture`` (a PIL image, a path, an array) as a JPEG at most ``MAX_PICTURE_SIDE`` pixels a side."""
    import io

    from PIL import Image

    array = picture_array(picture)
    if array.dtype != np.uint8:  # floats in 0..1 (matplotlib's convention) or 0..255
        array = np.clip(array * (255.0 if array.max() <= 1.0 else 1.0), 0, 255).astype(np.uint8)
    im = Image.fromarray(array).convert("RGB")
    height, width = array.shape[:2]
    scale = min(1.0, MAX_PICTURE_SIDE / max(height, width))
    if scale < 1.0:
        im = im.resize((max(1, round(width * scale)), max(1, round(height * scale))), Image.Resampling.LANCZOS)
    buffer = io.BytesIO()
    im.save(buffer, format="JPEG", quality=JPEG_QUALITY)
    return Picture(image, im.size[0], im.size[1], scale, (height, width), buffer.getvalue())


def pictures_of(image, tokens: ImageTokens) -> list[Picture]:
    """The ``image=`` of ``to_html`` (one picture, or one per picture of the input in the processor's order)."""
    given = list(image) if isinstance(image, (list, tuple)) else [image]
    needed = tokens.images
    if len(given) <= max(needed, default=-1):
        raise AttnprobeError(
            f"image= has {len(given)} picture(s) but the capture's image tokens name pictures {list(needed)}: give "
            "every picture the processor took, in its order (image=[first, second, ...])"
        )
    return [embedded_picture(i, given[i]) for i in needed]


def _cell_boxes(grid: ImageGrid, picture: Picture) -> list[list[float]]:
    """The cells' regions in the embedded picture's pixels (rounded to 0.1 px)."""
    size = picture.original
    if grid.regions is not None and grid.frame == "processed" and grid.image_size is not None:
        sy, sx = size[0] / grid.image_size[0], size[1] / grid.image_size[1]
        boxes = [(x0 * sx, y0 * sy, x1 * sx, y1 * sy) for x0, y0, x1, y1 in grid.regions]
    else:
        if grid.image_size is not None and grid.regions is not None and tuple(grid.image_size) != size:
            raise AttnprobeError(
                f"the image tokens place picture {grid.image} in a {grid.image_size[0]}x{grid.image_size[1]} picture, "
                f"but image= gives a {size[0]}x{size[1]} one: give the pictures the processor took"
            )
        boxes = grid.boxes(size)
    return [[round(v * picture.scale, 1) for v in box] for box in boxes]


def _grid_meta(record: AttentionRecord, grid: ImageGrid, picture: Picture, blobs, precision: str) -> dict[str, Any]:
    weights = record.weights
    if weights is None:
        raise AttnprobeError(f"layer {record.layer} has no weights")
    index = grid.key_index(record)
    values = weights[grid.batch][:, :, index].float().numpy()  # (head, query, key) -> (head, query, cell)
    blob = blobs.add(lambda: encoding.shuffled_floats(values, precision))
    return {
        "image": grid.image,
        "rows": grid.rows,
        "cols": grid.cols,
        "positions": list(grid.positions),
        "boxes": _cell_boxes(grid, picture),
        "blob": blob,
        "batch": grid.batch,
    }


def image_section(
    records: Sequence[tuple[int, AttentionRecord]],
    tokens: ImageTokens,
    image,
    *,
    blobs,
    precision: str,
    labels: Callable[[AttentionRecord, int], list[str] | None],
) -> dict[str, Any] | None:
    """The section's page data (None when no record shows a picture): ``records`` are the report's (record id,
    record) pairs; ``labels(record, batch)`` the labels of the record's query rows (None: their positions)."""
    shown = [(rid, r, tokens.for_record(r)) for rid, r in records if r.weights is not None]
    shown = [(rid, r, grids) for rid, r, grids in shown if grids]
    if not shown:
        return None
    pictures = {p.image: p for p in pictures_of(image, tokens)}
    out_records = []
    for rid, r, grids in shown:
        for batch in sorted({g.batch for g in grids}):
            row_grids = [g for g in grids if g.batch == batch]
            names = labels(r, batch)  # the record's own query rows (None: their positions)
            start = r.query_offset
            positions = range(start, start + (r.query_len or 0))
            queries = [str(p) for p in positions] if names is None else [display_token(t, 40) for t in names]
            out_records.append(
                {
                    "rid": rid,
                    "layer": r.layer,
                    "name": r.name,
                    "call": r.call,
                    "batch": batch,
                    "heads": list(r.heads),
                    "queryOffset": start,
                    "tokens": queries,
                    "grids": [_grid_meta(r, g, pictures[g.image], blobs, precision) for g in row_grids],
                }
            )
    return {
        "pictures": [
            {"image": p.image, "width": p.width, "height": p.height, "blob": blobs.add(lambda p=p: p.jpeg)}
            for p in pictures.values()
        ],
        "records": out_records,
    }


def cells_per_record(records: Sequence[AttentionRecord], tokens: ImageTokens) -> int:
    """How many values the section embeds for ``records`` (for the report's budget)."""
    total = 0
    for r in records:
        for g in tokens.for_record(r):
            total += len(g.positions) * len(r.heads) * (r.query_len or 0)
    return total
