"""Where each pixel of a model's input came from: an image processor's pad, resize and crop, undone.

Hugging Face image processors run one pipeline (``_preprocess`` of transformers' image processing backends, the
PIL and the torchvision one alike): LLaVA's pad to a square (``LlavaImageProcessor(do_pad=True)``, the picture
centred), a resize, a centre crop (``do_center_crop``, zero padding where the crop is larger than the picture), then
padding at the bottom and right (``do_pad`` of the other processors). The resize goes by ``size``:

- ``{"height", "width"}``: stretched to that size (ViT, SigLIP, PaliGemma, Gemma 3);
- ``{"shortest_edge"}``: the short side to that many pixels, the aspect kept (CLIP, LLaVA, before their crop);
- ``{"shortest_edge", "longest_edge"}``: the same, the long side at most ``longest_edge``;
- Qwen2-VL (a processor with ``merge_size``): ``smart_resize``, both sides a multiple of ``patch_size x merge_size``
  and the area between ``shortest_edge`` and ``longest_edge`` pixels (its min and max pixels).

Resizing maps pixel edges onto pixel edges (``[0, w]`` onto ``[0, w']``, as PIL and torchvision resample), so the
whole pipeline is one affine map per axis, ``x' = x * scale + offset``: ``placement(processor, (height, width))``
computes it from the processor's settings and the picture's size, ``Placement.to_original`` undoes it for a box.
The settings are read from the processor object (not from a call's keyword overrides): the size they give is
compared with what the processor produced, and a difference is an error, never a silently wrong region.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from ..errors import AttnprobeError


class ImageGeometryError(AttnprobeError, ValueError):
    """The processor's geometry could not be reproduced; ``expected``/``produced`` are (height, width) sizes."""

    def __init__(self, message: str, *, expected=None, produced=None) -> None:
        super().__init__(message)
        self.expected = expected
        self.produced = produced


Box = tuple[float, float, float, float]  # (x0, y0, x1, y1) in pixels, x to the right, y down


@dataclass(frozen=True)
class Placement:
    """How one picture became the model's input: ``processed = original * scale + offset`` on each axis.

    ``original`` and ``processed`` are (height, width); ``scale`` and ``offset`` are (y, x); ``steps`` says in words
    what the processor did (e.g. ``("resize 60x80 -> 16x21", "centre crop 16x16")``).
    """

    original: tuple[int, int]
    processed: tuple[int, int]
    scale: tuple[float, float]
    offset: tuple[float, float]
    steps: tuple[str, ...] = ()

    def to_original(self, box: Box) -> Box:
        """A box in the model's input pixels as a box in the picture's pixels (parts may lie outside the picture,
        where the processor padded)."""
        (sy, sx), (oy, ox) = self.scale, self.offset
        x0, y0, x1, y1 = box
        return ((x0 - ox) / sx, (y0 - oy) / sy, (x1 - ox) / sx, (y1 - oy) / sy)

    def to_processed(self, box: Box) -> Box:
        """A box in the picture's pixels as a box in the model's input pixels."""
        (sy, sx), (oy, ox) = self.scale, self.offset
        x0, y0, x1, y1 = box
        return (x0 * sx + ox, y0 * sy + oy, x1 * sx + ox, y1 * sy + oy)


def identity(size: tuple[int, int]) -> Placement:
    """The placement of a picture that is the model's input itself (no processor, or regions kept in input pixels)."""
    return Placement(original=size, processed=size, scale=(1.0, 1.0), offset=(0.0, 0.0), steps=())


def _setting(settings, key: str):
    """``settings[key]`` for a dict, ``settings.key`` for transformers' ``SizeDict``; None when absent."""
    if settings is None:
        return None
    if isinstance(settings, dict):
        return settings.get(key)
    return getattr(settings, key, None)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """Qwen2-VL's resize target: both sides multiples of ``factor``, the area within ``[min_pixels, max_pixels]``,
    the aspect kept as closely as that allows (the rule of transformers' ``qwen2_vl`` image processor)."""
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _short_side(height: int, width: int, size: int, max_size: int | None) -> tuple[int, int]:
    """The short side to ``size`` pixels, the long one in proportion (at most ``max_size``): transformers'
    ``get_resize_output_image_size`` (no ``max_size``) and ``get_size_with_aspect_ratio`` (with it)."""
    if max_size is None:
        short, long = (width, height) if width <= height else (height, width)
        new_short, new_long = size, int(size * long / short)
        return (new_long, new_short) if width <= height else (new_short, new_long)
    raw = None
    if max(height, width) / min(height, width) * size > max_size:
        raw = max_size * min(height, width) / max(height, width)
        size = round(raw)
    if (height <= width and height == size) or (width <= height and width == size):
        return height, width
    if width < height:
        return int((raw if raw is not None else size) * height / width), size
    return size, int((raw if raw is not None else size) * width / height)


def resized_size(processor, height: int, width: int) -> tuple[int, int]:
    """(height, width) that ``processor``'s resize makes of a ``height x width`` picture."""
    size = getattr(processor, "size", None)
    if getattr(processor, "merge_size", None) is not None and getattr(processor, "patch_size", None) is not None:
        factor = int(processor.patch_size) * int(processor.merge_size)  # Qwen2-VL
        low = _setting(size, "shortest_edge") or _setting(size, "min_pixels") or processor.min_pixels
        high = _setting(size, "longest_edge") or _setting(size, "max_pixels") or processor.max_pixels
        return smart_resize(height, width, factor, int(low), int(high))
    h, w = _setting(size, "height"), _setting(size, "width")
    if h and w:
        return int(h), int(w)
    short = _setting(size, "shortest_edge")
    if short:
        longest = _setting(size, "longest_edge")
        return _short_side(height, width, int(short), None if longest is None else int(longest))
    raise ImageGeometryError(
        f"{type(processor).__name__} resizes by size={size!r}, which attnprobe cannot reproduce (it knows height and "
        "width, shortest_edge, shortest and longest edge, and Qwen2-VL's min/max pixels); declare the image grid by "
        "hand with image_grid= (see docs/images.md)"
    )


def placement(processor, original: tuple[int, int], produced: tuple[int, int] | None = None) -> Placement:
    """The ``Placement`` of a ``original = (height, width)`` picture through ``processor`` (an image processor, or a
    processor holding one as ``image_processor``). ``produced``: the (height, width) the processor actually made;
    a different result is an ``ImageGeometryError``."""
    ip = getattr(processor, "image_processor", processor)
    h, w = (int(v) for v in original)
    scale, offset, steps = [1.0, 1.0], [0.0, 0.0], []
    if getattr(ip, "do_pad", False) and hasattr(ip, "pad_to_square") and h != w:  # LLaVA: centred on a square
        side = max(h, w)
        offset = [float((side - h) // 2), float((side - w) // 2)]
        steps.append(f"pad to square {side}x{side}")
        h = w = side
    if getattr(ip, "do_resize", True):
        nh, nw = resized_size(ip, h, w)
        scale = [scale[0] * nh / h, scale[1] * nw / w]
        offset = [offset[0] * nh / h, offset[1] * nw / w]
        steps.append(f"resize {h}x{w} -> {nh}x{nw}")
        h, w = nh, nw
    crop = getattr(ip, "crop_size", None)
    if getattr(ip, "do_center_crop", False) and crop is not None:
        ch, cw = int(_setting(crop, "height")), int(_setting(crop, "width"))
        offset = [offset[0] - (h - ch) // 2, offset[1] - (w - cw) // 2]
        steps.append(f"centre crop {ch}x{cw}")
        h, w = ch, cw
    if produced is not None and tuple(produced) != (h, w):
        padded = getattr(ip, "do_pad", False) and not hasattr(ip, "pad_to_square")
        if padded and produced[0] >= h and produced[1] >= w:  # padding at the bottom and right keeps the offsets
            steps.append(f"pad to {produced[0]}x{produced[1]}")
            h, w = produced
        else:
            raise ImageGeometryError(
                f"{type(ip).__name__} made a {produced[0]}x{produced[1]} input of a {original[0]}x{original[1]} "
                f"picture, but its settings give {h}x{w} ({', '.join(steps) or 'nothing'}): was it called with other "
                "settings than it holds? Locate the image tokens with the processor as called, or pass "
                "processor=None (regions in the model's input pixels)",
                expected=(h, w),
                produced=tuple(produced),
            )
    return Placement(
        original=(int(original[0]), int(original[1])),
        processed=(h, w),
        scale=(scale[0], scale[1]),
        offset=(offset[0], offset[1]),
        steps=tuple(steps),
    )
