"""``attnprobe report MODEL --image photo.png --text "..."``: tiny models saved with their processors into a folder.

Qwen2-VL's folder holds its image processor and tokenizer as the hub's do; its ``AutoProcessor`` needs torchvision
(the video processor), so attnprobe composes its inputs from the two, and they must equal the processor's own.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from image_helpers import PICTURE_PATH, build, picture

from attnprobe.probe.commandline.images import build_image_workload, qwen2_vl_inputs
from attnprobe.probe.commandline.loading import InputError, load_pretrained_dir

PROMPTS = {"llava": "a portrait", "qwen2-vl": "a portrait", "paligemma": "a portrait", "gemma3": "a portrait"}


@functools.cache
def saved(family: str, folder: Path) -> Path:
    built = build(family)
    path = folder / family
    built.model.save_pretrained(path)
    if family == "qwen2-vl":  # as a hub folder: the image processor and the tokenizer (no processor class here)
        built.processor.image_processor.save_pretrained(path)
        built.processor.tokenizer.save_pretrained(path)
    else:
        built.processor.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return tmp_path_factory.mktemp("image-models")


def test_qwen2_vl_inputs_equal_the_processors_own():
    built = build("qwen2-vl")
    text = "<|vision_start|><|image_pad|><|vision_end|> a portrait"
    ours = qwen2_vl_inputs(built.processor.image_processor, built.processor.tokenizer, built.pictures, text)
    theirs = built.processor(images=built.pictures, text=text, return_tensors="pt")
    for key in ("input_ids", "attention_mask", "mm_token_type_ids", "pixel_values", "image_grid_thw"):
        assert torch.equal(ours[key], theirs[key]), key


@pytest.mark.parametrize("family", ["vit", "llava", "qwen2-vl", "gemma3"])
def test_a_saved_folder_gives_inputs_with_located_image_tokens(family, folder):
    path = saved(family, folder)
    model, tokenizer = load_pretrained_dir(path)
    texts = [PROMPTS[family]] if family in PROMPTS else []
    work = build_image_workload(model, tokenizer, family, path, (PICTURE_PATH,), texts)
    assert work.image_tokens is not None and work.image_tokens[0].image_size == (600, 512)
    if texts:
        image_token = work.tokens[0][work.image_tokens[-1].positions[0]]
        assert "portrait" in "".join(work.tokens[0]) and work.tokens[0].count(image_token) == len(
            work.image_tokens[-1].positions
        )


def test_bad_pictures_and_prompts_are_one_line_errors(folder, tmp_path):
    path = saved("vit", folder)
    model, tokenizer = load_pretrained_dir(path)
    with pytest.raises(InputError, match="does not exist"):
        build_image_workload(model, tokenizer, "vit", path, (str(tmp_path / "none.png"),), [])
    (tmp_path / "text.png").write_text("not a picture")
    with pytest.raises(InputError, match="is not a picture"):
        build_image_workload(model, tokenizer, "vit", path, (str(tmp_path / "text.png"),), [])
    with pytest.raises(InputError, match="takes pictures only"):
        build_image_workload(model, tokenizer, "vit", path, (PICTURE_PATH,), ["hello"])
    with pytest.raises(InputError, match="needs a model folder"):
        build_image_workload(model, tokenizer, "vit", None, (PICTURE_PATH,), [])
    assert picture().size == (512, 600)


@pytest.mark.parametrize("family", ["llava", "qwen2-vl"])
def test_report_with_an_image_writes_the_image_section(family, folder, tmp_path):
    """``attnprobe report MODEL --image photo.png --text "..."``: the report's Image section holds the picture and the
    located image tokens; the language model's grid is where the prompt's placeholders were expanded."""
    from click.testing import CliRunner

    from attnprobe.cli import main

    out = tmp_path / f"{family}.html"
    args = ["report", str(saved(family, folder)), "--image", PICTURE_PATH, "--text", "a portrait", "--out", str(out)]
    result = CliRunner().invoke(main, [*args, "-q"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    page = out.read_text()
    assert '<section id="image">' in page and 'id="attnprobe-image-meta"' in page
    meta = json.loads(page.split('id="attnprobe-image-meta">')[1].split("</script>")[0])
    assert meta["pictures"][0]["height"] == 512 and {len(r["grids"]) for r in meta["records"]} == {1}
    language = [r for r in meta["records"] if "language_model" in r["name"]]
    assert language and all("portrait" in "".join(r["tokens"]) for r in language)


def test_report_image_errors_are_one_line(folder, tmp_path):
    from click.testing import CliRunner

    from attnprobe.cli import main

    vit = str(saved("vit", folder))
    out = str(tmp_path / "report.html")  # not the working directory's attnprobe-report.html (`make report` writes one)
    result = CliRunner().invoke(main, ["report", vit, "--image", str(tmp_path / "missing.png"), "--out", out, "-q"])
    assert result.exit_code == 2 and "does not exist" in result.output and len(result.output.strip().splitlines()) == 1
    result = CliRunner().invoke(main, ["report", vit, "--image", PICTURE_PATH, "--ids", "1 2", "--out", out, "-q"])
    assert result.exit_code == 2 and "--image takes the prompt as --text" in result.output
