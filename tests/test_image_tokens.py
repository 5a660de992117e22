"""Image tokens located from real processors' outputs: positions, grids and each patch's region of the picture.

For every family the positions equal what the processor produced (its image placeholders in ``input_ids``, its
``pixel_values`` / ``image_grid_thw``), every record of the vision tower and the language model gets its picture's
grid, and each region holds what the patch holds: the mean colour of the processed patch equals the mean colour of
the original picture inside the region (a region off by one cell, transposed, or with the crop not undone is tens of
levels off).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from image_helpers import FAMILIES, build, located, picture, region_mean, transformers, unnormalized

import attnprobe
from attnprobe.probe.outputs.image_geometry import ImageGeometryError, placement, smart_resize
from attnprobe.probe.outputs.image_tokens import (
    ImageGrid,
    ImageTokenError,
    ImageTokens,
    as_image_tokens,
    locate_image_tokens,
)


def _split(tokens: ImageTokens):
    """(vision tower grids, language model grids)."""
    text = [g for g in tokens if "language_model" in g.modules]
    return [g for g in tokens if g not in text], text


def _processor_patch_colours(built, grid: ImageGrid) -> np.ndarray:
    """(cells, 3): the mean colour of each cell's processed pixels, straight from the processor's output."""
    pixels = built.inputs["pixel_values"]
    if pixels.dim() == 2:  # Qwen2-VL: one row per patch, (channels, frames, patch, patch), in the processor's order
        ip = built.processor.image_processor
        rows = pixels.reshape(pixels.shape[0], 3, ip.temporal_patch_size, ip.patch_size, ip.patch_size)[:, :, 0]
        return np.stack([unnormalized(built.processor, rows[p]).mean((1, 2)) for p in grid.positions])
    image = unnormalized(built.processor, pixels[grid.image])  # (3, H, W)
    size = image.shape[1] // grid.rows
    return np.stack(
        [
            image[:, r * size : (r + 1) * size, c * size : (c + 1) * size].reshape(3, -1).mean(1)
            for r in range(grid.rows)
            for c in range(grid.cols)
        ]
    )


@pytest.mark.parametrize("family", FAMILIES)
def test_positions_and_grids_are_what_the_processor_made(family):
    built, tokens, _ = located(family)
    vision, text = _split(tokens)
    pixels = built.inputs["pixel_values"]
    if "image_grid_thw" in built.inputs:
        _, h, w = built.inputs["image_grid_thw"][0].tolist()
        assert (vision[0].rows, vision[0].cols) == (h, w)
        assert sorted(vision[0].positions) == list(range(h * w))
    else:
        patch = built.model.config.vision_config.patch_size if text else built.model.config.patch_size
        assert (vision[0].rows, vision[0].cols) == (pixels.shape[2] // patch, pixels.shape[3] // patch)
    if text:
        placeholder = built.model.config.image_token_id
        expected = (built.inputs["input_ids"][0] == placeholder).nonzero().reshape(-1).tolist()
        assert list(text[0].positions) == expected and len(expected) > 0
        pooled = {"qwen2-vl": 2, "gemma3": 2}.get(family, 1)
        assert (text[0].rows * pooled, text[0].cols * pooled) == (vision[0].rows, vision[0].cols)
    # every record of the model gets exactly one grid, whose positions it holds
    for record in located(family)[2]:
        grids = tokens.for_record(record)
        assert len(grids) == 1, (record.name, grids)
        index = grids[0].key_index(record)
        assert index.numel() == grids[0].rows * grids[0].cols


@pytest.mark.parametrize("family", FAMILIES)
def test_each_region_holds_what_its_patch_holds(family):
    built, tokens, _ = located(family)
    grid = _split(tokens)[0][0]
    assert grid.frame == "original" and grid.image_size == (600, 512)
    processed = _processor_patch_colours(built, grid)
    original = np.stack([region_mean(built.pictures[0], box) for box in grid.regions])
    inside = np.array([x0 >= 0 and y0 >= 0 and x1 <= 512 and y1 <= 600 for x0, y0, x1, y1 in grid.regions])
    error = np.abs(processed - original)[inside].mean()
    shifted = np.abs(processed - np.roll(original, 1, axis=0))[inside].mean()
    assert inside.sum() >= 8 and error < 2.0 and shifted > 10 * error, (error, shifted)


def test_language_model_cells_cover_their_patches():
    """Merged (Qwen2-VL) and pooled (Gemma 3) tokens cover exactly the patches they stand for."""
    for family, k in (("qwen2-vl", 2), ("gemma3", 2), ("llava", 1), ("paligemma", 1)):
        vision, text = _split(located(family)[1])
        for r in range(text[0].rows):
            for c in range(text[0].cols):
                corners = [vision[0].box(r * k + i, c * k + j) for i in range(k) for j in range(k)]
                cover = (min(b[0] for b in corners), min(b[1] for b in corners))
                cover += (max(b[2] for b in corners), max(b[3] for b in corners))
                assert np.allclose(text[0].box(r, c), cover), (family, r, c)


def test_llava_pad_to_square_and_clip_crop_are_undone():
    # LLaVA pads the 512-wide picture to 600 x 600 (44 columns each side), then resizes to 32 x 32
    llava = located("llava")[1][0]
    assert llava.box(0, 0) == pytest.approx((-44.0, 0.0, 106.0, 150.0))
    # CLIP resizes the short side (512) to 32, the long one to int(32 * 600 / 512) = 37, then crops 2 rows off the top
    clip = located("clip-vision")[1][0]
    assert clip.box(0, 0) == pytest.approx((0.0, 2 * 600 / 37, 128.0, 10 * 600 / 37))


def test_several_pictures_in_one_batch_row_and_across_rows():
    """Two pictures of different sizes in row 0 and one in row 1 (Qwen2-VL: a grid each, its own vision call)."""
    pictures = [picture(), picture().crop((0, 0, 512, 300)), picture().transpose(0)]
    image = "<|vision_start|><|image_pad|><|vision_end|>"
    built = build("qwen2-vl", pictures=pictures, text=[f"{image} a {image} b", f"{image} c"])
    tokens = locate_image_tokens(built.model, built.inputs, processor=built.processor, images=pictures)
    vision, lm = _split(tokens)
    assert [g.call for g in vision] == [0, 1, 2] and [g.batch for g in lm] == [0, 0, 1]
    assert [g.image_size for g in lm] == [(600, 512), (300, 512), (600, 512)]
    ids = built.inputs["input_ids"]
    for row in (0, 1):
        expected = (ids[row] == built.model.config.image_token_id).nonzero().reshape(-1).tolist()
        assert [p for g in lm if g.batch == row for p in g.positions] == expected
    _, cap = attnprobe.run(built.model, dict(built.inputs))
    for record in cap:
        assert len(tokens.for_record(record)) == (1 if "visual" in record.name else 3 if record.batch_size == 2 else 0)


def test_llava_full_strategy_keeps_the_cls_token_as_the_pictures_first_token():
    built = build("llava")
    built.model.config.vision_feature_select_strategy = "full"
    processor = transformers.LlavaProcessor(
        built.processor.image_processor,
        built.processor.tokenizer,
        patch_size=8,
        vision_feature_select_strategy="full",
        num_additional_image_tokens=1,
    )
    inputs = processor(images=built.pictures, text="<image> hello", return_tensors="pt")
    tokens = locate_image_tokens(built.model, inputs, processor=processor, images=built.pictures)
    text = _split(tokens)[1][0]
    placeholders = (inputs["input_ids"][0] == built.model.config.image_token_id).nonzero().reshape(-1).tolist()
    assert len(placeholders) == 17 and text.extra == (placeholders[0],) and list(text.positions) == placeholders[1:]


def test_without_processor_regions_are_in_the_models_input_pixels():
    built = build("vit")
    grid = locate_image_tokens(built.model, built.inputs)[0]
    assert grid.frame == "processed" and grid.image_size == (32, 32) and grid.box(1, 2) == (16.0, 8.0, 24.0, 16.0)


def test_geometry_matches_transformers_own_size_rules():
    from transformers.image_transforms import get_resize_output_image_size, get_size_with_aspect_ratio
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize as qwen_resize

    from attnprobe.probe.outputs.image_geometry import _short_side

    rng = np.random.default_rng(0)
    for h, w in rng.integers(20, 900, size=(200, 2)).tolist():
        assert smart_resize(h, w, 28, 56 * 56, 28 * 28 * 64) == qwen_resize(h, w, 28, 56 * 56, 28 * 28 * 64)
        image = np.zeros((3, h, w))
        assert _short_side(h, w, 224, None) == tuple(get_resize_output_image_size(image, 224, default_to_square=False))
        assert _short_side(h, w, 224, 300) == get_size_with_aspect_ratio((h, w), 224, 300)


def test_processor_called_with_other_settings_is_an_error():
    built = build("vit")
    other = built.processor(images=built.pictures, size={"height": 40, "width": 40}, return_tensors="pt")
    with pytest.raises(ImageGeometryError, match=r"40x40 input.*settings give 32x32") as info:
        locate_image_tokens(built.model, other, processor=built.processor, images=built.pictures)
    assert info.value.expected == (32, 32) and info.value.produced == (40, 40)
    assert placement(built.processor, (600, 512)).steps == ("resize 600x512 -> 32x32",)


def test_bad_inputs_get_one_line_errors():
    built = located("llava")[0]
    with pytest.raises(ImageTokenError, match="images= has 2 picture"):
        locate_image_tokens(built.model, built.inputs, processor=built.processor, images=[picture(), picture()])
    with pytest.raises(ImageTokenError, match="needs processor="):
        locate_image_tokens(built.model, built.inputs, images=built.pictures)
    short = dict(built.inputs, input_ids=built.inputs["input_ids"][:, 3:])
    with pytest.raises(ImageTokenError, match=r"holds 14 image token.*need 16") as info:
        locate_image_tokens(built.model, short)
    assert info.value.family == "llava"
    bert = transformers.BertModel(transformers.BertConfig(hidden_size=16, num_hidden_layers=1, num_attention_heads=2))
    with pytest.raises(ImageTokenError, match=r"does not locate the image tokens of 'bert'.*image_grid="):
        locate_image_tokens(bert, {"input_ids": torch.ones(1, 3, dtype=torch.long)})


def test_a_hand_declaration_round_trips_and_checks_itself():
    grid = ImageGrid(rows=2, cols=3, positions=range(1, 7), image_size=(20, 30), modules="encoder")
    assert grid.box(1, 2) == (20.0, 10.0, 30.0, 20.0) and grid.position(1, 0) == 4
    tokens = as_image_tokens([grid.to_dict()])
    assert tokens[0] == grid and ImageTokens.from_json(tokens.to_json())[0] == grid
    frame = tokens.to_frame()
    assert frame.shape == (6, 11) and frame["position"].tolist() == [1, 2, 3, 4, 5, 6]
    with pytest.raises(ImageTokenError, match="2 x 3 cells needs 6 positions"):
        ImageGrid(rows=2, cols=3, positions=range(5))
    with pytest.raises(ImageTokenError, match="distinct"):
        ImageGrid(rows=1, cols=2, positions=[3, 3])
    with pytest.raises(ImageTokenError, match="image_grid= takes"):
        as_image_tokens("14x14")


def test_a_capture_keeps_its_image_tokens_through_save_and_load(tmp_path):
    built, tokens, _ = located("qwen2-vl")
    with attnprobe.capture(built.model, image_grid=tokens, layers=[0, -1]) as cap:
        built.model(**built.inputs)
    assert list(cap.image_tokens()) == list(tokens) and list(cap.select(layers=[0]).image_tokens()) == list(tokens)
    loaded = attnprobe.load(cap.save(tmp_path / "cap"))
    assert list(loaded.image_tokens()) == list(tokens)
    _, plain = attnprobe.run(built.model, dict(built.inputs), layers=[0])
    with pytest.raises(ImageTokenError, match=r"holds no image tokens: capture with image_grid="):
        plain.image_tokens()
    declared = attnprobe.ImageGrid(rows=10, cols=8, positions=range(80), modules="model.visual", call=0)
    _, hand = attnprobe.run(built.model, dict(built.inputs), layers=[0], image_grid=declared)
    assert hand.image_tokens()[0] == declared and len(hand.image_tokens().for_record(hand[0])) == 1
