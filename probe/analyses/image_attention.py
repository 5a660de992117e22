"""Attention on a picture: one query's weights over a picture's patch grid, and each text row's mass on the pictures.

``image_attention(cap, layer=, head=, query=)`` reads the record of ``layer``, the row of ``query`` (a position of its
sequence: a text token of a VLM, a ViT's CLS token, or a patch), and the weights at the picture's patch positions
(``cap.image_tokens()``), as a ``(rows, cols)`` map: one head's, the heads' mean (``head=None``), or the attention
rollout through the stream's layers up to ``layer`` (``rollout=True``: Abnar & Zuidema 2020, each layer's head mean
mixed half and half with the identity for the residual, rows renormalised, multiplied layer after layer).

``image_mass(cap)`` gives, per (layer, head), how much of each text row's attention goes to image tokens: from the
weights of a full capture, or from ``record.stats["image_mass"]`` of a statistics capture (``keep=("stats",)`` with
``image_grid=``), which never holds a (query x key) tensor.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import AttnprobeError
from ..outputs.image_tokens import ImageGrid, ImageTokenError, ImageTokens, capture_image_tokens
from ..record import AttentionRecord

#: The identity's share of each layer in the rollout (the paper's 0.5).
ROLLOUT_RESIDUAL = 0.5


@dataclass(frozen=True, eq=False)
class ImageAttention:
    """One query's attention on one picture (``image_attention``)."""

    grid: ImageGrid
    """The picture's grid in the record (positions, regions)."""
    values: torch.Tensor
    """``(rows, cols)`` float64: the weight on each cell (rollout: the rolled-out share)."""
    record: AttentionRecord
    """The record the row was read from (for rollout: the last layer's)."""
    query: int
    """The query's position in the sequence."""
    head: int | None
    """The head drawn; None for the heads' mean."""
    method: str
    """``"weights"`` or ``"rollout"``."""

    @property
    def mass(self) -> float:
        """The query's total weight on the picture's patches."""
        return float(self.values.sum())


def _record_and_grid(cap, tokens: ImageTokens, layer: int, call: int | None, image_index: int | None):
    """The record of ``layer`` (its call ``call``, else the first call holding the picture) and the picture's grid."""
    records = list(cap.select(layers=[layer])) if call is None else [cap.record(layer, call=call)]
    if not records:
        cap.record(layer)  # raises NotCapturedError naming the captured layers
    for record in records:
        grids = [g for g in tokens.for_record(record) if image_index is None or g.image == image_index]
        if grids:
            break
    else:
        record = records[0]
        which = "" if image_index is None else f" picture {image_index}'s"
        raise ImageTokenError(
            f"layer {record.layer} ({record.name!r}) holds none of the capture's{which} image tokens (pictures "
            f"{list(tokens.images)} are in: {sorted({g.modules or '<all>' for g in tokens})}); pick a layer of the "
            "vision tower or of the language model"
        )
    if record.weights is None:
        stats = " (a statistics capture keeps no (query x key) tensor: image_mass(cap) reads its statistics)"
        raise AttnprobeError(
            f"layer {record.layer} ({record.name!r}) has no weights{stats if record.stats is not None else ''}; "
            "capture with keep=('weights',) (or keep=None) to draw attention on the picture"
        )
    return record, grids[0]


def weights_of(record: AttentionRecord) -> torch.Tensor:
    """``record.weights`` ``(batch, head, query, key)``; an error naming the layer when it was not captured."""
    if record.weights is None:
        raise AttnprobeError(f"layer {record.layer} ({record.name!r}) has no weights; capture with keep=('weights',)")
    return record.weights


def _query_row(record: AttentionRecord, query: int) -> int:
    """``query`` (a sequence position, negative from the end) as an index along ``record``'s query axis."""
    n, start = record.query_len or 0, record.query_offset
    position = query + start + n if query < 0 else query
    if isinstance(query, bool) or not start <= position < start + n:
        raise AttnprobeError(
            f"query={query!r} is not a query of layer {record.layer} ({record.name!r}): its queries are positions "
            f"{start} to {start + n - 1} (negative numbers count from the end)"
        )
    return position - start


def _head_rows(record: AttentionRecord, batch: int, row: int, head: int | None) -> torch.Tensor:
    """``(key,)`` float64: head ``head``'s weights of one row, or the stored heads' mean."""
    weights = weights_of(record)[batch, :, row].double()  # (head, key)
    if head is None:
        return weights.mean(0)
    return weights[record.head_index(head)]


def _stream(cap, record: AttentionRecord, grid: ImageGrid) -> list[AttentionRecord]:
    """The square self-attention records of ``grid``'s stream up to ``record``'s layer, in layer order."""
    records = [
        r for r in cap if grid.applies_to(r) and r.kind == "self" and r.layer <= record.layer and r.call == record.call
    ]
    records = [r for r in records if r.query_len == r.key_len and r.query_offset == 0 and r.weights is not None]
    if not records or records[-1] is not record:
        raise AttnprobeError(
            f"rollout multiplies whole (token x token) matrices: layer {record.layer} ({record.name!r}) has "
            f"{record.query_len} queries from position {record.query_offset} against {record.key_len} keys; "
            "capture every row of one forward with weights, or draw rollout=False"
        )
    return records


def _rollout_layer(record: AttentionRecord, batch: int) -> torch.Tensor:
    """``(query, key)`` float64: one layer of the rollout, heads averaged, half identity, rows summing to one."""
    a = weights_of(record)[batch].double().mean(0)  # (head, query, key) -> (query, key)
    a = (1.0 - ROLLOUT_RESIDUAL) * a + ROLLOUT_RESIDUAL * torch.eye(a.shape[-1], dtype=a.dtype)
    total = a.sum(-1, keepdim=True)
    return torch.where(total > 0, a / total.clamp_min(torch.finfo(a.dtype).tiny), 0.0)


def rollout_row(records: list[AttentionRecord], batch: int, row: int) -> torch.Tensor:
    """``(key,)`` float64: row ``row`` of the attention rollout through ``records`` (heads averaged, half identity).

    The rollout is ``A_L @ ... @ A_1``; its one row is carried down from the last layer as a vector (one
    vector-matrix product a layer), never the (token x token) product of the layers."""
    if not records:
        raise AttnprobeError("rollout needs at least one layer")
    result = _rollout_layer(records[-1], batch)[row]  # (key,)
    for r in reversed(records[:-1]):
        result = result @ _rollout_layer(r, batch)  # (key,) x (query, key): down one more layer
    return result


def image_attention(
    cap,
    *,
    layer: int,
    head: int | None = None,
    query: int = 0,
    image_index: int | None = None,
    call: int | None = None,
    rollout: bool = False,
    image_grid=None,
) -> ImageAttention:
    """The attention of ``query`` (a sequence position of ``layer``'s record; negative from the end) on one picture.

    ``head``: a head number, or None for the mean of the captured heads; ``rollout=True``: the attention rollout
    through the stream's layers up to ``layer`` (heads averaged). ``image_index``: which picture (default the first
    in the record); ``call``: the record's call (default: the first call holding the picture; Qwen2-VL's vision tower
    attends each picture in its own call); ``image_grid``: image tokens to use instead of the capture's own.

    Example (a CLS token, then 2 x 2 patches)::

        >>> import torch, attnprobe
        >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2)
        >>> grid = attnprobe.ImageGrid(rows=2, cols=2, positions=[1, 2, 3, 4], image_size=(32, 32))
        >>> out, cap = attnprobe.run(attn, torch.randn(1, 5, 8), image_grid=grid)
        >>> seen = attnprobe.image_attention(cap, layer=0, head=1, query=0)
        >>> tuple(seen.values.shape), round(seen.mass, 4) == round(float(cap[0].weights[0, 1, 0, 1:].sum()), 4)
        ((2, 2), True)
    """
    tokens = capture_image_tokens(cap, image_grid)
    record, grid = _record_and_grid(cap, tokens, layer, call, image_index)
    row = _query_row(record, query)
    if rollout:
        if head is not None:
            raise AttnprobeError("rollout averages the heads: draw rollout=True with head=None")
        weights = rollout_row(_stream(cap, record, grid), grid.batch, row)
    else:
        weights = _head_rows(record, grid.batch, row, head)
    values = weights[grid.key_index(record)].reshape(grid.rows, grid.cols)  # (key,) -> (rows, cols)
    return ImageAttention(grid, values, record, record.query_offset + row, head, "rollout" if rollout else "weights")


#: The columns of ``image_mass``'s frame.
IMAGE_MASS_COLUMNS = ("layer", "name", "call", "head", "batch", "rows", "image_mass", "image_mass_max", "source")


def _text_rows(record: AttentionRecord, tokens: ImageTokens, batch: int, positions: torch.Tensor) -> torch.Tensor:
    """``(n,)`` bool: which query ``positions`` of batch row ``batch`` are text (not image tokens, not padding)."""
    image = {p for g in tokens.for_record(record) if g.batch == batch for p in (*g.positions, *g.extra)}
    text = torch.tensor([int(p) not in image for p in positions.tolist()], dtype=torch.bool)
    if record.query_padding is not None:
        padded = record.query_padding[batch].detach().cpu().bool()
        text &= ~padded[positions - record.query_offset]
    return text


def _masses(record: AttentionRecord, tokens: ImageTokens) -> tuple[torch.Tensor, torch.Tensor, str] | None:
    """(``(batch, head, n)`` each row's weight on image patches, ``(n,)`` its query positions, source) or None."""
    if record.stats is not None and "image_mass" in record.stats:
        positions = record.stats_positions
        assert positions is not None  # statistics present
        return record.stats["image_mass"].double().cpu(), positions + record.query_offset, "stats"
    keys = tokens.key_set(record)
    if record.weights is None or keys is None:
        return None
    mass = (record.weights.double() * keys[:, None, None, :]).sum(-1)  # (batch, head, query, key) -> (b, h, q)
    return mass, torch.arange(record.query_len or 0) + record.query_offset, "weights"


def image_mass(cap, *, image_grid=None):
    """One row per (layer, call, head, batch row) of the records that hold image tokens: ``rows``, how many text rows
    (query rows that are neither image tokens nor padding) were counted, and their mean (``image_mass``) and
    largest (``image_mass_max``) share of weight on the image patches.

    Read from the weights of a full capture, or from ``record.stats["image_mass"]`` of a statistics capture
    (``capture(model, keep=("stats",), image_grid=...)``: no (query x key) tensor is ever held), said in ``source``.
    Records with no text row (a vision tower) are left out.
    """
    import pandas as pd

    tokens = capture_image_tokens(cap, image_grid)
    rows = []
    for record in cap:
        found = _masses(record, tokens)
        if found is None:
            continue
        mass, positions, source = found
        for batch in sorted({g.batch for g in tokens.for_record(record)}):
            text = _text_rows(record, tokens, batch, positions)
            if not text.any():
                continue
            for i, head in enumerate(record.heads):
                values = mass[batch, i][text]
                mean, top = float(values.mean()), float(values.max())
                rows.append((record.layer, record.name, record.call, head, batch, int(text.sum()), mean, top, source))
    return pd.DataFrame(rows, columns=list(IMAGE_MASS_COLUMNS))
