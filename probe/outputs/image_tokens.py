"""Which positions of a capture are image patches: their grid and the region of the picture each one sees.

A vision model or a vision-language model (VLM) turns each picture into a grid of patch tokens. Attention layers see
those tokens at positions of a sequence: a vision tower's own sequence (one batch row per picture, a CLS token first
in ViT and CLIP), and, in a VLM, the language model's sequence, where the picture's tokens replace image
placeholders of the text (some merged or pooled first). ``locate_image_tokens(model, inputs, processor=,
images=)`` reads them from the processor's outputs and the model's config, one ``ImageGrid`` per picture and stream:

==========================  ===========================================================================================
family (config model_type)  where the image tokens are
==========================  ===========================================================================================
ViT, DeiT, DINOv2, BEiT     the model's sequence: a CLS token (DeiT: CLS and distillation; DINOv2 with registers:
                            CLS and registers) then ``H/patch x W/patch`` patches, row-major; one batch row a picture
CLIP, SigLIP (vision)       the vision tower: CLIP a CLS token then the patches, SigLIP the patches alone (its pooling
                            head's probe query attends to them as keys)
LLaVA                       vision tower as CLIP's; language model: the ``image_token_index`` placeholders, expanded
                            by the processor to one token per patch, CLS dropped (``vision_feature_select_strategy``
                            ``"default"``; ``"full"`` keeps it as the picture's first token)
Qwen2-VL                    vision tower: one attention call per picture (``record.call``), its patches in the
                            processor's order, 2x2 merge windows one after the other; language model: the
                            ``image_token_id`` tokens, one per merge window (``image_grid_thw`` / ``merge_size**2``)
PaliGemma                   vision tower as SigLIP's; language model: the image prefix, one token per patch
Gemma 3                     vision tower as SigLIP's; language model: ``mm_tokens_per_image`` tokens a picture, each
                            the average of a square of patches (the projector's pooling)
==========================  ===========================================================================================

Regions are ``(x0, y0, x1, y1)`` boxes in the original picture's pixels when the processor and the pictures are
given (``probe/outputs/image_geometry.py`` undoes the processor's pad, resize and crop), else in the model's input
pixels (``ImageGrid.frame == "processed"``). Any other model is declared by hand: ``ImageGrid(rows=, cols=,
positions=...)``, passed as ``image_grid=``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch

from ..errors import AttnprobeError
from ..record import AttentionRecord
from .image_geometry import Box, Placement, identity, placement

#: Tokens before the patches in a vision encoder's sequence, by config ``model_type`` (registers added from the
#: config's ``num_register_tokens``).
VISION_PREFIX = {
    "vit": 1,
    "vit_msn": 1,
    "deit": 2,
    "beit": 1,
    "data2vec-vision": 1,
    "dinov2": 1,
    "dinov2_with_registers": 1,
    "clip_vision_model": 1,
    "siglip_vision_model": 0,
}
#: The vision-language families located from their processor's outputs (config ``model_type``).
VLM_FAMILIES = ("llava", "paligemma", "gemma3", "qwen2_vl")


class ImageTokenError(AttnprobeError, ValueError):
    """Image tokens that cannot be located or do not fit a capture; ``family`` names the model family (or None)."""

    def __init__(self, message: str, *, family: str | None = None) -> None:
        super().__init__(message)
        self.family = family


@dataclass(frozen=True)
class ImageGrid:
    """One picture's patch tokens in the records of one stream of attention layers.

    Example (a hand declaration: a 224 x 224 picture as 14 x 14 patches after one CLS token)::

        >>> from attnprobe import ImageGrid
        >>> grid = ImageGrid(rows=14, cols=14, positions=range(1, 197), image_size=(224, 224))
        >>> grid.position(0, 1), grid.box(0, 1)
        (2, (16.0, 0.0, 32.0, 16.0))
    """

    rows: int
    """Cells of the grid, top to bottom."""
    cols: int
    """Cells of the grid, left to right."""
    positions: tuple[int, ...]
    """Sequence position of each cell, row-major (``rows * cols`` of them): key positions of the records (and query
    positions where queries and keys are the same tokens)."""
    image: int = 0
    """Which picture, in the order the processor took them (batch rows first)."""
    batch: int = 0
    """The batch row of the records that holds these positions."""
    modules: str = ""
    """The records it applies to: attention modules named this or under it (``""``: every module)."""
    call: int | None = None
    """Only records of this call number (Qwen2-VL's vision tower attends each picture in its own call)."""
    regions: tuple[Box, ...] | None = None
    """Each cell's box ``(x0, y0, x1, y1)`` in the picture's pixels (``frame`` says which); None: the grid tiles the
    whole picture evenly."""
    image_size: tuple[int, int] | None = None
    """(height, width) of the picture the regions are in."""
    frame: str = "original"
    """``"original"``: regions in the original picture's pixels; ``"processed"``: in the model's input pixels (the
    processor's resize and crop unknown)."""
    extra: tuple[int, ...] = ()
    """Positions of the picture's tokens that are not patches (CLS, registers, LLaVA's CLS with strategy "full")."""
    source: str = "declared by hand"
    """How the grid was found, in words."""

    def __post_init__(self) -> None:
        positions = tuple(int(p) for p in self.positions)
        object.__setattr__(self, "positions", positions)
        object.__setattr__(self, "extra", tuple(int(p) for p in self.extra))
        if self.rows < 1 or self.cols < 1 or len(positions) != self.rows * self.cols:
            raise ImageTokenError(
                f"an image grid of {self.rows} x {self.cols} cells needs {self.rows * self.cols} positions (one per "
                f"cell, row-major), got {len(positions)}"
            )
        if min(positions) < 0 or len(set(positions)) != len(positions):
            raise ImageTokenError("image grid positions must be distinct sequence positions, 0 or more")
        if self.regions is not None:
            regions = tuple(tuple(float(v) for v in box) for box in self.regions)
            if len(regions) != len(positions) or any(len(box) != 4 for box in regions):
                raise ImageTokenError(f"regions needs one (x0, y0, x1, y1) box per cell: {len(positions)} of them")
            object.__setattr__(self, "regions", regions)
        if self.image_size is not None:
            object.__setattr__(self, "image_size", (int(self.image_size[0]), int(self.image_size[1])))
        if self.frame not in ("original", "processed"):
            raise ImageTokenError(f"frame must be 'original' or 'processed', got {self.frame!r}")

    def position(self, row: int, col: int) -> int:
        """The sequence position of cell (row, col)."""
        return self.positions[row * self.cols + col]

    def box(self, row: int, col: int, size: tuple[int, int] | None = None) -> Box:
        """The region of cell (row, col): the declared one, else the cell of an even tiling of ``size`` (height,
        width; default ``image_size``)."""
        if self.regions is not None:
            return self.regions[row * self.cols + col]
        height, width = size or self.image_size or (self.rows, self.cols)
        h, w = height / self.rows, width / self.cols
        return (col * w, row * h, (col + 1) * w, (row + 1) * h)

    def boxes(self, size: tuple[int, int] | None = None) -> list[Box]:
        """Every cell's region, row-major (see ``box``)."""
        return [self.box(r, c, size) for r in range(self.rows) for c in range(self.cols)]

    def applies_to(self, record: AttentionRecord) -> bool:
        """Whether ``record`` is one of the records these positions describe (its module, call and batch row)."""
        return self.holds(record.name, record.call, record.batch_size or 0)

    def holds(self, name: str, call: int, batch_size: int) -> bool:
        """Whether a call ``call`` of the attention module ``name`` over ``batch_size`` rows holds these positions."""
        inside = not self.modules or name == self.modules or name.startswith(self.modules + ".")
        if not inside or (self.call is not None and call != self.call):
            return False
        return batch_size > self.batch

    def key_index(self, record: AttentionRecord) -> torch.Tensor:
        """``(rows * cols,)`` long: the cells' indices along ``record``'s key axis; ``ImageTokenError`` when the
        record does not hold them all (a sliding-window cache step that dropped them, a shorter sequence)."""
        index = torch.tensor(self.positions, dtype=torch.long) - record.key_start
        keys = record.key_len or 0
        if int(index.min()) < 0 or int(index.max()) >= keys:
            raise ImageTokenError(
                f"layer {record.layer} ({record.name!r}, call {record.call}) has keys {record.key_start} to "
                f"{record.key_start + keys - 1}, but picture {self.image}'s tokens are at positions "
                f"{min(self.positions)} to {max(self.positions)}: these image tokens do not belong to this record "
                "(see cap.image_tokens())"
            )
        return index

    def to_dict(self) -> dict[str, Any]:
        """The grid as plain JSON values (what ``cap.info["image_tokens"]`` holds)."""
        data = asdict(self)
        for name in ("positions", "extra", "image_size"):
            data[name] = None if data[name] is None else list(data[name])
        data["regions"] = None if self.regions is None else [list(b) for b in self.regions]
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ImageGrid:
        fields: dict[str, Any] = {k: (tuple(v) if isinstance(v, list) else v) for k, v in data.items()}
        return cls(**fields)


class ImageTokens(Sequence):
    """The image grids of one input: one ``ImageGrid`` per picture and stream of layers (``cap.image_tokens()``)."""

    def __init__(self, grids: Iterable[ImageGrid] = ()) -> None:
        self._grids = tuple(grids)
        stray = [g for g in self._grids if not isinstance(g, ImageGrid)]
        if stray:
            raise TypeError(f"ImageTokens holds ImageGrid objects, got {type(stray[0]).__name__}")

    def __getitem__(self, index):
        if isinstance(index, slice):
            return ImageTokens(self._grids[index])
        return self._grids[index]

    def __len__(self) -> int:
        return len(self._grids)

    def __repr__(self) -> str:
        parts = [f"picture {g.image} {g.rows}x{g.cols} in {g.modules or '<all>'!r} row {g.batch}" for g in self]
        return f"<ImageTokens: {len(self)} grid(s){': ' if parts else ''}{'; '.join(parts[:6])}>"

    @property
    def images(self) -> tuple[int, ...]:
        """The picture numbers present, sorted."""
        return tuple(sorted({g.image for g in self}))

    def for_record(self, record: AttentionRecord) -> list[ImageGrid]:
        """The grids whose positions ``record`` holds (one per picture in it)."""
        return [g for g in self if g.applies_to(record)]

    def key_mask(self, name: str, call: int, batch_size: int, key_len: int, key_start: int = 0) -> torch.Tensor | None:
        """``(batch, key)`` bool: the keys of a call ``call`` of module ``name`` (``key_len`` keys from position
        ``key_start``) that are image patches; positions outside those keys (dropped by a sliding-window cache) are
        left out. None when the call holds no grid (what a statistics capture computes ``image_mass`` over)."""
        grids = [g for g in self if g.holds(name, call, batch_size)]
        if not grids:
            return None
        keys = torch.zeros(batch_size, key_len, dtype=torch.bool)
        for g in grids:
            index = torch.tensor(g.positions, dtype=torch.long) - key_start
            keys[g.batch, index[(index >= 0) & (index < key_len)]] = True
        return keys

    def key_set(self, record: AttentionRecord) -> torch.Tensor | None:
        """``(batch, key)`` bool: ``record``'s keys that are image patches; None when it holds none."""
        grids = self.for_record(record)
        if not grids:
            return None
        keys = torch.zeros(record.batch_size or 0, record.key_len or 0, dtype=torch.bool)
        for g in grids:
            keys[g.batch, g.key_index(record)] = True
        return keys

    def patch_labels(self, record: AttentionRecord, batch: int) -> tuple[list[str] | None, list[str]] | None:
        """(query labels, key labels) of a record whose every key is one picture's token (a vision tower's): each
        patch named ``img<picture> r<row>c<col>``, its other tokens ``img<picture> [<position>]`` (CLS, registers);
        the queries likewise when they are the same tokens (None: a pooling head's probe). None for any other
        record (a language model's: its text tokens label it)."""
        keys = record.key_len or 0
        for g in self.for_record(record):
            if g.batch != batch or len(g.positions) + len(g.extra) != keys or record.key_start != 0:
                continue
            labels = {p: f"img{g.image} [{p}]" for p in g.extra}
            labels.update({p: f"img{g.image} r{i // g.cols}c{i % g.cols}" for i, p in enumerate(g.positions)})
            if sorted(labels) != list(range(keys)):
                continue
            key_labels = [labels[p] for p in range(keys)]
            same = record.kind == "self" and record.query_len == keys and record.query_offset == 0
            return (key_labels if same else None), key_labels
        return None

    def to_json(self) -> list[dict[str, Any]]:
        return [g.to_dict() for g in self]

    @classmethod
    def from_json(cls, data: Iterable[Mapping[str, Any]]) -> ImageTokens:
        return cls(ImageGrid.from_dict(d) for d in data)

    def to_frame(self):
        """One row per cell: picture, stream (``modules``), call, batch row, position, row, col and its region."""
        import pandas as pd

        rows = []
        for g in self:
            for i, ((x0, y0, x1, y1), pos) in enumerate(zip(g.boxes(), g.positions)):
                rows.append((g.image, g.modules, g.call, g.batch, pos, i // g.cols, i % g.cols, x0, y0, x1, y1))
        columns = ["image", "modules", "call", "batch", "position", "row", "col", "x0", "y0", "x1", "y1"]
        return pd.DataFrame(rows, columns=columns)


def as_image_tokens(value) -> ImageTokens:
    """What ``image_grid=`` accepts, as ``ImageTokens``: ``ImageTokens``, one ``ImageGrid``, a list of them, or a
    dict (or list of dicts) of ``ImageGrid``'s fields."""
    if isinstance(value, ImageTokens):
        return value
    if isinstance(value, (ImageGrid, Mapping)):
        value = [value]
    if isinstance(value, Iterable) and not isinstance(value, (str, bytes)):
        grids = [ImageGrid.from_dict(v) if isinstance(v, Mapping) else v for v in value]
        if all(isinstance(g, ImageGrid) for g in grids):
            return ImageTokens(grids)
    raise ImageTokenError(
        "image_grid= takes attnprobe.locate_image_tokens(...)'s result, an attnprobe.ImageGrid (e.g. "
        f"ImageGrid(rows=14, cols=14, positions=range(1, 197))) or a list of them, not {type(value).__name__}"
    )


def capture_image_tokens(cap, image_grid=None) -> ImageTokens:
    """``image_grid`` (see ``as_image_tokens``) if given, else the image tokens the capture holds
    (``capture(..., image_grid=)``); ``ImageTokenError`` saying how to give them when there are none."""
    if image_grid is not None:
        return as_image_tokens(image_grid)
    info = getattr(cap, "info", None) or {}
    stored = info.get("image_tokens") if isinstance(info, Mapping) else None
    if not stored:
        raise ImageTokenError(
            "this capture holds no image tokens: capture with image_grid=attnprobe.locate_image_tokens(model, inputs, "
            "processor=processor, images=pictures) (or a hand declaration, image_grid=attnprobe.ImageGrid(...)), "
            "or pass image_grid= here"
        )
    return ImageTokens.from_json(stored)


# ------------------------------------------------------------------------------------------------ locating
@dataclass
class _Pictures:
    """The pictures of one input as the model took them: processed (height, width) and placements."""

    sizes: list[tuple[int, int]]  # (height, width) of each picture in the model's input pixels
    placements: list[Placement] = field(default_factory=list)
    frame: str = "processed"


def picture_size(picture) -> tuple[int, int]:
    """(height, width) of a picture: a PIL image, an array or tensor (height, width[, channels]) or (channels,
    height, width), a path to an image file, or a (height, width) pair."""
    if isinstance(picture, (str,)) or hasattr(picture, "__fspath__"):
        from PIL import Image  # pillow comes with matplotlib

        with Image.open(picture) as im:
            return int(im.size[1]), int(im.size[0])
    size = getattr(picture, "size", None)
    if isinstance(size, tuple) and len(size) == 2 and not hasattr(picture, "shape"):  # PIL: (width, height)
        return int(size[1]), int(size[0])
    shape = getattr(picture, "shape", None)
    if shape is not None and len(shape) in (2, 3):
        if len(shape) == 3 and shape[0] in (1, 3, 4) and shape[-1] not in (1, 3, 4):
            return int(shape[1]), int(shape[2])
        return int(shape[0]), int(shape[1])
    if isinstance(picture, Sequence) and len(picture) == 2 and all(isinstance(v, int) for v in picture):
        return int(picture[0]), int(picture[1])
    raise ImageTokenError(
        f"cannot tell the size of a picture given as {type(picture).__name__}: give a PIL image, an array "
        "(height, width, channels), a file path or a (height, width) pair"
    )


def _pictures(sizes: list[tuple[int, int]], processor, images) -> _Pictures:
    if images is None:
        return _Pictures(sizes, [identity(s) for s in sizes], "processed")
    pictures = list(images) if isinstance(images, (list, tuple)) else [images]
    if len(pictures) != len(sizes):
        raise ImageTokenError(
            f"images= has {len(pictures)} picture(s) but the input holds {len(sizes)}: give every picture the "
            "processor took, in its order"
        )
    originals = [picture_size(p) for p in pictures]
    if processor is None:
        raise ImageTokenError(
            "images= needs processor= too: the regions in the original pictures undo the processor's resize and crop"
        )
    return _Pictures(sizes, [placement(processor, o, s) for o, s in zip(originals, sizes)], "original")


def _grid_regions(pictures: _Pictures, image: int, rows: int, cols: int, cell: float) -> tuple[Box, ...]:
    """Each cell's box (``cell`` input pixels a side, row-major) in the frame of ``pictures``."""
    place = pictures.placements[image]
    boxes = ((c * cell, r * cell, (c + 1) * cell, (r + 1) * cell) for r in range(rows) for c in range(cols))
    return tuple(place.to_original(b) for b in boxes)


def _grid(pictures: _Pictures, image: int, rows: int, cols: int, cell: float, positions, **fields) -> ImageGrid:
    place = pictures.placements[image]
    return ImageGrid(
        rows=rows,
        cols=cols,
        positions=tuple(positions),
        image=image,
        regions=_grid_regions(pictures, image, rows, cols, cell),
        image_size=place.original,
        frame=pictures.frame,
        **fields,
    )


def _find_modules(model, config) -> dict[str, str]:
    """Module names of the vision tower (``"vision"``) and the language model (``"text"``): the first module holding
    that very sub-config (the model itself for a vision-only model)."""
    vision = getattr(config, "vision_config", None) or config
    text = getattr(config, "text_config", None)
    found: dict[str, str] = {}
    for name, module in model.named_modules():
        held = getattr(module, "config", None)
        if held is None:
            continue
        if held is vision and "vision" not in found:
            found["vision"] = name
        if text is not None and held is text and "text" not in found:
            found["text"] = name
    return found


def _int(value, what: str, family: str) -> int:
    if isinstance(value, (list, tuple)):
        if len(set(value)) != 1:
            raise ImageTokenError(f"{family}: non-square {what} {value} is not supported", family=family)
        value = value[0]
    if value is None:
        raise ImageTokenError(f"{family}: the config has no {what}", family=family)
    return int(value)


def _vision_grids(vision_config, pictures: _Pictures, module: str, family: str) -> list[ImageGrid]:
    """One grid per picture in a vision encoder's sequence (batch row = picture)."""
    kind = getattr(vision_config, "model_type", "")
    if kind not in VISION_PREFIX:
        raise ImageTokenError(
            f"attnprobe does not know where {kind!r} puts its patches; declare them with image_grid=ImageGrid(...)",
            family=family,
        )
    prefix = VISION_PREFIX[kind] + int(getattr(vision_config, "num_register_tokens", 0) or 0)
    patch = _int(getattr(vision_config, "patch_size", None), "patch_size", family)
    grids = []
    for i, (height, width) in enumerate(pictures.sizes):
        rows, cols = height // patch, width // patch
        positions = range(prefix, prefix + rows * cols)
        source = f"{family}: {prefix} token(s) then {rows}x{cols} patches of {patch} px"
        extra = tuple(range(prefix))
        grids.append(
            _grid(pictures, i, rows, cols, patch, positions, batch=i, modules=module, extra=extra, source=source)
        )
    return grids


def _placeholder_runs(
    input_ids: torch.Tensor, token: int, counts: list[int], family: str
) -> list[tuple[int, list[int]]]:
    """(batch row, positions) of each picture's placeholder tokens: the k-th picture takes the next ``counts[k]``
    placeholders in (batch row, position) order, as the models scatter image features into the text."""
    where = (input_ids == token).nonzero().tolist()  # [(row, position)] in row-major order
    if len(where) != sum(counts):
        raise ImageTokenError(
            f"{family}: the input holds {len(where)} image token(s) (id {token}) but its {len(counts)} picture(s) "
            f"need {sum(counts)}: was the text made by the model's processor from the same pictures?",
            family=family,
        )
    runs, start = [], 0
    for n in counts:
        chunk = where[start : start + n]
        rows = {r for r, _ in chunk}
        if len(rows) != 1:
            raise ImageTokenError(f"{family}: a picture's image tokens span several batch rows", family=family)
        runs.append((chunk[0][0], [p for _, p in chunk]))
        start += n
    return runs


def _image_token(config, family: str) -> int:
    for name in ("image_token_id", "image_token_index"):
        value = getattr(config, name, None)
        if value is not None:
            return int(value)
    raise ImageTokenError(f"{family}: the config names no image token (image_token_id)", family=family)


def _patch_based(config, inputs, pictures, modules, family: str) -> list[ImageGrid]:
    """LLaVA, PaliGemma, Gemma 3: a vision tower over each picture, its patches (pooled in Gemma 3) in the text."""
    vision = config.vision_config
    grids = _vision_grids(vision, pictures, modules.get("vision", ""), family)
    patch = _int(vision.patch_size, "patch_size", family)
    keep_cls = family == "llava" and getattr(config, "vision_feature_select_strategy", "default") == "full"
    pool = 1
    if family == "gemma3":
        per_side = math.isqrt(int(config.mm_tokens_per_image))
        pool = grids[0].rows // per_side
    counts = [(g.rows // pool) * (g.cols // pool) + int(keep_cls) for g in grids]
    runs = _placeholder_runs(inputs["input_ids"], _image_token(config, family), counts, family)
    for i, (row, positions) in enumerate(runs):
        rows, cols = grids[i].rows // pool, grids[i].cols // pool
        extra, positions = (positions[:1], positions[1:]) if keep_cls else ([], positions)
        what = f"{rows}x{cols} tokens, each {pool}x{pool} patches" if pool > 1 else f"{rows}x{cols} patches"
        source = f"{family}: {what} at image token {_image_token(config, family)}"
        fields = dict(batch=row, modules=modules.get("text", ""), extra=tuple(extra), source=source)
        grids.append(_grid(pictures, i, rows, cols, patch * pool, positions, **fields))
    return grids


def _qwen2_vl(config, inputs, pictures, modules, family: str) -> list[ImageGrid]:
    """Qwen2-VL: each picture's patches in merge-window order in the vision tower (one call per picture), one token
    per merge window in the text."""
    vision = config.vision_config
    patch, merge = int(vision.patch_size), int(vision.spatial_merge_size)
    grids, counts = [], []
    for i, (t, h, w) in enumerate(inputs["image_grid_thw"].tolist()):
        if t != 1:
            raise ImageTokenError(
                f"{family}: picture {i} has {t} frames; only still pictures are located", family=family
            )
        # the processor's order: (row block, column block, row in block, column in block)
        order = torch.arange(h * w).reshape(h // merge, w // merge, merge, merge).permute(0, 2, 1, 3).reshape(h, w)
        source = f"{family}: {h}x{w} patches of {patch} px, in {merge}x{merge} merge windows"
        fields = dict(batch=0, call=i, modules=modules.get("vision", ""), source=source)
        grids.append(_grid(pictures, i, h, w, patch, order.reshape(-1).tolist(), **fields))
        counts.append(h * w // merge**2)
    runs = _placeholder_runs(inputs["input_ids"], _image_token(config, family), counts, family)
    for i, (row, positions) in enumerate(runs):
        rows, cols = grids[i].rows // merge, grids[i].cols // merge
        source = f"{family}: {rows}x{cols} tokens, each {merge}x{merge} patches merged"
        fields = dict(batch=row, modules=modules.get("text", ""), source=source)
        grids.append(_grid(pictures, i, rows, cols, patch * merge, positions, **fields))
    return grids


def _processed_sizes(config, inputs, family: str) -> list[tuple[int, int]]:
    """(height, width) of each picture as the model took it."""
    if "image_grid_thw" in inputs:  # Qwen2-VL: flattened patches
        patch = int(config.vision_config.patch_size)
        return [(h * patch, w * patch) for _, h, w in inputs["image_grid_thw"].tolist()]
    pixels = inputs.get("pixel_values")
    if not isinstance(pixels, torch.Tensor) or pixels.dim() != 4:
        raise ImageTokenError(
            f"{family}: the inputs hold no pixel_values of shape (pictures, channels, height, width); pass the "
            "processor's output",
            family=family,
        )
    if inputs.get("num_crops") is not None and int(torch.as_tensor(inputs["num_crops"]).sum()) > 0:
        raise ImageTokenError(f"{family}: pan-and-scan crops are not located; process without do_pan_and_scan")
    return [(int(pixels.shape[2]), int(pixels.shape[3]))] * int(pixels.shape[0])


def locate_image_tokens(model, inputs, *, processor=None, images=None) -> ImageTokens:
    """The image tokens of ``inputs`` (a processor's output) in ``model``'s attention layers: one ``ImageGrid`` per
    picture and stream (vision tower, language model), with each patch's region.

    ``processor``: the processor (or image processor) that made ``inputs``, and ``images``: the pictures it took, in
    its order; with both, regions are in the original pictures' pixels, else in the model's input pixels. Families:
    ViT, DeiT, DINOv2, BEiT, CLIP and SigLIP (vision models and towers), LLaVA, Qwen2-VL, PaliGemma and Gemma 3 (see
    the module's table); any other model is declared by hand with ``image_grid=ImageGrid(...)``.
    """
    config = getattr(model, "config", None)
    if config is None:
        raise ImageTokenError(
            f"locate_image_tokens() needs a Hugging Face model (with .config), got {type(model).__name__}"
        )
    if not isinstance(inputs, Mapping):
        raise ImageTokenError(f"inputs must be the processor's output (a mapping), got {type(inputs).__name__}")
    family = str(getattr(config, "model_type", type(model).__name__))
    vision_config = getattr(config, "vision_config", None)
    modules = _find_modules(model, config)
    if family not in VLM_FAMILIES and family not in VISION_PREFIX and vision_config is None:
        raise ImageTokenError(
            f"attnprobe does not locate the image tokens of {family!r} models; declare them by hand with "
            "image_grid=ImageGrid(rows=..., cols=..., positions=...) (see docs/images.md)",
            family=family,
        )
    pictures = _pictures(_processed_sizes(config, inputs, family), processor, images)
    if family == "qwen2_vl":
        return ImageTokens(_qwen2_vl(config, inputs, pictures, modules, family))
    if family in VLM_FAMILIES:
        return ImageTokens(_patch_based(config, inputs, pictures, modules, family))
    if family not in VISION_PREFIX and getattr(config, "text_config", None) is not None and _has_image_token(config):
        raise ImageTokenError(
            f"attnprobe does not locate the image tokens of {family!r} vision-language models; declare them by hand "
            "with image_grid=ImageGrid(...) (see docs/images.md)",
            family=family,
        )
    return ImageTokens(_vision_grids(vision_config or config, pictures, modules.get("vision", ""), family))


def _has_image_token(config) -> bool:
    return any(getattr(config, n, None) is not None for n in ("image_token_id", "image_token_index"))
