"""A sweep over Hugging Face model families built from tiny configs (no download).

For every family: outputs bitwise unchanged under a default capture, one record per attention call,
every (sub)config's implementation restored, records equal to the model's own eager weights, and
``attnprobe.check`` ok. Old-style families (read from the installed transformers' source: which they are changes
between releases) must warn and fall back to output_attentions weights.
A family whose *construction* fails in the installed transformers is skipped with the reason; a
capture failure is never skipped. Every family is swept again on eager (``test_family_on_eager``), every family
whose model class runs on flex attention on flex (``test_family_on_flex``, torch's reference path of the kernel),
every family on the attention interface as a statistics capture (``test_family_statistics``), every decoder
with a language-modelling head generating (``test_family_generation``), every encoder-decoder, speech-to-text
and image-text-to-text model generating (``test_family_generation_after_an_encoder``), and every family on sdpa and
on flex compared with its eager twin (``test_family_compares_equal_to_its_eager_twin``).
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import warnings
from dataclasses import replace

import flex_helpers
import pytest
import torch
from hf_helpers import hook_counts, max_error_on_real_rows, real_rows, transformers, twin

import attnprobe

VOCAB = 99
TEXT = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
)
DECODER = dict(TEXT, num_key_value_heads=2, head_dim=8)
SEQ2SEQ = dict(
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=64,
    decoder_ffn_dim=64,
    vocab_size=VOCAB,
    max_position_embeddings=64,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    decoder_start_token_id=1,
)
T5 = dict(
    d_model=32,
    d_kv=8,
    d_ff=64,
    num_layers=2,
    num_decoder_layers=2,
    num_heads=4,
    vocab_size=VOCAB,
    relative_attention_num_buckets=8,
    decoder_start_token_id=0,
    pad_token_id=0,
    eos_token_id=1,
)
VISION = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    image_size=16,
    patch_size=4,
    num_channels=3,
)
AUDIO = dict(
    hidden_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=64,
    vocab_size=VOCAB,
    conv_dim=(16, 16),
    conv_stride=(4, 4),
    conv_kernel=(8, 4),
    num_feat_extract_layers=2,
    num_conv_pos_embeddings=4,
    num_conv_pos_embedding_groups=2,
)

SEED5 = torch.Generator().manual_seed(5)
DETR = dict(
    use_timm_backbone=False,
    use_pretrained_backbone=False,
    num_queries=4,
    backbone_config=dict(
        model_type="resnet", embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], out_features=["stage1", "stage2"]
    ),
    **{k: v for k, v in SEQ2SEQ.items() if k.endswith(("layers", "heads", "ffn_dim")) or k == "d_model"},
)


def _qwen_vl_inputs() -> dict:
    """Two 16x16 images as Qwen2-VL takes them: 4x4 patches of 4x4 pixels over 2 frames, flattened (3*2*4*4 values),
    merged 2x2 into the 4 image tokens at positions 2..5 (``mm_token_type_ids`` marks them for M-RoPE)."""
    mm = torch.zeros(2, 12, dtype=torch.long)
    mm[:, 2:6] = 1
    return {
        "pixel_values": torch.randn(32, 96, generator=torch.Generator().manual_seed(4)),
        "image_grid_thw": torch.tensor([[1, 4, 4], [1, 4, 4]]),
        "mm_token_type_ids": mm,
    }


QWEN_VL_TEXT = dict(
    DECODER, vocab_size=120, rope_parameters={"rope_type": "default", "mrope_section": [1, 1, 2], "rope_theta": 10000.0}
)
QWEN_VL_VISION = dict(depth=2, hidden_size=32, num_heads=4, patch_size=4, spatial_merge_size=2, temporal_patch_size=2)
QWEN_VL_TOKENS = dict(image_token_id=110, vision_start_token_id=111, vision_end_token_id=112)

# family -> (config class, config kwargs, inputs kind); inputs kinds are described in `make_inputs`
FAMILIES = {
    # ---- encoders (bidirectional, right padding)
    "bert": ("BertConfig", TEXT, "encoder"),
    "roberta": ("RobertaConfig", dict(TEXT, pad_token_id=1), "encoder"),
    "xlm-roberta": ("XLMRobertaConfig", dict(TEXT, pad_token_id=1), "encoder"),
    "camembert": ("CamembertConfig", dict(TEXT, pad_token_id=1), "encoder"),
    "roberta-prelayernorm": ("RobertaPreLayerNormConfig", dict(TEXT, pad_token_id=1), "encoder"),
    "data2vec-text": ("Data2VecTextConfig", dict(TEXT, pad_token_id=1), "encoder"),
    "electra": ("ElectraConfig", dict(TEXT, embedding_size=16), "encoder"),
    "albert": ("AlbertConfig", dict(TEXT, embedding_size=16), "encoder"),
    "distilbert": (
        "DistilBertConfig",
        dict(
            dim=32, n_layers=2, n_heads=4, hidden_dim=64, vocab_size=VOCAB, max_position_embeddings=64, pad_token_id=0
        ),
        "encoder",
    ),
    "mpnet": ("MPNetConfig", dict(TEXT, pad_token_id=1), "encoder"),
    "ernie": ("ErnieConfig", TEXT, "encoder"),
    "megatron-bert": ("MegatronBertConfig", TEXT, "encoder"),
    "esm": ("EsmConfig", dict(TEXT, pad_token_id=1, mask_token_id=3), "encoder"),
    "deberta": ("DebertaConfig", TEXT, "encoder"),
    "deberta-v2": ("DebertaV2Config", TEXT, "encoder"),
    "squeezebert": ("SqueezeBertConfig", dict(TEXT, embedding_size=32), "encoder"),
    "mobilebert": (
        "MobileBertConfig",
        dict(TEXT, embedding_size=16, intra_bottleneck_size=32, true_hidden_size=32, num_feedforward_networks=1),
        "encoder",
    ),
    "convbert": ("ConvBertConfig", dict(TEXT, embedding_size=32, head_ratio=2), "encoder"),
    "canine": (
        "CanineConfig",
        dict(TEXT, downsampling_rate=2, num_hash_buckets=64, num_hash_functions=2, local_transformer_stride=4),
        "encoder",
    ),
    "rembert": ("RemBertConfig", dict(TEXT, input_embedding_size=16, output_embedding_size=16), "encoder"),
    "xmod": ("XmodConfig", dict(TEXT, pad_token_id=1, languages=["en_XX"], default_language="en_XX"), "encoder"),
    "ibert": ("IBertConfig", dict(TEXT, pad_token_id=1), "encoder"),
    "nystromformer": ("NystromformerConfig", dict(TEXT, num_landmarks=7, segment_means_seq_len=7), "encoder"),
    "big-bird": ("BigBirdConfig", dict(TEXT, attention_type="original_full"), "encoder"),
    "longformer": ("LongformerConfig", dict(TEXT, pad_token_id=1, attention_window=4), "encoder"),
    "layoutlm": ("LayoutLMConfig", TEXT, "encoder"),
    "markuplm": ("MarkupLMConfig", dict(TEXT, pad_token_id=1), "encoder"),
    "roc-bert": ("RoCBertConfig", dict(TEXT, pronunciation_vocab_size=16, shape_vocab_size=16), "encoder"),
    "xlm": (
        "XLMConfig",
        dict(vocab_size=VOCAB, emb_dim=32, n_layers=2, n_heads=4, max_position_embeddings=64, pad_index=0),
        "encoder",
    ),
    "flaubert": (
        "FlaubertConfig",
        dict(vocab_size=VOCAB, emb_dim=32, n_layers=2, n_heads=4, max_position_embeddings=64, pad_index=0),
        "encoder",
    ),
    "xlnet": ("XLNetConfig", dict(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=4, d_inner=64), "encoder"),
    "modernbert": ("ModernBertConfig", dict(TEXT, global_attn_every_n_layers=2, local_attention=4), "encoder"),
    "roformer": ("RoFormerConfig", dict(TEXT, embedding_size=32), "encoder"),
    "nomic-bert": ("NomicBertConfig", TEXT, "encoder"),
    "eurobert": ("EuroBertConfig", DECODER, "encoder"),
    "bert-generation": ("BertGenerationConfig", TEXT, "encoder"),
    "xlm-roberta-xl": ("XLMRobertaXLConfig", dict(TEXT, pad_token_id=1), "encoder"),
    "luke": ("LukeConfig", dict(TEXT, entity_vocab_size=16, entity_emb_size=16), "encoder"),
    "splinter": ("SplinterConfig", TEXT, "encoder"),
    "tapas": ("TapasConfig", TEXT, "encoder"),
    "gte": ("GteConfig", TEXT, "encoder"),
    "jina-embeddings-v3": ("JinaEmbeddingsV3Config", dict(TEXT, pad_token_id=1), "encoder"),
    "layoutlmv3": (
        "LayoutLMv3Config",
        dict(
            TEXT,
            pad_token_id=1,
            visual_embed=False,
            coordinate_size=6,
            shape_size=4,
            rel_pos_bins=8,
            max_rel_pos=16,
            rel_2d_pos_bins=8,
            max_rel_2d_pos=16,
        ),
        "layout",
    ),
    "lilt": ("LiltConfig", dict(TEXT, hidden_size=48, pad_token_id=1, channel_shrink_ratio=2), "layout"),
    "bros": ("BrosConfig", dict(TEXT, hidden_size=64), "layout"),  # its box sinusoids take hidden_size // 32 (>= 2)
    "clap-text": ("ClapTextConfig", dict(TEXT, pad_token_id=1), "encoder", {"model": "ClapTextModel"}),
    "flava-text": ("FlavaTextConfig", TEXT, "encoder", {"model": "FlavaTextModel"}),
    "mra": ("MraConfig", dict(TEXT, pad_token_id=1), "encoder"),
    "yoso": ("YosoConfig", dict(TEXT, pad_token_id=1), "encoder"),
    # ---- decoders (causal, left padding)
    "gpt2": ("GPT2Config", dict(TEXT, n_positions=64), "causal"),
    "gpt-neo": ("GPTNeoConfig", dict(TEXT, attention_types=[[["global", "local"], 1]], window_size=4), "causal"),
    "gptj": ("GPTJConfig", dict(TEXT, rotary_dim=4), "causal"),
    "gpt-neox": ("GPTNeoXConfig", TEXT, "causal"),
    "gpt-bigcode": ("GPTBigCodeConfig", dict(TEXT, multi_query=True), "causal"),
    "opt": ("OPTConfig", dict(TEXT, ffn_dim=64, word_embed_proj_dim=32), "causal"),
    "bloom": ("BloomConfig", TEXT, "causal"),
    "falcon": ("FalconConfig", dict(TEXT, new_decoder_architecture=True, num_kv_heads=2), "causal"),
    "falcon-eager": (
        "FalconConfig",
        dict(TEXT, new_decoder_architecture=True, num_kv_heads=2),
        "causal",
        {"attn": "eager"},
    ),
    "codegen": ("CodeGenConfig", dict(TEXT, rotary_dim=4, n_ctx=64), "causal"),
    "mpt": ("MptConfig", dict(TEXT, expansion_ratio=2), "causal"),
    "xglm": ("XGLMConfig", dict(TEXT, ffn_dim=64), "causal"),
    "biogpt": ("BioGptConfig", TEXT, "causal"),
    "openai-gpt": ("OpenAIGPTConfig", TEXT, "causal"),
    "llama": ("LlamaConfig", DECODER, "causal"),
    "mistral": ("MistralConfig", dict(DECODER, sliding_window=3), "causal"),
    "mixtral": ("MixtralConfig", dict(DECODER, num_local_experts=2, num_experts_per_tok=1), "causal"),
    "qwen2": ("Qwen2Config", DECODER, "causal"),
    "qwen2-moe": (
        "Qwen2MoeConfig",
        dict(
            DECODER, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32, shared_expert_intermediate_size=32
        ),
        "causal",
    ),
    "qwen3": ("Qwen3Config", DECODER, "causal"),
    "qwen3-moe": (
        "Qwen3MoeConfig",
        dict(DECODER, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=32),
        "causal",
    ),
    "phi": ("PhiConfig", TEXT, "causal"),
    "phi3": ("Phi3Config", DECODER, "causal"),
    "gemma": ("GemmaConfig", DECODER, "causal"),
    "gemma2": (
        "Gemma2Config",
        dict(DECODER, sliding_window=3, attn_logit_softcapping=0.5, query_pre_attn_scalar=8),
        "causal",
    ),
    "gemma3-text": ("Gemma3TextConfig", dict(DECODER, sliding_window=3, query_pre_attn_scalar=8), "causal"),
    # Gemma 4 and glm_moe_dsa branch on the implementation's name (captured on their own path since issue 32)
    "gemma4-text": (
        "Gemma4TextConfig",
        dict(
            DECODER,
            global_head_dim=8,
            sliding_window=3,
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "causal",
    ),
    "glm-moe-dsa": (
        "GlmMoeDsaConfig",
        dict(
            DECODER,
            num_key_value_heads=4,
            moe_intermediate_size=16,
            n_routed_experts=4,
            num_experts_per_tok=2,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=4,
            v_head_dim=8,
            qk_nope_head_dim=8,
            head_dim=4,
            index_topk=16,  # more than the sequence: the sparse mask keeps every causal key
            index_head_dim=8,
            index_n_heads=2,
            first_k_dense_replace=1,
        ),
        "causal",
    ),
    "starcoder2": ("Starcoder2Config", DECODER, "causal"),
    "cohere": ("CohereConfig", DECODER, "causal"),
    "cohere2": ("Cohere2Config", dict(DECODER, sliding_window=3), "causal"),
    "olmo": ("OlmoConfig", DECODER, "causal"),
    "olmo2": ("Olmo2Config", DECODER, "causal"),
    "olmoe": ("OlmoeConfig", dict(DECODER, num_experts=2, num_experts_per_tok=1), "causal"),
    "stablelm": ("StableLmConfig", DECODER, "causal"),
    "granite": ("GraniteConfig", DECODER, "causal"),
    "granitemoe": ("GraniteMoeConfig", dict(DECODER, num_local_experts=2, num_experts_per_tok=1), "causal"),
    "persimmon": ("PersimmonConfig", TEXT, "causal"),
    "glm": ("GlmConfig", DECODER, "causal"),
    "glm4": ("Glm4Config", DECODER, "causal"),
    "helium": ("HeliumConfig", DECODER, "causal"),
    "nemotron": ("NemotronConfig", DECODER, "causal"),
    "gpt-oss": (
        "GptOssConfig",
        dict(DECODER, intermediate_size=32, num_local_experts=2, num_experts_per_tok=1, sliding_window=3),
        "causal",
    ),
    "smollm3": ("SmolLM3Config", DECODER, "causal"),
    "ctrl": ("CTRLConfig", dict(TEXT, dff=64), "causal"),
    "dbrx": (
        "DbrxConfig",
        dict(
            d_model=32,
            n_heads=4,
            n_layers=2,
            max_seq_len=64,
            vocab_size=VOCAB,
            attn_config=dict(kv_n_heads=2, rope_theta=10000.0, clip_qkv=8.0),
            ffn_config=dict(ffn_hidden_size=32, moe_num_experts=2, moe_top_k=1),
        ),
        "causal",
    ),
    "jetmoe": (
        "JetMoeConfig",
        dict(TEXT, num_key_value_heads=2, num_local_experts=2, num_experts_per_tok=2, kv_channels=8),
        "causal",
    ),
    "bitnet": ("BitNetConfig", DECODER, "causal"),
    "exaone4": ("Exaone4Config", dict(DECODER, sliding_window=3), "causal"),
    "arcee": ("ArceeConfig", DECODER, "causal"),
    "ministral": ("MinistralConfig", dict(DECODER, sliding_window=3), "causal"),
    "mistral4": (  # multi-head latent attention (q and kv low-rank, a rope part and a no-rope part), MoE
        "Mistral4Config",
        dict(
            DECODER,
            num_key_value_heads=4,
            moe_intermediate_size=16,
            n_shared_experts=1,
            n_routed_experts=4,
            num_experts_per_tok=2,
            kv_lora_rank=16,
            q_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            qk_head_dim=8,
            v_head_dim=8,
        ),
        "causal",
    ),
    "longcat-flash": (  # latent attention, two attention calls per layer, zero-computation experts
        "LongcatFlashConfig",
        dict(
            TEXT,
            num_layers=2,
            num_key_value_heads=4,
            ffn_hidden_size=64,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            qk_head_dim=8,
            head_dim=4,
            v_head_dim=8,
            moe_topk=2,
            n_routed_experts=4,
            zero_expert_num=2,
            expert_ffn_hidden_size=16,
        ),
        "causal",
    ),
    "deepseek-v3": (
        "DeepseekV3Config",
        dict(
            TEXT,
            num_key_value_heads=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            n_routed_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
        "causal",
    ),
    "hunyuan-dense": ("HunYuanDenseV1Config", DECODER, "causal"),
    "seed-oss": ("SeedOssConfig", DECODER, "causal"),
    "jamba": (
        "JambaConfig",
        dict(
            DECODER,
            attn_layer_period=2,
            attn_layer_offset=1,
            num_experts=2,
            num_experts_per_tok=1,
            expert_layer_period=2,
            mamba_d_state=8,
            mamba_d_conv=2,
            mamba_dt_rank=4,
            mamba_expand=2,
            use_mamba_kernels=False,
        ),
        "causal",
    ),
    "olmo3": ("Olmo3Config", dict(DECODER, sliding_window=3), "causal"),
    "apertus": ("ApertusConfig", DECODER, "causal"),
    "ernie4-5": ("Ernie4_5Config", DECODER, "causal"),
    "ernie4-5-moe": (
        "Ernie4_5_MoeConfig",
        dict(DECODER, moe_num_experts=2, moe_k=1, moe_intermediate_size=16),
        "causal",
    ),
    "hunyuan-moe": ("HunYuanMoEV1Config", dict(DECODER, num_experts=2, moe_topk=1, moe_intermediate_size=16), "causal"),
    "deepseek-v2": (
        "DeepseekV2Config",
        dict(
            TEXT,
            num_key_value_heads=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            n_routed_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
        "causal",
    ),
    "minicpm3": (
        "MiniCPM3Config",
        dict(
            TEXT,
            num_key_value_heads=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
        ),
        "causal",
    ),
    "dots1": (
        "Dots1Config",
        dict(
            DECODER,
            n_routed_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
            n_shared_experts=1,
            routed_scaling_factor=1.0,
        ),
        "causal",
    ),
    "glm4-moe": (
        "Glm4MoeConfig",
        dict(
            DECODER,
            n_routed_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
        "causal",
    ),
    "phimoe": ("PhimoeConfig", dict(DECODER, num_local_experts=2, num_experts_per_tok=1), "causal"),
    "granitemoeshared": (
        "GraniteMoeSharedConfig",
        dict(DECODER, num_local_experts=2, num_experts_per_tok=1, shared_intermediate_size=32),
        "causal",
    ),
    "flex-olmo": ("FlexOlmoConfig", dict(DECODER, num_experts=2, num_experts_per_tok=1), "causal"),
    "internlm3": ("InternLM3Config", DECODER, "causal"),
    "cwm": ("CwmConfig", dict(DECODER, sliding_window=3), "causal"),
    "doge": ("DogeConfig", dict(DECODER, keep_window_size=4), "causal"),
    "vaultgemma": ("VaultGemmaConfig", dict(DECODER, sliding_window=3, query_pre_attn_scalar=8), "causal"),
    "gemma3n-text": (
        "Gemma3nTextConfig",
        dict(
            DECODER,
            sliding_window=3,
            vocab_size_per_layer_input=VOCAB,
            hidden_size_per_layer_input=8,
            laurel_rank=4,
            num_kv_shared_layers=0,
            activation_sparsity_pattern=[0.0, 0.0],
            altup_num_inputs=2,
            layer_types=["sliding_attention", "full_attention"],
        ),
        "causal",
    ),
    "modernbert-decoder": (
        "ModernBertDecoderConfig",
        dict(TEXT, global_attn_every_n_layers=2, local_attention=4),
        "causal",
    ),
    "gpt-neox-japanese": ("GPTNeoXJapaneseConfig", TEXT, "causal"),
    # differential attention: two interface calls per layer on the same q and k (two value halves)
    "diffllama": ("DiffLlamaConfig", DECODER, "causal"),
    # hybrids: the attention layers among Mamba / convolution / linear-attention layers
    "zamba": (  # Mamba layers, with one shared attention block in layers 2 and 5 (transformers ties its weights:
        # fewer layers than two shared ones fail in transformers' own tying)
        "ZambaConfig",
        dict(
            TEXT,
            num_hidden_layers=6,
            attention_hidden_size=64,
            attention_head_dim=16,
            num_key_value_heads=4,
            n_mamba_heads=2,
            mamba_d_state=4,
            mamba_dt_rank=4,
            attn_layer_period=3,
            attn_layer_offset=2,
        ),
        "causal",
    ),
    "zamba2": (
        "Zamba2Config",
        dict(
            DECODER,
            layer_types=["mamba", "hybrid"],
            hybrid_layer_ids=[1],
            mamba_d_state=8,
            mamba_d_conv=2,
            mamba_expand=2,
            mamba_headdim=8,
            n_mamba_heads=8,
            attention_head_dim=16,
            adapter_rank=4,
            use_mem_eff_path=False,
        ),
        "causal",
    ),
    "falcon-h1": (
        "FalconH1Config",
        dict(
            DECODER, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_d_state=8, mamba_d_conv=2, mamba_n_groups=1
        ),
        "causal",
    ),
    "granitemoehybrid": (
        "GraniteMoeHybridConfig",
        dict(
            DECODER,
            num_local_experts=2,
            num_experts_per_tok=1,
            layer_types=["mamba", "attention"],
            mamba_d_state=8,
            mamba_d_conv=2,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=1,
            shared_intermediate_size=32,
        ),
        "causal",
    ),
    "bamba": (
        "BambaConfig",
        dict(
            DECODER,
            attn_layer_indices=[1],
            mamba_d_state=8,
            mamba_d_conv=2,
            mamba_n_heads=4,
            mamba_d_head=16,
            mamba_n_groups=1,
        ),
        "causal",
    ),
    "nemotron-h": (
        "NemotronHConfig",
        dict(
            DECODER,
            hybrid_override_pattern="M*",
            mamba_num_heads=4,
            mamba_head_dim=16,
            ssm_state_size=8,
            n_groups=1,
            conv_kernel=2,
            expand=2,
        ),
        "causal",
    ),
    "recurrent-gemma": (
        "RecurrentGemmaConfig",
        dict(DECODER, block_types=["recurrent", "attention"], lru_width=32, attention_window_size=4, conv1d_width=2),
        "causal",
    ),
    "lfm2": ("Lfm2Config", dict(DECODER, layer_types=["conv", "full_attention"]), "causal"),
    "lfm2-moe": (
        "Lfm2MoeConfig",
        dict(
            DECODER,
            layer_types=["conv", "full_attention"],
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            num_dense_layers=1,
        ),
        "causal",
    ),
    "qwen3-next": (
        "Qwen3NextConfig",
        dict(
            DECODER,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
            layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=2,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
        ),
        "causal",
    ),
    "minimax": (
        "MiniMaxConfig",
        dict(DECODER, num_local_experts=2, num_experts_per_tok=1, layer_types=["linear_attention", "full_attention"]),
        "causal",
    ),
    # text tokens only: its VQ image tokenizer is built but not run
    "chameleon": (
        "ChameleonConfig",
        dict(
            DECODER,
            vocab_size=120,
            vocabulary_map={"<image>": 110},
            image_token_id=110,
            vq_config=dict(
                embed_dim=8,
                num_embeddings=16,
                base_channels=32,
                channel_multiplier=[1, 2],
                num_res_blocks=1,
                attn_resolutions=[],
                resolution=16,
                latent_channels=8,
            ),
        ),
        "causal",
    ),
    "emu3-text": ("Emu3TextConfig", DECODER, "causal", {"model": "Emu3TextModel"}),
    "musicgen": (
        "MusicgenDecoderConfig",
        dict(
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=4,
            ffn_dim=64,
            vocab_size=VOCAB,
            num_codebooks=2,
            max_position_embeddings=64,
            pad_token_id=0,
            bos_token_id=1,
        ),
        "codebooks",
        {"model": "MusicgenModel"},
    ),
    "qwen3-5-text": (
        "Qwen3_5TextConfig",
        dict(
            DECODER,
            layer_types=["linear_attention", "full_attention"],
            linear_num_value_heads=2,
            linear_num_key_heads=2,
            linear_key_head_dim=8,
            linear_value_head_dim=8,
        ),
        "causal",
    ),
    "exaone-moe": (
        "ExaoneMoeConfig",
        dict(DECODER, num_experts=2, num_experts_per_tok=1, moe_intermediate_size=16, sliding_window=3),
        "causal",
    ),
    "glm4-moe-lite": (
        "Glm4MoeLiteConfig",
        dict(
            TEXT,
            num_key_value_heads=4,
            q_lora_rank=16,
            kv_lora_rank=16,
            qk_rope_head_dim=4,
            qk_nope_head_dim=4,
            v_head_dim=8,
            n_routed_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            first_k_dense_replace=1,
            n_group=1,
            topk_group=1,
        ),
        "causal",
    ),
    "afmoe": (
        "AfmoeConfig",
        dict(
            DECODER,
            num_experts=2,
            num_experts_per_tok=1,
            moe_intermediate_size=16,
            num_dense_layers=1,
            sliding_window=3,
        ),
        "causal",
    ),
    "llama4-text": (
        "Llama4TextConfig",
        dict(
            DECODER,
            num_local_experts=2,
            num_experts_per_tok=1,
            intermediate_size_mlp=64,
            no_rope_layers=[0, 1],
            attention_chunk_size=4,
        ),
        "causal",
    ),
    # ---- encoder-decoders (right padding on both sides)
    "t5": ("T5Config", T5, "seq2seq"),
    "mt5": ("MT5Config", T5, "seq2seq"),
    "umt5": ("UMT5Config", T5, "seq2seq"),
    "longt5": ("LongT5Config", T5, "seq2seq"),
    "switch-transformers": (
        "SwitchTransformersConfig",
        dict(T5, num_experts=2, encoder_sparse_step=2, decoder_sparse_step=2),
        "seq2seq",
    ),
    "bart": ("BartConfig", SEQ2SEQ, "seq2seq"),
    "mbart": ("MBartConfig", SEQ2SEQ, "seq2seq"),
    "pegasus": ("PegasusConfig", SEQ2SEQ, "seq2seq"),
    "marian": ("MarianConfig", dict(SEQ2SEQ, decoder_start_token_id=0), "seq2seq"),
    "m2m100": ("M2M100Config", SEQ2SEQ, "seq2seq"),
    "nllb-moe": (
        "NllbMoeConfig",
        dict(SEQ2SEQ, num_experts=2, encoder_sparse_step=2, decoder_sparse_step=2),
        "seq2seq",
    ),
    "blenderbot": ("BlenderbotConfig", SEQ2SEQ, "seq2seq"),
    "blenderbot-small": ("BlenderbotSmallConfig", SEQ2SEQ, "seq2seq"),
    "plbart": ("PLBartConfig", SEQ2SEQ, "seq2seq"),
    "prophetnet": (
        "ProphetNetConfig",
        dict(
            hidden_size=32,
            encoder_ffn_dim=64,
            decoder_ffn_dim=64,
            num_encoder_layers=2,
            num_decoder_layers=2,
            num_encoder_attention_heads=4,
            num_decoder_attention_heads=4,
            vocab_size=VOCAB,
            ngram=2,
            num_buckets=8,
            relative_max_distance=16,
            pad_token_id=0,
            decoder_start_token_id=1,
        ),
        "seq2seq",
    ),
    # FSMT builds no causal mask when use_cache is on (its default): check() flags the decoder's future
    # weights, which is what the model computes; a full forward without the cache is causal
    "fsmt": (
        "FSMTConfig",
        dict(SEQ2SEQ, src_vocab_size=VOCAB, tgt_vocab_size=VOCAB, langs=["en", "de"]),
        "seq2seq",
        {"inputs": {"use_cache": False}},
    ),
    "mvp": ("MvpConfig", SEQ2SEQ, "seq2seq"),
    "t5gemma": (
        "T5GemmaConfig",
        dict(
            encoder=dict(DECODER, sliding_window=3, query_pre_attn_scalar=8),
            decoder=dict(DECODER, sliding_window=3, query_pre_attn_scalar=8),
            vocab_size=VOCAB,
        ),
        "seq2seq",
    ),
    # composites: a BERT encoder and a BERT decoder with cross-attention; ViT and GPT-2
    "encoder-decoder": (
        "EncoderDecoderConfig",
        dict(
            encoder=dict(TEXT, model_type="bert"),
            decoder=dict(TEXT, model_type="bert", is_decoder=True, add_cross_attention=True),
            decoder_start_token_id=1,
            pad_token_id=0,
        ),
        "seq2seq",
        {"model": "EncoderDecoderModel"},
    ),
    "vision-encoder-decoder": (
        "VisionEncoderDecoderConfig",
        dict(
            encoder=dict(VISION, model_type="vit"),
            decoder=dict(TEXT, model_type="gpt2", n_positions=64, is_decoder=True, add_cross_attention=True),
            decoder_start_token_id=1,
            pad_token_id=0,
        ),
        "image2text",
        {"model": "VisionEncoderDecoderModel"},
    ),
    "led": (
        "LEDConfig",
        dict(SEQ2SEQ, attention_window=4, max_encoder_position_embeddings=64, max_decoder_position_embeddings=64),
        "seq2seq",
    ),
    "bigbird-pegasus": ("BigBirdPegasusConfig", dict(SEQ2SEQ, attention_type="original_full"), "seq2seq"),
    "whisper": (
        "WhisperConfig",
        dict(SEQ2SEQ, num_mel_bins=8, max_source_positions=6, max_target_positions=16),
        "whisper",
    ),
    "speech-to-text": (
        "Speech2TextConfig",
        dict(
            SEQ2SEQ,
            input_feat_per_channel=8,
            num_conv_layers=1,
            conv_kernel_sizes=(5,),
            conv_channels=16,
            max_source_positions=32,
            max_target_positions=16,
        ),
        "speech2text",
    ),
    # SpeechT5's speech encoder (its convolutional feature encoder over raw samples) and text decoder
    "speecht5": (
        "SpeechT5Config",
        dict(
            {k: v for k, v in SEQ2SEQ.items() if k not in ("d_model", "max_position_embeddings")},
            hidden_size=32,
            encoder_max_relative_position=16,
            max_text_positions=64,
            **{k: v for k, v in AUDIO.items() if k.startswith(("conv", "num_conv"))},
        ),
        "audio2text",
        {"model": "SpeechT5ForSpeechToText"},
    ),
    # ---- vision (no mask)
    "vit": ("ViTConfig", VISION, "image"),
    "deit": ("DeiTConfig", VISION, "image"),
    "beit": ("BeitConfig", dict(VISION, use_relative_position_bias=True), "image"),
    "data2vec-vision": ("Data2VecVisionConfig", dict(VISION, use_relative_position_bias=True), "image"),
    "data2vec-vision-eager": (
        "Data2VecVisionConfig",
        dict(VISION, use_relative_position_bias=True),
        "image",
        {"attn": "eager"},
    ),
    "dinov2": ("Dinov2Config", dict(VISION, mlp_ratio=2), "image"),
    "yolos": ("YolosConfig", dict(VISION, image_size=[16, 16], num_detection_tokens=2), "image"),
    "dinov2-with-registers": ("Dinov2WithRegistersConfig", dict(VISION, mlp_ratio=2, num_register_tokens=2), "image"),
    "dinov3-vit": ("DINOv3ViTConfig", dict(VISION, num_register_tokens=2), "image"),
    "vit-msn": ("ViTMSNConfig", VISION, "image"),
    "ijepa": ("IJepaConfig", VISION, "image"),
    "mlcd": ("MLCDVisionConfig", dict(VISION, num_key_value_groups=1), "image"),
    "aimv2-vision": ("Aimv2VisionConfig", dict(VISION, use_head=True), "image"),  # its pooling head calls sdpa itself
    "pixtral-vision": (
        "PixtralVisionConfig",
        dict(VISION, head_dim=8),
        "image",
        {"inputs": {"image_sizes": torch.tensor([[16, 16], [16, 16]])}},
    ),
    "hiera": (
        "HieraConfig",
        dict(
            image_size=[16, 16],
            patch_size=[3, 3],
            patch_stride=[2, 2],
            patch_padding=[1, 1],
            embed_dim=8,
            num_heads=[1, 2],
            depths=[1, 1],
            query_stride=[2, 2],
            masked_unit_size=[4, 4],
            mlp_ratio=2.0,
            num_query_pool=1,
        ),
        "image",
    ),
    # ---- video: (batch, frames, channels, height, width)
    "videomae": ("VideoMAEConfig", dict(VISION, num_frames=2, tubelet_size=1), "video"),
    "vivit": ("VivitConfig", dict(VISION, num_frames=2, tubelet_size=[1, 4, 4]), "video"),
    "timesformer": ("TimesformerConfig", dict(VISION, num_frames=2), "video"),
    "siglip2-vision": (
        "Siglip2VisionConfig",
        dict(VISION, num_patches=16),
        "image",  # patches flattened, 16 x 48
        {
            "inputs": {
                "pixel_values": torch.randn(2, 16, 48, generator=SEED5),
                "pixel_attention_mask": torch.ones(2, 16, dtype=torch.long),
                "spatial_shapes": torch.tensor([[4, 4], [4, 4]]),
            }
        },
    ),
    "flava-image": ("FlavaImageConfig", VISION, "image", {"model": "FlavaImageModel"}),
    "vitdet": ("VitDetConfig", dict(VISION, pretrain_image_size=16, window_size=2, window_block_indices=[0]), "image"),
    "donut-swin": (
        "DonutSwinConfig",
        dict(image_size=16, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4),
        "image",
    ),
    "swin2sr": (
        "Swin2SRConfig",
        dict(image_size=16, patch_size=1, embed_dim=16, depths=[1], num_heads=[2], window_size=4, upscale=1),
        "image",
    ),
    "mobilevit": (
        "MobileViTConfig",
        dict(
            image_size=16,
            hidden_sizes=[16, 16, 16],
            neck_hidden_sizes=[8, 8, 16, 16, 16, 16, 32],
            num_attention_heads=4,
        ),
        "image",
    ),
    "swin": (
        "SwinConfig",
        dict(image_size=16, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4),
        "image",
    ),
    "swinv2": (
        "Swinv2Config",
        dict(image_size=16, patch_size=2, embed_dim=16, depths=[1, 1], num_heads=[2, 4], window_size=4),
        "image",
    ),
    "clip-vision": ("CLIPVisionConfig", VISION, "image"),
    "siglip-vision": ("SiglipVisionConfig", VISION, "image"),
    "clip-text": ("CLIPTextConfig", dict(TEXT, eos_token_id=2), "causal"),
    "siglip-text": ("SiglipTextConfig", TEXT, "encoder", {"model": "SiglipTextModel"}),
    "clip": (
        "CLIPConfig",
        dict(text_config=dict(TEXT, eos_token_id=2), vision_config=VISION, projection_dim=16),
        "text-image",
    ),
    "siglip": ("SiglipConfig", dict(text_config=TEXT, vision_config=VISION), "text-image"),
    "llava": (
        "LlavaConfig",
        dict(
            text_config=dict(DECODER, vocab_size=120, model_type="llama"),
            vision_config=dict(VISION, model_type="clip_vision_model"),
            image_token_index=110,
            vision_feature_layer=-1,
        ),
        "vlm",
    ),
    "vipllava": (
        "VipLlavaConfig",
        dict(
            text_config=dict(DECODER, vocab_size=120, model_type="llama"),
            vision_config=dict(VISION, model_type="clip_vision_model"),
            image_token_index=110,
            vision_feature_layers=[-2, -1],
        ),
        "vlm",
    ),
    "paligemma": (
        "PaliGemmaConfig",
        dict(
            text_config=dict(DECODER, vocab_size=120, model_type="gemma"),
            vision_config=dict(VISION, model_type="siglip_vision_model"),
            image_token_index=110,
            projection_dim=32,
        ),
        "vlm",
    ),
    # image tokens: the 16 patches merged 2 x 2 (or pooled to mm_tokens_per_image)
    "gemma3": (
        "Gemma3Config",
        dict(
            text_config=dict(
                DECODER, vocab_size=120, model_type="gemma3_text", sliding_window=3, query_pre_attn_scalar=8
            ),
            vision_config=dict(VISION, model_type="siglip_vision_model"),
            image_token_index=110,
            mm_tokens_per_image=4,
            boi_token_index=111,
            eoi_token_index=112,
        ),
        "vlm",
        {"image_tokens": 4},
    ),
    "aya-vision": (
        "AyaVisionConfig",
        dict(
            text_config=dict(DECODER, vocab_size=120, model_type="cohere"),
            vision_config=dict(VISION, model_type="siglip_vision_model"),
            image_token_index=110,
            downsample_factor=2,
        ),
        "vlm",
        {"image_tokens": 4},
    ),
    "mistral3": (
        "Mistral3Config",
        dict(
            text_config=dict(DECODER, vocab_size=120, model_type="mistral"),
            vision_config=dict(VISION, model_type="pixtral", head_dim=8),
            image_token_index=110,
            spatial_merge_size=2,
            vision_feature_layer=-1,
        ),
        "vlm",
        {"image_tokens": 4, "inputs": {"image_sizes": torch.tensor([[16, 16], [16, 16]])}},
    ),
    "internvl": (
        "InternVLConfig",
        dict(
            text_config=dict(DECODER, vocab_size=120, model_type="qwen2"),
            vision_config=dict(VISION, model_type="internvl_vision", image_size=[16, 16], patch_size=[4, 4]),
            image_token_id=110,
            downsample_ratio=0.5,
            vision_feature_layer=-1,
        ),
        "vlm",
        {"image_tokens": 4},
    ),
    # 16 tokens for the base image, 16 + 4 (a newline per row) for its one 16x16 tile
    "llava-next": (
        "LlavaNextConfig",
        dict(
            text_config=dict(DECODER, vocab_size=120, model_type="llama"),
            vision_config=dict(VISION, model_type="clip_vision_model"),
            image_token_index=110,
            image_grid_pinpoints=[[16, 16]],
            vision_feature_layer=-1,
        ),
        "vlm",
        {
            "image_tokens": 36,
            "inputs": {
                "pixel_values": torch.randn(2, 2, 3, 16, 16, generator=SEED5),
                "image_sizes": torch.tensor([[16, 16], [16, 16]]),
            },
        },
    ),
    "idefics3": (
        "Idefics3Config",
        dict(
            text_config=dict(DECODER, vocab_size=120, model_type="llama"),
            vision_config=dict(VISION, model_type="idefics3_vision"),
            image_token_id=110,
            scale_factor=2,
        ),
        "vlm",
        {"image_tokens": 4, "inputs": {"pixel_values": torch.randn(2, 1, 3, 16, 16, generator=SEED5)}},
    ),
    "smolvlm": (
        "SmolVLMConfig",
        dict(
            text_config=dict(DECODER, vocab_size=120, model_type="llama"),
            vision_config=dict(VISION, model_type="smolvlm_vision"),
            image_token_id=110,
            scale_factor=2,
        ),
        "vlm",
        {"image_tokens": 4, "inputs": {"pixel_values": torch.randn(2, 1, 3, 16, 16, generator=SEED5)}},
    ),
    # a Q-Former (self- and cross-attention over the image) between the vision tower and OPT
    "blip-2": (
        "Blip2Config",
        dict(
            text_config=dict(DECODER, vocab_size=120, model_type="opt", ffn_dim=64, word_embed_proj_dim=32),
            vision_config=VISION,
            qformer_config=dict(TEXT, cross_attention_frequency=1, encoder_hidden_size=32),
            num_query_tokens=4,
            image_token_index=110,
        ),
        "vlm",
        {"image_tokens": 4},
    ),
    "instructblip": (
        "InstructBlipConfig",
        dict(
            text_config=dict(DECODER, vocab_size=120, model_type="opt", ffn_dim=64, word_embed_proj_dim=32),
            vision_config=VISION,
            qformer_config=dict(TEXT, cross_attention_frequency=1, encoder_hidden_size=32),
            num_query_tokens=4,
            image_token_index=110,
        ),
        "vlm",
        {
            "image_tokens": 4,
            "inputs": {
                "qformer_input_ids": torch.randint(3, VOCAB, (2, 5), generator=SEED5),
                "qformer_attention_mask": torch.ones(2, 5, dtype=torch.long),
            },
        },
    ),
    # one image token; language layer 1 is a cross-attention layer over the tile's patches
    "mllama": (
        "MllamaConfig",
        dict(
            text_config=dict(DECODER, vocab_size=120, cross_attention_layers=[1], model_type="mllama_text_model"),
            vision_config=dict(
                hidden_size=32,
                num_hidden_layers=2,
                num_global_layers=1,
                attention_heads=4,
                intermediate_size=64,
                image_size=16,
                patch_size=4,
                max_num_tiles=1,
                supported_aspect_ratios=[[1, 1]],
                intermediate_layers_indices=[0],
                vision_output_dim=64,
            ),
            image_token_index=110,
        ),
        "vlm",
        {
            "image_tokens": 1,
            "inputs": {
                "pixel_values": torch.randn(2, 1, 1, 3, 16, 16, generator=SEED5),
                "aspect_ratio_ids": torch.tensor([[1], [1]]),
                "aspect_ratio_mask": torch.ones(2, 1, 1, dtype=torch.long),
            },
        },
    ),
    # four latent queries (a cross-attention over the patches) written at the positions image_embeds_position_mask marks
    "kosmos-2": (
        "Kosmos2Config",
        dict(
            text_config=dict(
                embed_dim=32,
                layers=2,
                ffn_dim=64,
                attention_heads=4,
                vocab_size=VOCAB,
                max_position_embeddings=64,
                pad_token_id=0,
                bos_token_id=1,
                eos_token_id=2,
            ),
            vision_config=VISION,
            latent_query_num=4,
        ),
        "vlm",
        {"image_tokens": 4, "inputs": {"image_embeds_position_mask": torch.tensor([[0, 0, 1, 1, 1, 1] + [0] * 6] * 2)}},
    ),
    # vision attention per image (and per window in Qwen2.5-VL): one call each
    "qwen2-vl": (
        "Qwen2VLConfig",
        dict(text_config=QWEN_VL_TEXT, vision_config=dict(QWEN_VL_VISION, embed_dim=32, mlp_ratio=2), **QWEN_VL_TOKENS),
        "vlm",
        {"image_tokens": 4, "inputs": _qwen_vl_inputs()},
    ),
    "qwen2-5-vl": (
        "Qwen2_5_VLConfig",
        dict(
            text_config=QWEN_VL_TEXT,
            vision_config=dict(
                QWEN_VL_VISION, out_hidden_size=32, intermediate_size=64, window_size=8, fullatt_block_indexes=[1]
            ),
            **QWEN_VL_TOKENS,
        ),
        "vlm",
        {"image_tokens": 4, "inputs": _qwen_vl_inputs()},
    ),
    "owlvit": (
        "OwlViTConfig",
        dict(text_config=dict(TEXT, eos_token_id=2), vision_config=VISION, projection_dim=16),
        "text-image",
    ),
    "owlv2": (
        "Owlv2Config",
        dict(text_config=dict(TEXT, eos_token_id=2), vision_config=VISION, projection_dim=16),
        "text-image",
    ),
    "chinese-clip": (
        "ChineseCLIPConfig",
        dict(text_config=TEXT, vision_config=VISION, projection_dim=16),
        "text-image",
    ),
    "altclip": (
        "AltCLIPConfig",
        dict(text_config=dict(TEXT, pad_token_id=1), vision_config=VISION, projection_dim=16),
        "text-image",
    ),
    "blip": ("BlipConfig", dict(text_config=TEXT, vision_config=VISION, projection_dim=16), "text-image"),
    # the vision tower's 17 tokens (a CLS and one per patch) before the text, in one stack of 24 tokens
    "git": ("GitConfig", dict(TEXT, vision_config=VISION), "image-prefix"),
    # random masking: a fixed noise makes it deterministic
    "vit-mae": (
        "ViTMAEConfig",
        dict(VISION, mask_ratio=0.5),
        "image",
        {"inputs": {"noise": torch.rand(2, 16, generator=torch.Generator().manual_seed(2))}},
    ),
    "dpt": (
        "DPTConfig",
        dict(VISION, neck_hidden_sizes=[8, 8], fusion_hidden_size=8, backbone_out_indices=[0, 1]),
        "image",
    ),
    "pvt": (
        "PvtConfig",
        dict(
            image_size=16,
            num_encoder_blocks=2,
            depths=[1, 1],
            sequence_reduction_ratios=[2, 1],
            hidden_sizes=[16, 32],
            patch_sizes=[4, 2],
            strides=[4, 2],
            num_attention_heads=[2, 4],
            mlp_ratios=[2, 2],
        ),
        "image",
    ),
    "segformer": (
        "SegformerConfig",
        dict(
            num_encoder_blocks=2,
            depths=[1, 1],
            sr_ratios=[2, 1],
            hidden_sizes=[16, 32],
            patch_sizes=[3, 3],
            strides=[2, 2],
            num_attention_heads=[2, 4],
            mlp_ratios=[2, 2],
            image_size=16,
        ),
        "image",
    ),
    "pvt-v2": (
        "PvtV2Config",
        dict(
            image_size=16,
            num_encoder_blocks=2,
            depths=[1, 1],
            sr_ratios=[2, 1],
            hidden_sizes=[16, 32],
            patch_sizes=[3, 3],
            strides=[2, 2],
            num_attention_heads=[2, 4],
            mlp_ratios=[2, 2],
        ),
        "image",
    ),
    "glpn": (
        "GLPNConfig",
        dict(
            num_encoder_blocks=2,
            depths=[1, 1],
            sr_ratios=[2, 1],
            hidden_sizes=[16, 32],
            patch_sizes=[3, 3],
            strides=[2, 2],
            num_attention_heads=[2, 4],
            mlp_ratios=[2, 2],
            decoder_hidden_size=16,
            image_size=16,
        ),
        "image",
    ),
    # ---- detection: an encoder over ResNet features, a decoder over object queries (self and cross)
    "detr": ("DetrConfig", DETR, "detection"),
    "conditional-detr": ("ConditionalDetrConfig", DETR, "detection"),
    "table-transformer": ("TableTransformerConfig", DETR, "detection"),
    "audio-spectrogram-transformer": (
        "ASTConfig",
        dict(VISION, patch_size=4, frequency_stride=4, time_stride=4, max_length=16, num_mel_bins=16),
        "spectrogram",
    ),
    # ---- audio (raw samples, no mask)
    "wav2vec2": ("Wav2Vec2Config", AUDIO, "audio"),
    "hubert": ("HubertConfig", AUDIO, "audio"),
    "data2vec-audio": ("Data2VecAudioConfig", AUDIO, "audio"),
    "sew": ("SEWConfig", dict(AUDIO, squeeze_factor=1), "audio"),
    "unispeech": ("UniSpeechConfig", AUDIO, "audio"),
    "unispeech-sat": ("UniSpeechSatConfig", AUDIO, "audio"),
    "wav2vec2-conformer": (
        "Wav2Vec2ConformerConfig",
        dict(AUDIO, conv_depthwise_kernel_size=3, position_embeddings_type="relative"),
        "audio",
    ),
    "wav2vec2-conformer-rotary": (
        "Wav2Vec2ConformerConfig",
        dict(AUDIO, conv_depthwise_kernel_size=3, position_embeddings_type="rotary"),
        "audio",
    ),
    "sew-d": ("SEWDConfig", dict(AUDIO, squeeze_factor=1, position_buckets=8, max_relative_positions=16), "audio"),
    "wavlm": ("WavLMConfig", dict(AUDIO, num_buckets=8, max_bucket_distance=16), "audio"),
}


# ------------------------------------------------------------------------------ building
def build(name: str, attn_implementation: str | None = None):
    """A fresh tiny model of ``name`` in eval mode on its default backend (or ``attn_implementation``);
    pytest.skip when this transformers cannot construct the family (a missing class or a config it rejects)."""
    config_name, kwargs, _, *extras = FAMILIES[name]
    extras = extras[0] if extras else {}
    missing = [n for n in (config_name, extras.get("model")) if n and not hasattr(transformers, n)]
    if missing:
        pytest.skip(f"transformers {transformers.__version__} has no {missing[0]}")
    implementation = attn_implementation or extras.get("attn")
    attn = {"attn_implementation": implementation} if implementation else {}
    try:
        config = getattr(transformers, config_name)(**copy.deepcopy(kwargs))
        torch.manual_seed(0)
        if "model" in extras:
            model = getattr(transformers, extras["model"])._from_config(config, **attn)
        else:
            model = transformers.AutoModel.from_config(config, **attn)
    except Exception as e:
        pytest.skip(
            f"{name}: cannot build from a tiny config in transformers {transformers.__version__}: "
            f"{type(e).__name__}: {str(e)[:200]}"
        )
    return model.eval()


def padding_mask(length: int, side: str) -> torch.Tensor:
    """(2, length) 1 = token; row 0 padded by 2 on ``side``, row 1 full."""
    mask = torch.ones(2, length, dtype=torch.long)
    if side == "left":
        mask[0, :2] = 0
    else:
        mask[0, -2:] = 0
    return mask


def make_inputs(kind: str, config, image_tokens: int = 16) -> tuple[dict, dict]:
    """(model inputs, declarations for ``check``: the padding masks of the encoder/decoder sides)."""
    g = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(3, VOCAB, (2, n), generator=g)  # noqa: E731
    if kind in ("encoder", "causal"):
        mask = padding_mask(7, "left" if kind == "causal" else "right")
        return {"input_ids": ids(7), "attention_mask": mask}, {"encoder": mask}
    if kind == "seq2seq":
        enc, dec = padding_mask(7, "right"), padding_mask(5, "right")
        return (
            {"input_ids": ids(7), "attention_mask": enc, "decoder_input_ids": ids(5), "decoder_attention_mask": dec},
            {"encoder": enc, "decoder": dec},
        )
    if kind == "image2text":  # a vision encoder, a text decoder with cross-attention
        dec = padding_mask(5, "right")
        return (
            {
                "pixel_values": torch.randn(2, 3, 16, 16, generator=g),
                "decoder_input_ids": ids(5),
                "decoder_attention_mask": dec,
            },
            {"decoder": dec},
        )
    if kind == "whisper":
        dec = padding_mask(5, "right")
        features = torch.randn(2, config.num_mel_bins, 2 * config.max_source_positions, generator=g)
        return {"input_features": features, "decoder_input_ids": ids(5), "decoder_attention_mask": dec}, {
            "decoder": dec
        }
    if kind == "speech2text":
        dec = padding_mask(5, "right")
        features = torch.randn(2, 16, config.input_feat_per_channel, generator=g)
        return {"input_features": features, "decoder_input_ids": ids(5), "decoder_attention_mask": dec}, {
            "decoder": dec
        }
    if kind == "audio2text":
        dec = padding_mask(5, "right")
        samples = torch.randn(2, 400, generator=g)
        return {"input_values": samples, "decoder_input_ids": ids(5), "decoder_attention_mask": dec}, {"decoder": dec}
    if kind == "image":
        size = config.image_size if isinstance(config.image_size, int) else config.image_size[0]
        return {"pixel_values": torch.randn(2, config.num_channels, size, size, generator=g)}, {}
    if kind in ("text-image", "image-prefix"):  # image-prefix: the text stack runs over the image tokens, then the text
        mask = padding_mask(7, "right")
        size = config.vision_config.image_size
        prefix = (size // config.vision_config.patch_size) ** 2 + 1 if kind == "image-prefix" else 0
        return (
            {"input_ids": ids(7), "attention_mask": mask, "pixel_values": torch.randn(2, 3, size, size, generator=g)},
            {"encoder": torch.cat([torch.ones(2, prefix, dtype=torch.long), mask], dim=1)},
        )
    if kind == "vlm":  # image tokens (16 by default: one per patch) after two left-padded positions, 6 text tokens
        mask = padding_mask(image_tokens + 8, "left")
        input_ids = ids(image_tokens + 8)
        token = next((getattr(config, a) for a in ("image_token_index", "image_token_id") if hasattr(config, a)), None)
        if token is not None:  # none: the positions come as a mask (Kosmos-2's image_embeds_position_mask)
            input_ids[:, 2 : 2 + image_tokens] = token
        batch = {"input_ids": input_ids, "attention_mask": mask}
        size = getattr(config.vision_config, "image_size", None)  # none: patches come flattened (Qwen2-VL)
        if size is not None:
            size = size if isinstance(size, int) else size[0]
            batch["pixel_values"] = torch.randn(2, 3, size, size, generator=g)
        return batch, {"decoder": mask}
    if kind == "codebooks":  # MusicGen's decoder: one row of ids per codebook, (batch * codebooks, length)
        mask = padding_mask(7, "left")
        return {"input_ids": ids(7).repeat_interleave(config.num_codebooks, dim=0), "attention_mask": mask}, {
            "encoder": mask
        }
    if kind == "detection":  # a 32x32 image for a two-stage ResNet (1/4 and 1/8 resolution), no padding
        return {
            "pixel_values": torch.randn(2, 3, 32, 32, generator=g),
            "pixel_mask": torch.ones(2, 32, 32, dtype=torch.long),
        }, {}
    if kind == "video":  # (batch, frames, channels, height, width)
        frames, size = config.num_frames, config.image_size
        return {"pixel_values": torch.randn(2, frames, config.num_channels, size, size, generator=g)}, {}
    if kind == "layout":  # text with a box per token (x0, y0, x1, y1 on a 0..1000 page)
        mask = padding_mask(7, "right")
        corner = torch.randint(0, 500, (2, 7, 2), generator=g)
        bbox = torch.cat([corner, corner + torch.randint(1, 500, (2, 7, 2), generator=g)], dim=-1)
        return {"input_ids": ids(7), "attention_mask": mask, "bbox": bbox}, {"encoder": mask}
    if kind == "spectrogram":
        return {"input_values": torch.randn(2, config.max_length, config.num_mel_bins, generator=g)}, {}
    if kind == "audio":
        return {"input_values": torch.randn(2, 400, generator=g)}, {}
    raise ValueError(kind)


def family_inputs(name: str, config) -> tuple[dict, dict]:
    """``make_inputs`` for family ``name`` (its kind and image tokens), with the family's own extra inputs."""
    _, _, kind, *extras = FAMILIES[name]
    extras = extras[0] if extras else {}
    batch, masks = make_inputs(kind, config, extras.get("image_tokens", 16))
    batch.update(extras.get("inputs", {}))
    return batch, masks


# ------------------------------------------------------------------------------ observing
def tensors_of(output) -> list[torch.Tensor]:
    """Every tensor in a model output, in a fixed order (nested tuples and ModelOutputs included)."""
    if isinstance(output, torch.Tensor):
        return [output]
    if hasattr(output, "to_tuple"):
        output = output.to_tuple()
    if isinstance(output, (tuple, list)):
        return [t for item in output for t in tensors_of(item)]
    if isinstance(output, dict):
        return [t for item in output.values() for t in tensors_of(item)]
    return []


def attention_functions(model) -> dict:
    """Where the model's attention functions live, as they are now: the registry's entries and the eager function
    of each modeling file the model's classes come from (a capture wraps them in place and puts them back)."""
    from transformers.modeling_utils import AttentionInterface

    found: dict = {("registry", k): f for k, f in AttentionInterface._global_mapping.items()}
    for module in model.modules():
        file = inspect.getmodule(type(module))
        for k, f in vars(file).items() if file is not None else ():
            if k.endswith("eager_attention_forward"):
                found[(file.__name__, k)] = f
    return found


def implementations(model) -> dict[int, object]:
    """id(config) -> _attn_implementation for every config the modules hold, with sub-configs."""
    found, todo = {}, [m.config for m in model.modules() if hasattr(m, "config")]
    while todo:
        config = todo.pop()
        if id(config) in found:
            continue
        found[id(config)] = getattr(config, "_attn_implementation", None)
        subs = (getattr(config, k, None) for k in (getattr(config, "sub_configs", None) or {}))
        todo += [sub for sub in subs if sub is not None]
    return found


class SoftmaxCount(torch.overrides.TorchFunctionMode):
    """Counts softmax calls over the last axis of 4-D tensors: one per attention call in an eager model."""

    def __init__(self):
        super().__init__()
        self.count = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") == "softmax" and args and isinstance(args[0], torch.Tensor):
            dim = kwargs.get("dim", args[1] if len(args) > 1 else None)
            if args[0].dim() == 4 and dim in (-1, 3):
                self.count += 1
        return func(*args, **kwargs)


def eager_reference(model, batch, kind: str) -> tuple[dict, int]:
    """(the eager twin's own output_attentions weights keyed by (stack, kind, tower), its attention calls)."""
    reference = twin(model, "eager")
    counter = SoftmaxCount()
    with torch.no_grad(), counter:
        out = reference(**batch, output_attentions=True)
    if kind == "vlm":  # LLaVA returns the language model's attentions only; BLIP-2 also the others, apart
        language = getattr(out, "language_model_outputs", out)
        groups = {(None, "self", "language_model"): language.attentions}
    elif kind == "text-image":
        groups = {
            (None, "self", "text_model"): out.text_model_output.attentions,
            (None, "self", "vision_model"): out.vision_model_output.attentions,
        }
    elif getattr(out, "encoder_attentions", None) is not None or getattr(out, "decoder_attentions", None) is not None:
        groups = {
            ("encoder", "self", None): out.encoder_attentions,
            ("decoder", "self", None): out.decoder_attentions,
            ("decoder", "cross", None): out.cross_attentions,
        }
    else:
        groups = {(None, "self", None): getattr(out, "attentions", None)}
    # nested per stage in some models (PVTv2: one tuple per stage)
    return {k: tensors_of(v) for k, v in groups.items() if v}, counter.count


def tower(record, kind: str):
    """Which tower of a two-tower model (CLIP, SigLIP) or a vision-language model (LLaVA) a record
    belongs to; None for the others."""
    if kind == "vlm":  # the vision tower's modules are named vision_tower, vision_model, visual, ... (and BLIP-2's
        # Q-Former counts with them); the language model's language_model or, in Idefics3, text_model
        return "language_model" if {"language_model", "text_model"} & set(record.name.split(".")) else "vision_tower"
    if kind == "image-prefix":  # GIT: its vision tower apart, its text stack compared with its output_attentions
        return "vision_tower" if "vision_model" in record.name.split(".") else None
    return record.name.split(".")[0] if kind == "text-image" else None


#: two-tower families whose text tower is causal (CLIP's text transformer and those built on it)
CAUSAL_TEXT = frozenset({"clip", "owlvit", "owlv2"})


def declarations(cap, name: str, masks: dict) -> tuple[dict, dict]:
    """``causal`` and ``attention_mask`` per layer, as a user of this family would declare them."""
    kind = FAMILIES[name][2]
    causal, mask = {}, {}
    for r in cap:
        if kind == "vlm":
            language = tower(r, kind) == "language_model"
            is_causal, side = language, "decoder" if language else None
        elif kind == "text-image":
            text = tower(r, kind) == "text_model"
            is_causal, side = text and name in CAUSAL_TEXT, "encoder" if text else None
        elif kind == "image-prefix":  # the image's tokens attend among themselves, the text's causally to both
            is_causal, side = False, None if tower(r, kind) else "encoder"
        else:
            stack = r.meta.get("stack") or ("decoder" if kind in ("causal", "codebooks") else "encoder")
            # DETR's decoder attends among its object queries: not causal
            is_causal, side = stack == "decoder" and kind != "detection", "encoder" if r.kind == "cross" else stack
        if r.kind == "self":
            causal[r.layer] = is_causal
        if side in masks:
            mask[r.layer] = masks[side]
    return causal, mask


#: ProphetNet's own output_attentions hold the logits before the softmax for these groups (its ngram
#: decoder self-attention returns probabilities); the reference is their softmax, as the model computes it
PRE_SOFTMAX_REFERENCE = {
    "prophetnet": {("encoder", "self", None), ("decoder", "cross", None)},
    "squeezebert": {(None, "self", None)},
}

#: These families' output_attentions hold the mean over heads in every head (WavLM, F.multi_head_attention_forward;
#: pytorch#32590): the capture reads the heads' own weights, whose mean is the reference
HEAD_AVERAGED_REFERENCE = {"wavlm"}


def averaged(weights: torch.Tensor) -> torch.Tensor:
    """(batch, head, query, key) weights as a head-averaging module returns them: their mean in every head."""
    return weights.mean(dim=1, keepdim=True).expand_as(weights)


def run_plain(model, batch, name):
    """Two plain forwards; pytest.skip when the family cannot run this tiny config at all."""
    try:
        with torch.no_grad():
            plain, again = tensors_of(model(**batch)), tensors_of(model(**batch))
    except Exception as e:
        pytest.skip(f"{name}: the tiny model does not run without a capture: {type(e).__name__}: {str(e)[:200]}")
    assert len(plain) == len(again) and all(torch.equal(a, b) for a, b in zip(plain, again)), (
        f"{name} is not deterministic without a capture: the comparison with a capture would mean nothing"
    )
    return plain


def sweep(name: str, attn_implementation: str | None = None) -> dict:
    """Capture one family with default settings (on its default backend, or ``attn_implementation``) and report
    what holds (the tests assert on it)."""
    model = build(name, attn_implementation)
    kind = FAMILIES[name][2]
    batch, masks = family_inputs(name, model.config)
    before, functions = implementations(model), attention_functions(model)
    plain = run_plain(model, batch, name)
    hooks = hook_counts(model)
    result = {"family": name}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", attnprobe.AttnprobeWarning)
        try:
            with torch.no_grad(), attnprobe.capture(model) as cap:
                result["same_inside"] = implementations(model) == before  # the name never changes
                captured = tensors_of(model(**batch))
        except attnprobe.UnsupportedModelError as e:
            result.update(
                outcome="refused",
                error=str(e),
                restored=implementations(model) == before,
                hooks_left=hook_counts(model) != hooks,
            )
            return result
    fallback = [
        str(w.message)
        for w in caught
        if issubclass(w.category, attnprobe.AttnprobeWarning) and "no attention interface" in str(w.message)
    ]
    left_out = [
        str(w.message)
        for w in caught
        if issubclass(w.category, attnprobe.AttnprobeWarning) and "it is not recorded" in str(w.message)
    ]
    hf = [r for r in cap if "base" in r.meta]  # records of the Hugging Face adapter (SigLIP's pooling head is torch's)
    result.update(
        outcome="fallback" if fallback else "full",
        outputs_equal=len(plain) == len(captured) and all(torch.equal(a, b) for a, b in zip(plain, captured)),
        restored=implementations(model) == before and attention_functions(model) == functions,
        hooks_left=hook_counts(model) != hooks,
        records=len(hf),
        left_out=left_out,
        other_records=len(cap) - len(hf),
        sources=sorted({r.weights_source for r in cap}),
    )
    reference, calls = eager_reference(model, batch, kind)
    result["eager_calls"] = calls
    result["reference"] = sum(len(v) for v in reference.values())
    groups: dict = {}
    for r in hf:
        groups.setdefault((r.meta.get("stack"), r.kind, tower(r, kind)), []).append(r)
    errors, uncompared = [], []
    for key, records in groups.items():
        weights = reference.get(key, [])
        if len(weights) != len(records):
            uncompared.append(key)  # the model's output_attentions leave out some calls (Canine)
            continue
        for record, w in zip(records, weights):
            if key in PRE_SOFTMAX_REFERENCE.get(name, ()):
                w = torch.softmax(w, dim=-1)
            if record.weights is None or record.weights.shape != w.shape:
                errors.append(float("inf"))
            elif name in HEAD_AVERAGED_REFERENCE:
                errors.append(max_error_on_real_rows(replace(record, weights=averaged(record.weights)), w))
            else:
                errors.append(max_error_on_real_rows(record, w))
    result["max_error"] = max(errors) if errors else None
    result["uncompared"] = uncompared
    causal, mask = declarations(cap, name, masks)
    checked = attnprobe.check(cap, causal=causal, attention_mask=mask or None)
    result["check_ok"] = checked.ok
    result["violations"] = [str(v) for v in checked.errors][:3]
    # what the model declares itself (config, inputs) is checked unasked: it must find nothing in a correct model,
    # with the sweep's declarations and without any
    unasked = ("declared", "reach", "scale")
    bare = attnprobe.check(cap, checks=unasked)
    result["unasked_findings"] = [str(v) for v in (*checked.violations, *bare.violations) if v.check in unasked][:3]
    return result


# ------------------------------------------------------------------------------ the tests
@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """Tiny models gain nothing from intra-op threads; on a busy machine their hand-offs cost ~8x."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@functools.cache
def _dispatches(cls: type) -> bool:
    """Whether the class's own code goes through the attention interface (or only ever calls sdpa itself, which
    the functional adapter reads: AIMv2's pooling head), read from its source text."""
    try:
        source = inspect.getsource(cls)
    except (OSError, TypeError):
        return False
    return "ALL_ATTENTION_FUNCTIONS" in source or (
        "scaled_dot_product_attention" in source and "softmax" not in source.lower()
    )


def old_style_attention(model) -> list[str]:
    """The innermost attention classes of ``model`` whose code bypasses the attention interface.

    Which families those are depends on the installed transformers (gptj, codegen and layoutlmv3 moved onto
    the interface in 5.24), so the sweep reads it from the installed source instead of a list; deliberately
    not through attnprobe's own detection (hooks/hf/adapter.py reads code names, not source text)."""
    found = set()
    for module in model.modules():
        cls = type(module)
        if not cls.__module__.startswith("transformers.models.") or "Attention" not in cls.__name__:
            continue
        inner = (c for c in module.modules() if c is not module)
        if any("Attention" in type(c).__name__ or isinstance(c, torch.nn.MultiheadAttention) for c in inner):
            continue  # a wrapper: the innermost attention module computes
        if not _dispatches(cls):
            found.add(cls.__name__)
    return sorted(found)


def test_the_old_style_oracle_knows_families_of_every_release():
    """The oracle above must not be trivially empty or full: families old-style in every declared release, and
    families on the interface in every one."""
    for name in ("gpt-neo", "bloom", "xlnet", "deberta-v2"):
        assert old_style_attention(build(name)), name
    for name in ("bert", "llama", "t5", "gpt2"):
        assert not old_style_attention(build(name)), name


#: Old-style families whose returned weights pass a dropout attnprobe cannot read (no dropout module): in training
#: they are recorded as after dropout (``meta["weights_after_dropout"]``), and statistics captures leave them out.
AFTER_DROPOUT = {"wavlm": "F.multi_head_attention_forward returns its weights after its dropout"}


def attention_dropouts_only(model, classes: set[str], p: float = 0.1) -> None:
    """Every dropout probability inside the attention modules of ``classes`` set to ``p`` (dropout modules, and the
    numbers their code passes to nn.functional.dropout), every other dropout, layer drop and SpecAugment mask off."""
    inside = {id(d) for m in model.modules() if type(m).__name__ in classes for d in m.modules()}
    for m in model.modules():
        value = p if id(m) in inside else 0.0
        if isinstance(m, torch.nn.Dropout):
            m.p = value
        elif type(m).__name__.endswith("Dropout") and hasattr(m, "drop_prob"):  # SEW-D's StableDropout
            m.drop_prob = value
        for attribute, number in list(vars(m).items()):
            if "dropout" in attribute.lower() and type(number) in (int, float):  # nn.functional.dropout's (XLM's)
                setattr(m, attribute, value)
            elif attribute == "layerdrop" and type(number) is float:  # SpeechT5's stacks skip layers in training
                setattr(m, attribute, 0.0)
    for attribute in ("layerdrop", "encoder_layerdrop", "decoder_layerdrop", "mask_time_prob", "mask_feature_prob"):
        if hasattr(model.config, attribute):
            setattr(model.config, attribute, 0.0)


def _softmax_rows(weights: torch.Tensor) -> bool:
    """Every row sums to one, or to zero (no key), or is NaN: no row of weights after a dropout of 0.1."""
    sums = weights.sum(-1)  # (batch, head, query)
    return bool(((sums - 1).abs() <= 1e-4).logical_or(sums == 0).logical_or(sums.isnan()).all())


def test_old_style_families_in_training_record_the_softmax_before_dropout(recwarn):
    """Every old-style family in training, with every attention dropout at 0.1: the records hold the weights before
    dropout (rows that sum to one), read at the input of the module's dropout; a statistics capture records them too.
    Before, 16 families' records held the dropped-out weights, and a statistics capture (the training monitor)
    recorded nothing of them; XLM's, Flaubert's and WavLM's dropped-out weights were recorded as softmax weights with
    no dropout. The families of ``AFTER_DROPOUT`` are recorded as after dropout, and statistics leave them out."""
    failures, checked = [], 0
    for name in ON_DEFAULT:
        model = build(name)
        classes = set(old_style_attention(model))
        if name in REFUSED or not classes:
            continue
        checked += 1
        attention_dropouts_only(model, classes)
        batch, _ = family_inputs(name, model.config)
        model.train()
        with torch.no_grad(), attnprobe.capture(model) as full:
            model(**batch)
        with torch.no_grad(), attnprobe.capture(model, keep=("stats",)) as stats:
            model(**batch)
        after = [r for r in full if r.meta.get("weights_after_dropout")]
        if bool(after) != (name in AFTER_DROPOUT) or not full:
            failures.append(f"{name}: {len(after)} of {len(full)} records after dropout")
        if not all(_softmax_rows(r.weights) for r in full if r not in after):
            failures.append(f"{name}: rows that do not sum to one, not marked after dropout")
        if len(stats) != len(full) - len(after):
            failures.append(f"{name}: {len(stats)} statistics records for {len(full) - len(after)} softmax ones")
    assert checked >= 40 and not failures, (checked, failures)


#: Old-style families of every layout the fallback reads: causal, time-first (XLNet), logits as attentions
#: (SqueezeBERT's dict, ProphetNet), a float32 softmax (Bloom), encoder-decoders, a nested tuple (I-BERT), vision,
#: audio, BLIP's text
OLD_STYLE_COMPILED = (
    "gpt-neo",
    "bloom",
    "xlnet",
    "squeezebert",
    "prophetnet",
    "fsmt",
    "deberta-v2",
    "ibert",
    "swinv2",
    "wavlm",
    "blip",
)


@pytest.mark.parametrize("name", OLD_STYLE_COMPILED)
def test_old_style_family_compiled_with_fullgraph_records_as_in_eager_mode(name, recwarn):
    """``torch.compile(model, fullgraph=True)`` (Dynamo's eager backend): the fallback's hooks only hand the weights
    over, so the capture runs in the graph and its records are bitwise the eager capture's, the outputs bitwise the
    compiled model's (all 44 old-style families did so when this was written; these cover every layout). Before,
    Dynamo raised on the fallback's checks of the weights inside the forward."""
    model = build(name)
    assert old_style_attention(model), f"{name} moved onto the attention interface: pick another old-style family"
    batch, _ = family_inputs(name, model.config)
    with torch.no_grad(), attnprobe.capture(model) as eager:
        model(**batch)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    plain = run_plain(compiled, batch, name)  # skips where torch cannot compile it at all (torch 2.6)
    with torch.no_grad(), attnprobe.capture(compiled) as cap:
        out = tensors_of(compiled(**batch))
    torch._dynamo.reset()
    assert len(out) == len(plain) and all(torch.equal(a, b) for a, b in zip(out, plain))
    assert len(cap) == len(eager) > 0
    for got, want in zip(cap, eager):
        assert (got.layer, got.kind, got.query_offset) == (want.layer, want.kind, want.query_offset)
        if name in HEAD_AVERAGED_REFERENCE:  # compiled, only the mean the module returns can be read
            assert got.meta["heads_averaged"] and "heads_averaged" not in want.meta
            want = replace(want, weights=averaged(want.weights))
        assert torch.equal(got.weights, want.weights) and got.weights_source == "output_attentions"


#: Families refused before the forward, and what the error tells the user to do.
REFUSED = {
    "falcon": "attn_implementation='eager'",  # computes another way when asked for weights
    "data2vec-vision": "attn_implementation='eager'",  # its sdpa class returns no weights
    "longformer": "layers=[...]",  # local-window weights
    "led": "layers=[...]",
    "longt5": "layers=[...]",  # local-block encoder attention next to an interface decoder
    "canine": "layers=[...]",  # its character encoders attend chunk by chunk
    # no weights to read: MRA and YOSO approximate attention (their output_attentions repeat the context or
    # return nothing), MobileViT's hand-written softmax takes no output_attentions (trace it with modules=[...])
    "mra": "returned no attention weights",
    "yoso": "returned no attention weights",
    "mobilevit": "modules=[...]",
    "timesformer": "modules=[...]",  # its temporal attention is called without output_attentions
    # weights per mask unit, (batch, head, window, query, key)
    "hiera": "not one (batch, head, query, key) matrix per call",
}
#: Families whose output_attentions leave out some attention calls (nothing to compare those with).
_LANGUAGE_ONLY = "its outputs hold the language model's attentions, not the vision tower's"
PARTIAL_REFERENCE = {
    **dict.fromkeys(
        (
            "llava",
            "vipllava",
            "paligemma",
            "gemma3",
            "aya-vision",
            "mistral3",
            "internvl",
            "qwen2-vl",
            "qwen2-5-vl",
            "llava-next",
            "idefics3",
            "smolvlm",
            "kosmos-2",
        ),
        _LANGUAGE_ONLY,
    ),
    **dict.fromkeys(("blip-2", "instructblip"), "the vision tower's and the Q-Former's attentions are not compared"),
    "mllama": "its language attentions hold one entry per layer, self- or cross-attention alike (not compared)",
    "git": "its outputs hold the text stack's attentions, not the vision tower's",
    "diffllama": "two attention calls per layer (same q and k, two halves of v); its outputs hold the first",
}
#: Families whose cross-attention the installed transformers runs causally under sdpa: check() must say so.
CAUSAL_CROSS = {
    "mllama": "transformers #48172: MllamaTextCrossAttention sets no is_causal, which sdpa takes as True without a "
    "cross_attention_mask (test_checks_hf_declared.py)",
}
#: Families with a module that looks like attention but computes no softmax weights: left out with a warning,
#: the model's other attention calls recorded.
LEFT_OUT = {"minimax": "its lightning (linear) attention returns its key-value state as output_attentions"}
#: Old-style families computing more softmax attention than their output_attentions return: the fallback, which
#: reads output_attentions, records what they return and misses the rest (name the modules in modules=[...] to
#: trace them instead).
UNEXPOSED = {
    "lilt": "its layout stream's attention, a second softmax per layer (same summed scores, its own layout "
    "values), is not in its output_attentions"
}


@pytest.mark.parametrize("name", FAMILIES)
def test_family(name):
    _holds(name, sweep(name))


def _holds(name: str, result: dict, attn_implementation: str | None = None, refused: dict = REFUSED) -> None:
    """What ``sweep`` must report for family ``name`` on its default backend or ``attn_implementation``
    (``refused``: the families refused on that backend)."""
    old_style = old_style_attention(build(name, attn_implementation))
    expected = "refused" if name in refused else "fallback" if old_style else "full"
    assert result["outcome"] == expected, (f"transformers {transformers.__version__}", result)
    assert result["restored"], "an attention implementation or function was not restored"
    assert result.get("same_inside", True), "an attention implementation's name changed inside the capture"
    assert not result["hooks_left"], "a hook was left behind"
    if expected == "refused":
        assert refused[name] in result["error"], result["error"]
        return
    assert result["outputs_equal"], "outputs changed under capture"
    if name in LEFT_OUT:  # its output_attentions count the module left out; the softmax calls do not
        assert result["left_out"] and result["records"] == result["eager_calls"] > 0, (LEFT_OUT[name], result)
    elif name in UNEXPOSED:
        assert 0 < result["records"] == result["reference"] < result["eager_calls"], (UNEXPOSED[name], result)
    else:  # every attention call recorded: the eager twin's output_attentions and its softmax calls both count them
        assert not result["left_out"] and result["records"] == max(result["eager_calls"], result["reference"]) > 0, (
            result
        )
    if name in PARTIAL_REFERENCE or name in LEFT_OUT:
        assert result["uncompared"], PARTIAL_REFERENCE.get(name) or LEFT_OUT[name]
    else:
        assert not result["uncompared"] and result["max_error"] is not None, result
    assert result["max_error"] is None or result["max_error"] <= 1e-5, result
    if name in CAUSAL_CROSS and attn_implementation is None:  # sdpa: eager and flex apply no is_causal
        assert not result["check_ok"] and "the kernel ran causally" in result["violations"][0], CAUSAL_CROSS[name]
    else:
        assert result["check_ok"], result["violations"]
    assert not result["unasked_findings"], result["unasked_findings"]


#: The families the sweep builds on their default backend (the others it builds on eager already).
ON_DEFAULT = [name for name, entry in FAMILIES.items() if "attn" not in (entry[3] if len(entry) > 3 else {})]


@pytest.mark.parametrize("name", ON_DEFAULT)
def test_family_on_eager(name):
    """Every family on the eager implementation, whose weights the capture takes as the kernel returns them: what
    the sweep asks on sdpa holds, and the two families refused under sdpa (their sdpa classes return no weights)
    fall back to their output_attentions."""
    on_eager = {n: why for n, why in REFUSED.items() if why != "attn_implementation='eager'"}
    _holds(name, sweep(name, "eager"), "eager", on_eager)


@pytest.mark.parametrize("name", [n for n in ON_DEFAULT if n not in REFUSED])
def test_family_statistics(name):
    """Every family captured with ``keep=("stats",)`` as well: a statistics record for each call the full capture
    records, its largest weight and entropy those of the full capture's weights (real rows), and check() giving the
    same verdicts from the statistics as from the weights. Old-style families (the fallback reads output_attentions)
    have their statistics computed from those weights."""
    model = build(name)
    batch, masks = family_inputs(name, model.config)
    caps = []
    for keep in (None, ("stats",)):
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", attnprobe.AttnprobeWarning)  # what the sweep asserts on sdpa
            with attnprobe.capture(model, **({} if keep is None else {"keep": keep})) as cap:
                model(**batch)
        caps.append(cap)
    full, stats = caps
    by_call = {(r.name, r.call, r.layer, r.kind): r for r in stats}
    assert len(stats) == len(full) > 0
    for r in full:
        st = by_call[(r.name, r.call, r.layer, r.kind)].stats
        assert st is not None, r.name
        w = r.weights.double()  # (batch, head, query, key)
        real = real_rows(r)[..., 0].expand(w.shape[:3])  # (batch, head, query)
        entropy = -(w * torch.log(w.clamp_min(1e-300))).sum(-1)
        for got, want in ((st["max_weight"], w.amax(-1)), (st["entropy"], entropy)):
            assert float((got.double() - want).abs()[real].max()) <= 1e-4, (r.name, r.call)
    causal, mask = declarations(full, name, masks)

    def verdicts(cap) -> set:
        result = attnprobe.check(cap, causal=causal, attention_mask=mask or None)
        return {(v.check, v.severity, v.layer) for v in result.violations}

    assert verdicts(stats) == verdicts(full)


def _causal_lm(name: str):
    """The family's model with a language-modelling head (``AutoModelForCausalLM``), or None without one."""
    config_name, kwargs, _, *extras = FAMILIES[name]
    config_class = getattr(transformers, config_name, None)
    if config_class is None or config_class not in transformers.AutoModelForCausalLM._model_mapping:
        return None
    extras = extras[0] if extras else {}
    attn = {"attn_implementation": extras["attn"]} if "attn" in extras else {}
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config_class(**copy.deepcopy(kwargs)), **attn).eval()


def generated_three_ways(model, batch: dict, tokens: int):
    """``(full capture, statistics capture)`` of greedy generations of ``tokens`` tokens, each asserted equal to an
    uncaptured generation's."""
    options = dict(max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False, pad_token_id=0)
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore", attnprobe.AttnprobeWarning)  # what the sweep asserts on the forward
        plain = model.generate(**batch, **options)
        with attnprobe.capture(model) as cap:
            captured = model.generate(**batch, **options)
        with attnprobe.capture(model, keep=("stats",)) as stats:
            from_stats = model.generate(**batch, **options)
    assert torch.equal(plain, captured) and torch.equal(plain, from_stats)
    return cap, stats


#: Families whose generation in the installed transformers computes attention check() must report.
GENERATION_BROKEN = {
    "minimax": "transformers 5.24's MiniMax builds each decode step's mask over one key: the left-padded row attends "
    "none (test_checks_hf_generation.py)",
}


@pytest.mark.parametrize("name", [n for n in ON_DEFAULT if FAMILIES[n][2] == "causal" and n not in REFUSED])
def test_family_generation(name):
    """Every decoder family with a language-modelling head generating 4 tokens after left-padded prompts under
    capture: the tokens of an uncaptured ``generate``, a record per step (the prompt's step 0, or None where the
    model keeps no cache), and check() clean with causality declared (decode steps, sliding and chunked caches,
    sparse and dynamic masks), with the same verdicts from a statistics capture's generation."""
    model = _causal_lm(name)
    if model is None:
        pytest.skip(f"{name} has no AutoModelForCausalLM class")
    batch, _ = make_inputs("causal", model.config)
    cap, stats = generated_three_ways(model, batch, tokens=4)
    steps = {r.step for r in cap}
    # None: a model that keeps no cache (each step a whole forward); MiniMax makes its cache inside the prompt's
    # forward (step None there), so its decode steps count from 0
    assert steps in ([{None, 0, 1, 2}] if name == "minimax" else [{0, 1, 2, 3}, {None}]), steps
    result = attnprobe.check(cap, causal=True)

    def verdicts(result) -> set:
        return {(v.check, v.severity, v.layer, v.step, v.batch) for v in result.violations}

    assert verdicts(attnprobe.check(stats, causal=True)) == verdicts(result)  # a statistics capture's are the same
    if name in GENERATION_BROKEN:
        assert not result.ok and {v.check for v in result.errors} == {"empty_rows"}, GENERATION_BROKEN[name]
    else:
        assert result.ok, result.table()


#: The auto class that generates text for each kind of family with an encoder (or an image tower) before its decoder.
GENERATORS = {
    "seq2seq": "AutoModelForSeq2SeqLM",
    "vlm": "AutoModelForImageTextToText",
    "whisper": "AutoModelForSpeechSeq2Seq",
    "speech2text": "AutoModelForSpeechSeq2Seq",
    "audio2text": None,  # the family's own model class (SpeechT5ForSpeechToText)
    "image2text": None,  # VisionEncoderDecoderModel
}

#: Families whose generation computes attention check() reports with nothing declared (a bug in transformers).
#: ``{name: (the kind of the calls reported, why)}``.
GENERATION_CHECKED_BROKEN = {
    "mllama": (
        "cross",
        "transformers #48172: MllamaTextCrossAttention sets no is_causal, so sdpa runs it causally without a "
        "cross_attention_mask (test_checks_hf_declared.py)",
    ),
    "fsmt": (
        "self",
        "FSMT builds its causal mask only when given input_ids without use_cache: generate(use_cache=False), the "
        "sweep's setting, reruns the whole decoder each step with none, so it attends later tokens (its logits "
        "move by 1e-5 against a cached generation here; test_checks_hf_declared.py)",
    ),
}


def _generator(name: str):
    """The family's text-generating model (encoder-decoder, speech-to-text or image-text-to-text), or None."""
    config_name, kwargs, kind, *extras = FAMILIES[name]
    extras = extras[0] if extras else {}
    config_class = getattr(transformers, config_name, None)
    auto = getattr(transformers, GENERATORS[kind] or "", None)
    if config_class is None or (auto is not None and config_class not in auto._model_mapping):
        return None
    cls = auto if auto is not None else getattr(transformers, extras.get("model", ""), None)
    if cls is None:
        return None
    attn = {"attn_implementation": extras["attn"]} if "attn" in extras else {}
    torch.manual_seed(0)
    config = config_class(**copy.deepcopy(kwargs))
    return (cls.from_config if cls is auto else cls._from_config)(config, **attn).eval()


@pytest.mark.parametrize("name", [n for n in ON_DEFAULT if FAMILIES[n][2] in GENERATORS and n not in REFUSED])
def test_family_generation_after_an_encoder(name):
    """Every encoder-decoder, speech-to-text and image-text-to-text family generating 3 tokens under capture: the
    tokens of an uncaptured ``generate``, a record per step, ``check(cap)`` clean with nothing declared (what the
    modules, configs and masks say), and the same verdicts from a statistics capture's generation (old-style
    families' statistics come from the weights they return)."""
    try:
        model = _generator(name)
    except Exception as e:  # a family this transformers cannot build from the tiny config
        pytest.skip(f"{name}: cannot build its generating model: {type(e).__name__}: {str(e)[:150]}")
    if model is None:
        pytest.skip(f"{name} has no text-generating model class")
    batch, _ = family_inputs(name, model.config)
    for prompt_only in ("decoder_input_ids", "decoder_attention_mask"):
        batch.pop(prompt_only, None)  # generation starts the decoder itself
    cap, stats = generated_three_ways(model, batch, tokens=3)
    steps = {r.step for r in cap if r.kind == "self" and r.meta.get("stack") != "encoder"}
    assert steps >= {1, 2} or steps == {None}, steps  # None: a model that keeps no cache (FSMT)
    result = attnprobe.check(cap)

    def verdicts(result) -> set:
        return {(v.check, v.severity, v.layer, v.step, v.batch) for v in result.violations if v.severity != "skip"}

    assert len(stats) == len(cap) and verdicts(attnprobe.check(stats)) == verdicts(result)
    if name in GENERATION_CHECKED_BROKEN:
        kind, why = GENERATION_CHECKED_BROKEN[name]
        reported = {r.name for r in cap if r.kind == kind and r.meta.get("stack") != "encoder"}
        assert {(v.check, v.name in reported) for v in result.errors} == {("causal", True)}, why
    else:
        assert result.ok, result.table()


def _flex_family(name: str) -> bool:
    """Whether the family's model class says it runs on flex attention (read from the class: nothing is built)."""
    config_name, _, _, *extras = FAMILIES[name]
    extras = extras[0] if extras else {}
    config = getattr(transformers, config_name, None)
    if "attn" in extras or config is None:
        return False
    model = getattr(transformers, extras["model"], None) if "model" in extras else None
    if model is None and config in transformers.AutoModel._model_mapping:
        model = transformers.AutoModel._model_mapping[config]
    return bool(getattr(model, "_supports_flex_attn", False))


#: Families whose flex path in the installed transformers computes other attention than eager: check() must say so.
FLEX_BROKEN = {
    "doge": "transformers 5.24's Doge folds the causal mask into its dynamic mask only when the mask is a tensor; "
    "flex's BlockMask is dropped, so queries attend later keys (test_checks_hf_declared.py)",
}


@flex_helpers.FLEX_SKIP
@pytest.mark.parametrize("name", [n for n in FAMILIES if _flex_family(n)])
def test_family_on_flex(name):
    """Every family whose model runs on flex attention, captured on flex (torch's reference path of the kernel:
    no compilation): what the sweep asks on sdpa holds on flex, records read from the BlockMask and score_mod."""
    with flex_helpers.uncompiled():
        result = sweep(name, "flex_attention")
    if name in FLEX_BROKEN:
        assert result["outputs_equal"] and not result["check_ok"], (FLEX_BROKEN[name], result)
        assert "causal mask is missing" in result["violations"][0], result["violations"]
        return
    _holds(name, result, "flex_attention")


def test_head_counts_ignore_kv_heads_that_do_not_group_the_query_heads():
    """A kv-head attribute larger than the query heads (JetMoE built with num_attention_heads given) is not
    grouped-query attention: the hint falls back to the query heads instead of dividing by zero."""
    from attnprobe.hooks.hf.context import head_counts

    module = torch.nn.Module()
    module.num_heads, module.num_key_value_heads = 4, 16
    assert head_counts(module) == (4, 4)
    module.num_key_value_heads = 2
    assert head_counts(module) == (4, 2)


def test_jetmoe_with_more_kv_heads_than_query_heads_is_captured():
    config = transformers.JetMoeConfig(**dict(TEXT, num_local_experts=2, num_experts_per_tok=1, kv_channels=8))
    torch.manual_seed(0)
    model = transformers.AutoModel.from_config(config).eval()
    batch, _ = make_inputs("causal", config)
    with torch.no_grad():
        plain = model(**batch).last_hidden_state
        with attnprobe.capture(model) as cap:
            captured = model(**batch).last_hidden_state
    assert torch.equal(plain, captured) and len(cap) == 2
    assert attnprobe.check(cap, causal=True, attention_mask=batch["attention_mask"]).ok


def test_canine_deep_layers_are_captured_when_its_chunked_layers_are_excluded():
    """Canine's local character encoders are refused by name; its deep encoder, chosen with layers=[...],
    is read and its records equal the model's own output_attentions."""
    model = build("canine")
    batch, _ = make_inputs("encoder", model.config)
    with pytest.raises(attnprobe.UnsupportedModelError, match=r"CanineSelfAttention.*per local window"):
        with torch.no_grad(), attnprobe.capture(model):
            model(**batch)
    names = [m.name for m in attnprobe.attention_modules(model)]
    deep = [i for i, n in enumerate(names) if n.startswith("encoder.")]
    assert 0 < len(deep) < len(names)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", attnprobe.AttnprobeWarning)
        with torch.no_grad(), attnprobe.capture(model, layers=deep) as cap:
            model(**batch)
        reference = model(**batch, output_attentions=True).attentions
    assert [r.name for r in cap] == [names[i] for i in deep]
    # Canine's own attentions: its initial encoder's last chunk, the deep layers, its final encoder
    assert len(reference) == len(deep) + 2
    assert all(torch.equal(r.weights, w) for r, w in zip(cap, reference[1:-1], strict=True))


def test_inner_encoder_stacks_take_query_padding_from_the_model_mask():
    """CLIP's text encoder receives the 4-D mask its model built; the padded query rows still come from
    the model's 2-D attention_mask."""
    model = build("clip-text")
    batch, _ = make_inputs("causal", model.config)
    with torch.no_grad(), attnprobe.capture(model) as cap:
        model(**batch)
    assert len(cap) == 2
    for r in cap:
        assert r.query_padding is not None and torch.equal(r.query_padding, batch["attention_mask"] == 0)


def test_query_padding_reaches_a_language_model_handed_one_mask_per_layer_type():
    """Gemma3's multimodal model hands its language model a dict of built masks (full and sliding): the
    padded query rows still come from the model's 2-D attention_mask."""
    model = build("gemma3")
    batch, _ = make_inputs("vlm", model.config, FAMILIES["gemma3"][3]["image_tokens"])
    with torch.no_grad(), attnprobe.capture(model) as cap:
        model(**batch)
    language = [r for r in cap if tower(r, "vlm") == "language_model"]
    assert len(language) == 2
    for r in language:
        assert r.query_padding is not None and torch.equal(r.query_padding, batch["attention_mask"] == 0)


def test_hiera_mask_unit_attention_traced_by_name_matches_its_own_weights():
    # refused by the fallback (weights per mask unit); the refusal says to name the modules, and that works
    model = build("hiera")
    batch, _ = make_inputs(FAMILIES["hiera"][2], model.config)
    with torch.no_grad():
        plain = model(**batch)
        reference = model(**batch, output_attentions=True).attentions  # (batch, head, unit, query, key)
    names = [n for n, m in model.named_modules() if type(m).__name__ == "HieraMaskUnitAttention"]
    with torch.no_grad(), attnprobe.capture(model, modules=names) as cap:
        out = model(**batch)
    assert torch.equal(out.last_hidden_state, plain.last_hidden_state)
    assert len(cap) == len(reference) == len(names) > 1
    for record, w in zip(cap, reference):
        b, heads, units, q, k = w.shape
        assert record.num_heads == heads and "folded" in record.meta
        torch.testing.assert_close(record.weights, w.transpose(1, 2).reshape(b * units, heads, q, k))
    assert attnprobe.check(cap)


#: Families whose kernel computes other attention than eager in the installed transformers: compare() must find it.
COMPARE_BROKEN = {
    ("mllama", "sdpa"): "language_model.layers.1.cross_attn",  # #48172: its cross-attention run causally
    ("doge", "flex_attention"): "layers.0.self_attn",  # the BlockMask dropped from its dynamic mask (FLEX_BROKEN)
}


def _compared(name: str, backend: str) -> list:
    """``[compare(eager twin, the model on backend)]`` with full captures and with statistics."""
    reference, candidate = build(name, "eager"), build(name, backend)
    candidate.load_state_dict(reference.state_dict())
    batch, _ = family_inputs(name, reference.config)
    # flex's reference path (torch 2.6 has no switch for it: the flex cases skip there), as the flex sweep runs it
    with flex_helpers.uncompiled() if backend == "flex_attention" else contextlib.nullcontext():
        run_plain(candidate, batch, name)
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", attnprobe.AttnprobeWarning)  # the old-style fallback's, asserted above
            return [attnprobe.compare(reference, candidate, batch, **opts) for opts in ({}, {"keep": ("stats",)})]


@pytest.mark.parametrize(
    "name, backend",
    [(n, "sdpa") for n in ON_DEFAULT if n not in REFUSED]
    + [pytest.param(n, "flex_attention", marks=flex_helpers.FLEX_SKIP) for n in FAMILIES if _flex_family(n)],
)
def test_family_compares_equal_to_its_eager_twin(name, backend):
    """Every family on sdpa, and every family that runs on flex on flex, compared head by head with its eager twin
    (the same weights) on left- or right-padded inputs: no divergence, full captures or statistics, but where the
    kernel computes other attention (``COMPARE_BROKEN``: the divergence is named there). Padded keys, which each
    kernel makes of its own, never count as a divergence."""
    if backend == "sdpa" and "sdpa" not in str(getattr(build(name).config, "_attn_implementation", "")):
        pytest.skip(f"{name} does not run on sdpa by default")
    comparisons = _compared(name, backend)
    broken = COMPARE_BROKEN.get((name, backend))
    for found in comparisons:
        if broken is None:
            assert found.ok, (found.first, found.diagnosis)
        else:
            assert not found.ok and found.first.name == broken, found.first
