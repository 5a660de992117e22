"""Tiny Hugging Face models built from configs, their inputs, and eager reference weights."""

from __future__ import annotations

import copy
import logging

import torch

import attnprobe

transformers = __import__("transformers")
logging.getLogger("transformers").setLevel(logging.ERROR)

VOCAB = 100
#: the keyword (and output field) of the generation cache: past_key_values up to transformers 5.23, cache from 5.24
CACHE_ARG = __import__("attnprobe.hooks.hf.compat", fromlist=["x"]).cache_argument_name()


def _configs():
    t = transformers
    return {
        "gpt2": (t.GPT2Config(n_embd=16, n_layer=2, n_head=4, vocab_size=VOCAB, n_positions=32), t.GPT2LMHeadModel),
        "bert": (
            t.BertConfig(
                hidden_size=16,
                num_hidden_layers=2,
                num_attention_heads=4,
                intermediate_size=32,
                vocab_size=VOCAB,
                max_position_embeddings=32,
            ),
            t.BertModel,
        ),
        "llama": (
            t.LlamaConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                vocab_size=VOCAB,
            ),
            t.LlamaForCausalLM,
        ),
        "mistral": (
            t.MistralConfig(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                vocab_size=VOCAB,
                sliding_window=3,
            ),
            t.MistralForCausalLM,
        ),
        "gemma2": (
            t.Gemma2Config(
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                vocab_size=VOCAB,
                sliding_window=3,
                attn_logit_softcapping=0.5,
                query_pre_attn_scalar=8,
            ),
            t.Gemma2ForCausalLM,
        ),
        "gpt_oss": (
            t.GptOssConfig(
                hidden_size=32,
                intermediate_size=32,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
                head_dim=8,
                vocab_size=VOCAB,
                num_local_experts=2,
                num_experts_per_tok=1,
                sliding_window=3,
            ),
            t.GptOssForCausalLM,
        ),
        "t5": (
            t.T5Config(
                d_model=16,
                d_kv=4,
                d_ff=32,
                num_layers=2,
                num_decoder_layers=2,
                num_heads=4,
                vocab_size=VOCAB,
                relative_attention_num_buckets=8,
                decoder_start_token_id=0,
            ),
            t.T5ForConditionalGeneration,
        ),
        "bart": (
            t.BartConfig(
                d_model=16,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=4,
                decoder_attention_heads=4,
                encoder_ffn_dim=32,
                decoder_ffn_dim=32,
                vocab_size=VOCAB,
                max_position_embeddings=32,
            ),
            t.BartForConditionalGeneration,
        ),
        "whisper": (
            t.WhisperConfig(
                d_model=16,
                encoder_layers=1,
                decoder_layers=1,
                encoder_attention_heads=2,
                decoder_attention_heads=2,
                encoder_ffn_dim=32,
                decoder_ffn_dim=32,
                num_mel_bins=8,
                max_source_positions=6,
                max_target_positions=16,
                vocab_size=VOCAB,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
                decoder_start_token_id=1,
            ),
            t.WhisperForConditionalGeneration,
        ),
        "vit": (
            t.ViTConfig(
                image_size=8,
                patch_size=4,
                num_channels=3,
                hidden_size=16,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=32,
            ),
            t.ViTModel,
        ),
    }


MODELS = tuple(_configs())
ENCODER_DECODER = ("t5", "bart", "whisper")


def build(name: str, attn: str | None = None, seed: int = 0):
    """A fresh tiny model in eval mode (its own config object; ``attn`` None = the default backend)."""
    config, cls = _configs()[name]
    torch.manual_seed(seed)
    kwargs = {} if attn is None else {"attn_implementation": attn}
    return cls._from_config(config, **kwargs).eval()


def twin(model, attn: str = "eager"):
    """The same weights on a separate config object running ``attn``."""
    config = copy.deepcopy(model.config)
    other = type(model)._from_config(config, attn_implementation=attn).eval()
    other.load_state_dict(model.state_dict())
    return other


def padded_mask(batch: int, length: int, padding: str) -> torch.Tensor:
    """1 = token, 0 = padding; row 0 padded by 2 on ``padding`` side, row 1 full."""
    mask = torch.ones(batch, length, dtype=torch.long)
    if padding == "left":
        mask[0, :2] = 0
    elif padding == "right":
        mask[0, -2:] = 0
    return mask


def inputs(name: str, padding: str = "right", length: int = 7, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (2, length), generator=g)
    mask = padded_mask(2, length, padding)
    if name == "vit":
        return {"pixel_values": torch.randn(2, 3, 8, 8, generator=g)}
    if name == "whisper":
        return {
            "input_features": torch.randn(2, 8, 12, generator=g),
            "decoder_input_ids": ids[:, :5],
            "decoder_attention_mask": mask[:, :5] if padding == "right" else padded_mask(2, 5, padding),
        }
    if name in ("t5", "bart"):
        dec = torch.randint(3, VOCAB, (2, 5), generator=g)
        return {
            "input_ids": ids,
            "attention_mask": mask,
            "decoder_input_ids": dec,
            "decoder_attention_mask": padded_mask(2, 5, padding),
        }
    return {"input_ids": ids, "attention_mask": mask}


def eager_attentions(model, batch: dict) -> dict[tuple[str | None, str], list[torch.Tensor]]:
    """The model's own eager ``output_attentions`` weights, keyed by (stack, kind), in layer order."""
    reference = twin(model, "eager")
    with torch.no_grad():
        out = reference(**batch, output_attentions=True)
    if hasattr(out, "encoder_attentions"):
        return {
            ("encoder", "self"): list(out.encoder_attentions),
            ("decoder", "self"): list(out.decoder_attentions),
            ("decoder", "cross"): list(out.cross_attentions),
        }
    return {(None, "self"): list(out.attentions)}


def group_records(cap) -> dict[tuple[str | None, str], list]:
    groups: dict = {}
    for r in cap:
        groups.setdefault((r.meta.get("stack"), r.kind), []).append(r)
    return groups


def real_rows(record) -> torch.Tensor:
    """(batch, 1, query, 1) True for query rows that are not padding."""
    if record.query_padding is None:
        return torch.ones(record.weights.shape[0], 1, record.weights.shape[2], 1, dtype=torch.bool)
    return (~record.query_padding)[:, None, :, None]


def max_error_on_real_rows(record, reference: torch.Tensor) -> float:
    rows = real_rows(record).expand_as(reference)
    return float((record.weights.float() - reference.float()).abs()[rows].max())


def hook_counts(model) -> dict[str, int]:
    """Hooks per module, to compare before and after a capture on models that carry hooks of their own
    (transformers installs permanent output-capturing hooks the first time output_attentions is asked)."""
    attrs = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
    return {name: sum(len(getattr(m, a, {}) or {}) for a in attrs) for name, m in model.named_modules()}


def plain_and_captured(model, *args, **options):
    """(output without capture, output under ``capture(model, **options)``, the Capture), no grad."""
    with torch.no_grad():
        plain = model(*args)
        with attnprobe.capture(model, **options) as cap:
            captured = model(*args)
    return plain, captured, cap
