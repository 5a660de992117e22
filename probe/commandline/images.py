"""Pictures for the command line: ``attnprobe report MODEL --image photo.png --text "..."``.

The model folder's own processor (``AutoProcessor``: an image processor, or one with the tokenizer for a
vision-language model) turns the pictures and the text into the model's inputs; the text gets the family's image
placeholder in front when it has none (one per picture: LLaVA's and PaliGemma's ``<image>``, Qwen2-VL's
``<|vision_start|><|image_pad|><|vision_end|>``, Gemma 3's ``<start_of_image>``), and the image tokens are located
with the processor and the pictures (``locate_image_tokens``), so regions are in the pictures' own pixels.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..outputs.image_tokens import ImageTokens, locate_image_tokens
from ..reading import IMAGE_FILE_LIMIT, open_regular
from .loading import InputError, Workload


def first_line(text: str) -> str:
    return text.strip().splitlines()[0]


@dataclass
class ImageWorkload(Workload):
    """A model with pictures ready to run (a ``Workload``): also the processor, the pictures and the image tokens
    located in the inputs."""

    processor: Any = None
    pictures: list = field(default_factory=list)
    image_tokens: ImageTokens | None = None


def load_processor(path: Path, family: str):
    """The processor saved in the model folder ``path`` (``AutoProcessor``; the model, loaded first, has quieted
    transformers' logs). Qwen2-VL's processor needs torchvision (for its video processor): without it, its image
    processor alone (``qwen2_vl_inputs`` does the rest)."""
    from transformers import AutoImageProcessor, AutoProcessor

    try:
        return AutoProcessor.from_pretrained(str(path))
    except ImportError as exc:  # Qwen2-VL's video processor needs torchvision: its image processor does the rest
        if family != "qwen2_vl":
            raise _unreadable(path, exc) from exc
        try:
            return AutoImageProcessor.from_pretrained(str(path))
        except Exception as inner:
            raise _unreadable(path, inner) from inner
    except Exception as exc:
        raise _unreadable(path, exc) from exc


def _unreadable(path: Path, exc: Exception) -> InputError:
    return InputError(
        first_line(
            f"--image needs the model folder's processor, which could not be loaded from {str(path)!r}: "
            f"{type(exc).__name__}: {exc}"
        )
    )


def read_pictures(paths: tuple[str, ...]) -> list:
    """The pictures at ``paths`` as RGB PIL images."""
    from PIL import Image, UnidentifiedImageError

    pictures = []
    for p in paths:
        try:
            if not Path(p).exists():
                raise FileNotFoundError(p)
            # a regular file of a bounded size, opened without blocking (a pipe or a device is refused, not read)
            with open_regular(p, what="image", limit=IMAGE_FILE_LIMIT) as f, Image.open(f) as im:
                pictures.append(im.convert("RGB"))
        except FileNotFoundError:
            raise InputError(f"--image {p!r} does not exist") from None
        except (UnidentifiedImageError, OSError) as exc:
            raise InputError(f"--image {p!r} is not a picture PIL can read ({type(exc).__name__})") from None
    return pictures


def placeholder(processor, model) -> str | None:
    """The text that stands for one picture in ``model``'s prompts (None: the model takes no text with pictures)."""
    family = getattr(getattr(model, "config", None), "model_type", "")
    if family == "qwen2_vl":
        return f"<|vision_start|>{getattr(processor, 'image_token', '<|image_pad|>')}<|vision_end|>"
    if family == "gemma3":
        return getattr(processor, "boi_token", None) or getattr(processor.tokenizer, "boi_token", "<start_of_image>")
    if family in ("llava", "paligemma"):
        return getattr(processor, "image_token", "<image>")
    return None


def with_placeholders(text: str, processor, model, pictures: int) -> str:
    """``text`` with one picture placeholder per picture in front, unless it has them already."""
    mark = placeholder(processor, model)
    if mark is None or mark in text:
        return text
    return mark * pictures + (" " if text and not text[0].isspace() else "") + text


def qwen2_vl_inputs(image_processor, tokenizer, pictures: list, text: str) -> dict:
    """What ``Qwen2VLProcessor`` makes of ``pictures`` and ``text`` (each ``<|image_pad|>`` repeated once per merge
    window of its picture, ``mm_token_type_ids`` marking them), built from its image processor and tokenizer: the
    processor itself also needs a video processor, which needs torchvision, so ``AutoProcessor`` gives the image
    processor alone where torchvision is missing."""
    import torch

    vision = image_processor(images=pictures, return_tensors="pt")
    merge = int(image_processor.merge_size) ** 2
    pieces = text.split("<|image_pad|>")
    if len(pieces) - 1 != len(pictures):
        raise InputError(f"the text has {len(pieces) - 1} <|image_pad|> placeholder(s) for {len(pictures)} picture(s)")
    counts = [int(torch.as_tensor(g).prod()) // merge for g in vision["image_grid_thw"]]
    expanded = pieces[0] + "".join("<|image_pad|>" * n + rest for n, rest in zip(counts, pieces[1:]))
    inputs = dict(tokenizer(expanded, return_tensors="pt"))
    pad = tokenizer.convert_tokens_to_ids("<|image_pad|>")
    inputs["mm_token_type_ids"] = (inputs["input_ids"] == pad).long()
    return {**inputs, **dict(vision)}


def processed(model, processor, tokenizer, source: str, pictures: list, texts: list[str]) -> dict:
    """The model's inputs: the folder's processor on the pictures (and the prompt, with its placeholders)."""
    family = getattr(getattr(model, "config", None), "model_type", "")
    text = texts[0] if texts else ""
    if family == "qwen2_vl" and not hasattr(processor, "tokenizer"):
        if tokenizer is None:
            raise InputError(f"{source} has no tokenizer: Qwen2-VL's prompt needs one")
        mark = "<|vision_start|><|image_pad|><|vision_end|>"
        return qwen2_vl_inputs(
            processor, tokenizer, pictures, text if "<|image_pad|>" in text else mark * len(pictures) + text
        )
    kwargs: dict[str, Any] = {"images": pictures, "return_tensors": "pt"}
    if hasattr(processor, "tokenizer"):
        kwargs["text"] = with_placeholders(text, processor, model, len(pictures))
    elif placeholder(processor, model) is not None or not hasattr(processor, "preprocess"):
        raise InputError(
            f"{source}: its folder's processor ({type(processor).__name__}) does not take pictures and text"
        )
    elif texts:
        raise InputError(f"{source} takes pictures only (its processor has no tokenizer): leave --text out")
    try:
        return dict(processor(**kwargs))
    except Exception as exc:
        message = f"the processor of {source} refused the input: {type(exc).__name__}: {exc}"
        raise InputError(first_line(message)) from exc


def build_image_workload(
    model, tokenizer, source: str, folder: Path | None, images: tuple[str, ...], texts: list[str]
) -> ImageWorkload:
    """Inputs of ``model`` for the pictures at ``images`` and at most one prompt (``texts``), its token strings,
    and the image tokens located in them."""
    if folder is None:
        raise InputError("--image needs a model folder with its processor (a factory has none)")
    if len(texts) > 1:
        raise InputError("--image takes one --text (the prompt about the pictures)")
    processor = load_processor(folder, getattr(getattr(model, "config", None), "model_type", ""))
    pictures = read_pictures(images)
    inputs = processed(model, processor, tokenizer, source, pictures, texts)
    inputs.pop("labels", None)
    tokenizer = getattr(processor, "tokenizer", tokenizer)
    work = ImageWorkload(
        model=model, source=source, tokenizer=tokenizer, inputs=inputs, processor=processor, pictures=pictures
    )
    work.texts = list(texts)
    if "input_ids" in inputs and tokenizer is not None:
        work.tokens = [tokenizer.convert_ids_to_tokens(row) for row in inputs["input_ids"].tolist()]
    work.image_tokens = locate_image_tokens(model, inputs, processor=processor, images=pictures)
    return work
