"""Attention drawn over the picture: one query's weights on a picture's patches, as a heatmap over the picture itself.

``overlay(cap, image, layer=, head=, query=)`` returns a matplotlib ``Figure`` (built without pyplot, so nothing is
shown or kept in pyplot's state; a notebook displays the returned figure); ``save_overlay`` writes it to a file.
Each patch's region (``cap.image_tokens()``: in the original picture's pixels) is tinted by the query's weight on
that patch: a patch with no weight leaves the picture as it is, the heaviest patch gets the full colour (``alpha``),
so what lights up is exactly where the query looks. Thin lines draw the patch grid.
"""

from __future__ import annotations

import math

import numpy as np

from ..probe.analyses.image_attention import ImageAttention, image_attention
from ..probe.errors import AttnprobeError, warn_user
from ..probe.outputs.image_tokens import ImageGrid
from ._common import display_token
from .png import image_path, save_figure

#: The overlay's colour map and the opacity of the heaviest patch.
OVERLAY_CMAP = "inferno"
OVERLAY_ALPHA = 0.75


def picture_array(image) -> np.ndarray:
    """``image`` (a PIL image, a path to an image file, an array (height, width[, channels])) as an RGB(A) array."""
    if isinstance(image, str) or hasattr(image, "__fspath__"):
        from PIL import Image

        with Image.open(image) as im:
            return np.asarray(im.convert("RGB"))
    if hasattr(image, "convert") and hasattr(image, "size"):  # PIL
        return np.asarray(image.convert("RGB"))
    array = np.asarray(getattr(image, "numpy", lambda: image)() if hasattr(image, "detach") else image)
    if array.ndim == 3 and array.shape[0] in (1, 3, 4) and array.shape[-1] not in (1, 3, 4):
        array = np.moveaxis(array, 0, -1)  # (channels, height, width) -> (height, width, channels)
    if array.ndim not in (2, 3):
        raise AttnprobeError(f"image must be a picture (height, width[, channels]), got shape {array.shape}")
    return array


def _boxes(grid: ImageGrid, size: tuple[int, int]) -> list[tuple[float, float, float, float]]:
    """The cells' regions in the picture's pixels; a grid in the model's input pixels is stretched over the picture
    (said in a warning when the sizes differ)."""
    if grid.regions is None or grid.frame == "original":
        if grid.image_size is not None and grid.regions is not None and tuple(grid.image_size) != tuple(size):
            raise AttnprobeError(
                f"the image tokens place picture {grid.image} in a {grid.image_size[0]}x{grid.image_size[1]} picture, "
                f"but the image given is {size[0]}x{size[1]}: give the picture the processor took"
            )
        return grid.boxes(size)
    if grid.image_size is not None and tuple(grid.image_size) != tuple(size):
        warn_user(
            f"picture {grid.image}'s regions are in the model's input pixels "
            f"({grid.image_size[0]}x{grid.image_size[1]}): they are stretched over the {size[0]}x{size[1]} picture, "
            "which is exact only for a plain resize; locate the image tokens with processor= and images= for the "
            "original picture's regions"
        )
    base = grid.image_size or size
    sy, sx = size[0] / base[0], size[1] / base[1]
    return [(x0 * sx, y0 * sy, x1 * sx, y1 * sy) for x0, y0, x1, y1 in grid.regions]


def draw_overlay(ax, picture: np.ndarray, attention: ImageAttention, *, cmap=OVERLAY_CMAP, alpha=OVERLAY_ALPHA):
    """Draw ``picture`` and ``attention`` over it into ``ax``; returns the ``ScalarMappable`` (for a colour bar)."""
    import matplotlib as mpl
    from matplotlib.collections import LineCollection, PatchCollection
    from matplotlib.patches import Rectangle

    height, width = picture.shape[:2]
    ax.imshow(
        picture, extent=(0, width, height, 0), interpolation="nearest", cmap="gray" if picture.ndim == 2 else None
    )
    values = attention.values.numpy().reshape(-1)
    top = float(values.max()) if values.size and values.max() > 0 else 1.0
    norm = mpl.colors.Normalize(0.0, top)
    colormap = mpl.colormaps[cmap] if isinstance(cmap, str) else cmap
    colors = colormap(norm(values))
    colors[:, 3] = alpha * np.clip(values / top, 0.0, 1.0)  # no weight: the picture shows through unchanged
    boxes = _boxes(attention.grid, (height, width))
    cells = [Rectangle((x0, y0), x1 - x0, y1 - y0) for x0, y0, x1, y1 in boxes]
    ax.add_collection(PatchCollection(cells, facecolors=colors, edgecolors="none", antialiased=False))
    edges = [[(x0, y0), (x1, y0), (x1, y1), (x0, y1), (x0, y0)] for x0, y0, x1, y1 in boxes]
    ax.add_collection(LineCollection(edges, colors="white", linewidths=0.3, alpha=0.35))
    ax.set_xlim(0, width)
    ax.set_ylim(height, 0)
    ax.set_xticks([])
    ax.set_yticks([])
    return mpl.cm.ScalarMappable(norm=norm, cmap=colormap)


def _title(attention: ImageAttention, token: str | None, who: str | None = None) -> str:
    r = attention.record
    if who is None:
        who = "mean of heads" if attention.head is None else f"head {attention.head}"
        who = "rollout (heads averaged)" if attention.method == "rollout" else who
    query = f"query {attention.query}" + (f" {display_token(token, 20)!r}" if token is not None else "")
    return (
        f"layer {r.layer} · {who} · {query}\npicture {attention.grid.image}: {attention.mass:.1%} of the row's weight"
    )


def overlay(
    cap,
    image,
    *,
    layer: int,
    head=None,
    query: int = 0,
    image_index: int | None = None,
    call: int | None = None,
    rollout: bool = False,
    tokens=None,
    image_grid=None,
    figsize=None,
    cmap=OVERLAY_CMAP,
    alpha: float = OVERLAY_ALPHA,
):
    """A matplotlib ``Figure``: the attention of ``query`` in ``layer`` drawn over the picture ``image``.

    ``image``: the picture (a PIL image, a path, an array) the processor took; ``layer``: a layer of the vision tower
    or the language model (negative from the end); ``query``: a position of that layer's sequence (a text token of a
    VLM, a ViT's CLS token at 0, a patch; negative from the end); ``head``: a head number, None for the heads' mean, or
    ``"all"`` for one panel per captured head; ``rollout=True``: the attention rollout through the stream's layers up to
    ``layer``. ``image_index``: which of the input's pictures ``image`` is (default the first); ``tokens``: token
    strings, to name the query in the title; ``image_grid``: image tokens instead of the capture's own.

    Example::

        >>> import attnprobe, numpy as np, torch
        >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2)
        >>> grid = attnprobe.ImageGrid(rows=2, cols=2, positions=[1, 2, 3, 4])  # a CLS token, then 2 x 2 patches
        >>> out, cap = attnprobe.run(attn, torch.randn(1, 5, 8), image_grid=grid)
        >>> fig = attnprobe.reports.overlay(cap, np.zeros((32, 32, 3)), layer=0, head=None, query=0)
        >>> len(fig.axes)  # the picture and its colour bar
        2
    """
    from matplotlib.figure import Figure

    picture = picture_array(image)
    common = dict(layer=layer, query=query, image_index=image_index, call=call, image_grid=image_grid)
    if head == "all":
        if rollout:
            raise AttnprobeError("rollout averages the heads: draw rollout=True with head=None, not head='all'")
        first = image_attention(cap, head=None, **common)
        panels = [image_attention(cap, head=h, **common) for h in first.record.heads]
    else:
        panels = [image_attention(cap, head=head, rollout=rollout, **common)]
    ncols = min(4, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    height, width = picture.shape[:2]
    side = 4.0 if len(panels) == 1 else 2.6
    fig = Figure(
        figsize=figsize or (side * ncols * max(width / height, 0.5) + 1.0, side * nrows + 0.6), layout="constrained"
    )
    token = _query_token(tokens, panels[0])
    for i, attention in enumerate(panels):
        ax = fig.add_subplot(nrows, ncols, i + 1)
        mappable = draw_overlay(ax, picture, attention, cmap=cmap, alpha=alpha)
        ax.set_title(_title(attention, token) if len(panels) == 1 else f"head {attention.head}", fontsize=9)
        if len(panels) == 1:
            label = "rolled-out share" if attention.method == "rollout" else "attention weight"
            fig.colorbar(mappable, ax=ax, shrink=0.8, label=label)
    if len(panels) > 1:
        fig.suptitle(_title(panels[0], token, who="every head").split("\n")[0], fontsize=10)
    return fig


def _query_token(tokens, attention: ImageAttention) -> str | None:
    if tokens is None:
        return None
    rows = tokens if tokens and not isinstance(tokens[0], str) else [tokens]
    row = rows[min(attention.grid.batch, len(rows) - 1)]
    return row[attention.query] if attention.query < len(row) else None


def save_overlay(cap, image, path, *, dpi: float = 100, overwrite: bool = False, **options):
    """Write ``overlay(cap, image, **options)`` to ``path`` (PNG, SVG or PDF by the suffix); returns the path.

    An existing file is replaced only with ``overwrite=True``."""
    image_path(path, overwrite=overwrite)  # fail before drawing
    fig = overlay(cap, image, **options)
    return save_figure(fig, path, overwrite=overwrite, dpi=dpi)
