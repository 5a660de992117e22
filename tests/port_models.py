"""Hand-written ports of Hugging Face models, for ``attnprobe.compare``'s tests: each loads the HF model's weights.

- ``GPT``: karpathy/nanoGPT's ``model.py`` (fused ``c_attn``, ``F.scaled_dot_product_attention`` with
  ``is_causal=True``, or the manual ``masked_fill`` branch with ``flash=False``), given HF GPT-2's weights the way
  nanoGPT's ``from_pretrained`` does (HF's ``Conv1D`` stores its weight transposed against ``nn.Linear``).
- ``Llama``: a Llama (RMSNorm, RoPE over half-rotated pairs, grouped-query attention written by hand with a softmax),
  given HF Llama's weights; ``gemma=True`` makes it Gemma 2 (sandwich norms, ``1 + weight`` norms, scaled embeddings,
  GeGLU, ``query_pre_attn_scalar``, logit softcapping). ``bugs={layer: Bug(...)}`` plants a port bug in one layer.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

# --------------------------------------------------------------------------- nanoGPT (karpathy/nanoGPT model.py)


@dataclass
class GPTConfig:
    block_size: int = 32
    vocab_size: int = 100
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 16
    bias: bool = True


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig, flash: bool = True):
        super().__init__()
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v for all heads
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.n_head, self.n_embd, self.flash = config.n_head, config.n_embd, flash
        bias = torch.tril(torch.ones(config.block_size, config.block_size))
        self.register_buffer("bias", bias.view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()  # batch, sequence length, embedding dimensionality (n_embd)
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if self.flash:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (B, nh, T, hs)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            y = att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # re-assemble all head outputs side by side
        return self.c_proj(y)


class MLP(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU(approximate="tanh")  # GPT-2's gelu_new
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        return self.c_proj(self.gelu(self.c_fc(x)))


class Block(nn.Module):
    def __init__(self, config: GPTConfig, flash: bool = True):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd)
        self.attn = CausalSelfAttention(config, flash)
        self.ln_2 = nn.LayerNorm(config.n_embd)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config: GPTConfig, flash: bool = True):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(
            dict(
                wte=nn.Embedding(config.vocab_size, config.n_embd),
                wpe=nn.Embedding(config.block_size, config.n_embd),
                h=nn.ModuleList([Block(config, flash) for _ in range(config.n_layer)]),
                ln_f=nn.LayerNorm(config.n_embd),
            )
        )
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying

    def forward(self, idx):
        _, t = idx.size()
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)  # (t,)
        x = self.transformer.wte(idx) + self.transformer.wpe(pos)  # (b, t, n_embd)
        for block in self.transformer.h:
            x = block(x)
        return self.lm_head(self.transformer.ln_f(x))

    @classmethod
    def from_hf(cls, hf, flash: bool = True) -> GPT:
        """nanoGPT's ``from_pretrained``, from a loaded ``GPT2LMHeadModel``."""
        c = hf.config
        model = cls(GPTConfig(c.n_positions, c.vocab_size, c.n_layer, c.n_head, c.n_embd), flash)
        sd, sd_hf = model.state_dict(), hf.state_dict()
        transposed = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
        keys = [k for k in sd if not k.endswith(".attn.bias")]  # the mask buffer is not a parameter
        with torch.no_grad():
            for k in keys:
                src = sd_hf[k]
                sd[k].copy_(src.t() if k.endswith(transposed) else src)  # Conv1D stores (in, out)
        return model.eval()


# --------------------------------------------------------------------------- Llama / Gemma 2, written by hand


@dataclass(frozen=True)
class Bug:
    """A port bug planted in one layer's attention."""

    scale: float | None = None  # multiply the scores by this instead of the right scaling
    rope: str = "half"  # "interleaved": rotate pairs (2i, 2i+1) instead of (i, i + d/2)
    rope_base: float | None = None  # another RoPE base
    kv_repeat: str = "interleave"  # "tile": key/value heads repeated as k.repeat (head h reads h % kv)
    softcap: bool = True  # False: the logit softcap is left out (Gemma 2)
    causal_offset: int = 0  # 1: every query also sees the next key (torch.tril(..., diagonal=1))
    position_offset: int = 0  # RoPE at positions 0 + offset, 1 + offset, ...
    softmax_dtype: torch.dtype | None = None  # the softmax computed in this dtype


def rms_norm(x, weight, eps, gemma):
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    if gemma:
        return (h * (1.0 + weight.float())).type_as(x)
    return weight * h.to(x.dtype)


def rope_angles(d_head: int, positions, base: float):
    inv_freq = 1.0 / (base ** (torch.arange(0, d_head, 2, dtype=torch.float) / d_head))  # (d/2,)
    return positions[:, None].float() * inv_freq  # (T, d/2)


def rotate(x, angles, layout: str):
    """x (B, h, T, d) rotated pair-wise by ``angles`` (T, d/2)."""
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    if layout == "half":  # pairs (i, i + d/2), as HF's rotate_half
        cos, sin = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)  # (T, d)
        x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
        return x * cos + torch.cat((-x2, x1), -1) * sin
    xr = x.unflatten(-1, (-1, 2))  # (B, h, T, d/2, 2): pairs (2i, 2i + 1)
    a, b = xr[..., 0], xr[..., 1]
    return torch.stack((a * cos - b * sin, a * sin + b * cos), -1).flatten(-2)


class PortAttention(nn.Module):
    def __init__(self, cfg, layer: int, bug: Bug, gemma: bool):
        super().__init__()
        self.h, self.kv, self.d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, self.kv * self.d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, self.kv * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, cfg.hidden_size, bias=False)
        base = cfg.rope_parameters["rope_theta"]
        self.base = bug.rope_base or base
        self.bug = bug
        self.scaling = (cfg.query_pre_attn_scalar if gemma else self.d) ** -0.5
        self.softcap = cfg.attn_logit_softcapping if gemma and bug.softcap else None

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.h, self.d).transpose(1, 2)  # (B, h, T, d)
        k = self.k_proj(x).view(B, T, self.kv, self.d).transpose(1, 2)  # (B, kv, T, d)
        v = self.v_proj(x).view(B, T, self.kv, self.d).transpose(1, 2)  # (B, kv, T, d)
        angles = rope_angles(self.d, torch.arange(T) + self.bug.position_offset, self.base)  # (T, d/2)
        q, k = rotate(q, angles, self.bug.rope), rotate(k, angles, self.bug.rope)
        g = self.h // self.kv
        if self.bug.kv_repeat == "tile":
            k, v = k.repeat(1, g, 1, 1), v.repeat(1, g, 1, 1)  # (B, h, T, d): head j reads kv head j % kv
        else:
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)  # head j reads kv head j // g
        att = q @ k.transpose(-2, -1)  # (B, h, T, T)
        att = att * (self.bug.scale if self.bug.scale is not None else self.scaling)
        if self.softcap is not None:
            att = torch.tanh(att / self.softcap) * self.softcap
        future = torch.ones(T, T, dtype=torch.bool).tril(self.bug.causal_offset) == 0  # (T, T)
        att = att.masked_fill(future, float("-inf"))
        if self.bug.softmax_dtype is not None:
            att = F.softmax(att.to(self.bug.softmax_dtype), dim=-1).to(q.dtype)
        else:
            att = F.softmax(att, dim=-1, dtype=torch.float32).to(q.dtype)
        y = att @ v  # (B, h, T, T) x (B, h, T, d) -> (B, h, T, d)
        return self.o_proj(y.transpose(1, 2).reshape(B, T, self.h * self.d))


class PortBlock(nn.Module):
    def __init__(self, cfg, layer: int, bug: Bug, gemma: bool):
        super().__init__()
        self.gemma, self.eps = gemma, cfg.rms_norm_eps
        names = ["input_layernorm", "post_attention_layernorm"]
        names += ["pre_feedforward_layernorm", "post_feedforward_layernorm"] if gemma else []
        for name in names:
            setattr(self, name, nn.Parameter(torch.ones(cfg.hidden_size)))
        self.self_attn = PortAttention(cfg, layer, bug, gemma)
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def norm(self, x, name):
        return rms_norm(x, getattr(self, name), self.eps, self.gemma)

    def mlp(self, x):
        act = F.gelu(self.gate_proj(x), approximate="tanh") if self.gemma else F.silu(self.gate_proj(x))
        return self.down_proj(act * self.up_proj(x))

    def forward(self, x):
        if not self.gemma:
            x = x + self.self_attn(self.norm(x, "input_layernorm"))
            return x + self.mlp(self.norm(x, "post_attention_layernorm"))
        x = x + self.norm(self.self_attn(self.norm(x, "input_layernorm")), "post_attention_layernorm")
        return x + self.norm(self.mlp(self.norm(x, "pre_feedforward_layernorm")), "post_feedforward_layernorm")


class Llama(nn.Module):
    def __init__(self, cfg, bugs: dict[int, Bug] | None = None, gemma: bool = False):
        super().__init__()
        bugs = bugs or {}
        self.gemma = gemma
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            [PortBlock(cfg, i, bugs.get(i, Bug()), gemma) for i in range(cfg.num_hidden_layers)]
        )
        self.norm = nn.Parameter(torch.ones(cfg.hidden_size))
        self.hidden, self.eps = cfg.hidden_size, cfg.rms_norm_eps

    def forward(self, input_ids):
        x = self.embed_tokens(input_ids)  # (B, T, hidden)
        if self.gemma:
            x = x * torch.tensor(self.hidden**0.5, dtype=x.dtype)
        for layer in self.layers:
            x = layer(x)
        return rms_norm(x, self.norm, self.eps, self.gemma)  # HF's last_hidden_state

    @classmethod
    def from_hf(cls, hf, bugs: dict[int, Bug] | None = None) -> Llama:
        """The port, given a loaded ``LlamaForCausalLM`` / ``Gemma2ForCausalLM``'s weights."""
        gemma = type(hf).__name__.startswith("Gemma2")
        model = cls(hf.config, bugs, gemma)
        src = hf.model
        with torch.no_grad():
            model.embed_tokens.weight.copy_(src.embed_tokens.weight)
            model.norm.copy_(src.norm.weight)
            for mine, theirs in zip(model.layers, src.layers):
                for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                    getattr(mine.self_attn, name).weight.copy_(getattr(theirs.self_attn, name).weight)
                for name in ("gate_proj", "up_proj", "down_proj"):
                    getattr(mine, name).weight.copy_(getattr(theirs.mlp, name).weight)
                for name, p in mine.named_parameters(recurse=False):
                    p.copy_(getattr(theirs, name).weight)
        return model.eval()


# --------------------------------------------------------------------------- factories for `attnprobe compare`


def tiny_llama():
    """HF Llama from a tiny config (seeded: every call makes the same weights)."""
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=100,
    )
    return transformers.LlamaForCausalLM(cfg).eval()


def llama_port():
    return Llama.from_hf(tiny_llama())


def llama_port_interleaved():
    """The port with interleaved RoPE in layer 1 (HF's weights are laid out for half-rotated pairs)."""
    return Llama.from_hf(tiny_llama(), {1: Bug(rope="interleaved")})
