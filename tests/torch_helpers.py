"""Attention written the ways people write it, for the tests of code attnprobe has never seen.

Each module is small, deterministic under ``torch.manual_seed`` and runs on CPU in milliseconds.
Broken variants carry exactly one bug each, for the lint tests.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.functional import scaled_dot_product_attention as attend  # the alias the sdpa tests need

import attnprobe

D_MODEL, N_HEADS = 16, 4
D_HEAD = D_MODEL // N_HEADS


# ---------------------------------------------------------------------------------------------- style 1
class Head(nn.Module):
    """One causal head with its own projections ("Let's build GPT" style)."""

    def __init__(self, d_model: int = D_MODEL, d_head: int = D_HEAD, max_len: int = 16, bug: str | None = None):
        super().__init__()
        self.key = nn.Linear(d_model, d_head, bias=False)
        self.query = nn.Linear(d_model, d_head, bias=False)
        self.value = nn.Linear(d_model, d_head, bias=False)
        self.register_buffer("tril", torch.tril(torch.ones(max_len, max_len)))
        self.dropout = nn.Dropout(0.1)
        self.bug = bug

    def forward(self, x):
        B, T, C = x.shape  # noqa: RUF059  (the "Let's build GPT" idiom, as the code this copies writes it)
        k = self.key(x)  # (B, T, d_head)
        q = self.query(x)
        wei = q @ k.transpose(-2, -1) * k.shape[-1] ** -0.5  # (B, T, T)
        if self.bug == "unused_mask":
            wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))  # result dropped: no mask
        else:
            wei = wei.masked_fill(self.tril[:T, :T] == 0, float("-inf"))
        wei = F.softmax(wei, dim=-2 if self.bug == "softmax_axis" else -1)
        wei = self.dropout(wei)
        v = self.value(x)
        return wei @ (k if self.bug == "same_kv" else v)  # (B, T, d_head)


class HeadList(nn.Module):
    """Single-head modules in an nn.ModuleList, concatenated by the wrapper."""

    def __init__(self, n_heads: int = N_HEADS, d_model: int = D_MODEL, bug: str | None = None):
        super().__init__()
        self.heads = nn.ModuleList([Head(d_model, d_model // n_heads, bug=bug) for _ in range(n_heads)])
        self.proj = nn.Linear(d_model, d_model)

    def forward(self, x):
        return self.proj(torch.cat([h(x) for h in self.heads], dim=-1))


# ---------------------------------------------------------------------------------------------- style 2
class FusedSplit(nn.Module):
    """Fused q/k/v projection split into heads with view/transpose (nanoGPT style); causal + key padding."""

    def __init__(self, d_model: int = D_MODEL, n_heads: int = N_HEADS, bug: str | None = None):
        super().__init__()
        self.c_attn = nn.Linear(d_model, 3 * d_model)
        self.c_proj = nn.Linear(d_model, d_model)
        self.n_heads = n_heads
        self.bug = bug

    def forward(self, x, padding=None):
        B, T, C = x.shape
        H = self.n_heads
        q, k, v = self.c_attn(x).split(C, dim=2)
        q = q.view(B, T, H, C // H).transpose(1, 2)  # (B, H, T, D)
        k = k.view(B, T, H, C // H).transpose(1, 2)
        v = v.view(B, T, H, C // H).transpose(1, 2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, H, T, T)
        causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
        att = att.masked_fill(~causal, float("-inf"))
        if padding is not None:  # (B, T), 1 = real token: an additive mask
            att = att + (1.0 - padding[:, None, None, :].float()) * -1e9
        att = F.softmax(att, dim=-1)
        y = att @ v  # (B, H, T, D)
        if self.bug == "head_merge":
            y = y.reshape(B, T, C)  # heads merged without moving H next to D
        else:
            y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.c_proj(y)


# ---------------------------------------------------------------------------------------------- style 3
class ChunkedQKV(nn.Module):
    """One fused qkv layer laid out per head, (B, T, H, 3*D), chunked into q, k, v; einsum products."""

    def __init__(self, d_model: int = D_MODEL, n_heads: int = N_HEADS):
        super().__init__()
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.out = nn.Linear(d_model, d_model)
        self.h, self.d = n_heads, d_model // n_heads

    def forward(self, x):
        B, T, _ = x.shape
        qkv = self.qkv(x).view(B, T, self.h, 3 * self.d)
        q, k, v = qkv.chunk(3, dim=-1)  # each (B, T, H, D)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) / math.sqrt(self.d)
        w = scores.softmax(dim=-1)
        o = torch.einsum("bhqk,bkhd->bqhd", w, v)  # (B, T, H, D)
        return self.out(o.reshape(B, T, self.h * self.d))


class EinsumHeads(nn.Module):
    """Products and the head merge written with einsum, (B, H, T, D) layout; ``merge`` picks how heads are merged:
    ``"einsum"`` (``bhqd->bqhd`` then reshape), ``"project"`` (einsum with the output weights, per head),
    ``"bqhd"`` (the product writes (B, T, H, D) directly); bugs: ``"reshape"`` (no transpose), ``"bqdh"``."""

    def __init__(self, d_model: int = D_MODEL, n_heads: int = N_HEADS, merge: str = "einsum"):
        super().__init__()
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.w_o = nn.Parameter(torch.randn(n_heads, d_model // n_heads, d_model) / d_model**0.5)
        self.h, self.d, self.merge = n_heads, d_model // n_heads, merge

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.d).permute(2, 0, 3, 1, 4)  # (B, H, T, D) each
        w = torch.einsum("bhqd,bhkd->bhqk", q, k).mul(self.d**-0.5).softmax(-1)
        if self.merge == "bqhd":
            return torch.einsum("bhqk,bhkd->bqhd", w, v).reshape(B, T, C)
        if self.merge == "bqdh":
            return torch.einsum("bhqk,bhkd->bqdh", w, v).reshape(B, T, C)  # bug: d_head before head
        o = torch.einsum("bhqk,bhkd->bhqd", w, v)  # (B, H, T, D)
        if self.merge == "project":
            return torch.einsum("bhqd,hde->bqe", o, self.w_o)
        if self.merge == "reshape":
            return o.reshape(B, T, C)  # bug: heads merged without moving H next to D
        return torch.einsum("bhqd->bqhd", o).reshape(B, T, C)


# ---------------------------------------------------------------------------------------------- style 4
class RawCrossAttention(nn.Module):
    """Cross-attention from raw parameter matrices, heads folded into the batch for bmm."""

    def __init__(self, d_model: int = D_MODEL, d_context: int = 12, n_heads: int = N_HEADS):
        super().__init__()
        self.h, self.d = n_heads, d_model // n_heads
        self.W_q = nn.Parameter(torch.randn(d_model, d_model) / d_model**0.5)
        self.W_k = nn.Parameter(torch.randn(d_context, d_model) / d_context**0.5)
        self.W_v = nn.Parameter(torch.randn(d_context, d_model) / d_context**0.5)
        self.W_o = nn.Parameter(torch.randn(d_model, d_model) / d_model**0.5)

    def split(self, t):  # (B, T, H*D) -> (B*H, T, D)
        B, T, _ = t.shape
        return t.view(B, T, self.h, self.d).transpose(1, 2).reshape(B * self.h, T, self.d)

    def forward(self, x, context, context_mask):
        B, T, _ = x.shape
        q, k, v = self.split(x @ self.W_q), self.split(context @ self.W_k), self.split(context @ self.W_v)
        scores = torch.bmm(q, k.transpose(1, 2)) / math.sqrt(self.d)  # (B*H, T, S)
        keep = context_mask.bool().repeat_interleave(self.h, dim=0)[:, None, :]  # (B*H, 1, S)
        scores = scores.masked_fill(~keep, float("-inf"))
        out = torch.bmm(torch.softmax(scores, dim=-1), v)  # (B*H, T, D)
        out = out.view(B, self.h, T, self.d).transpose(1, 2).reshape(B, T, self.h * self.d)
        return out @ self.W_o


# ---------------------------------------------------------------------------------------------- sdpa
class SdpaBlock(nn.Module):
    """Calls scaled_dot_product_attention under another name (``attend``); optional GQA, causal, scale."""

    def __init__(
        self,
        d_model: int = D_MODEL,
        n_heads: int = N_HEADS,
        kv_heads: int | None = None,
        causal: bool = False,
        scale: float | None = None,
    ):
        super().__init__()
        self.h, self.kvh, self.d = n_heads, kv_heads or n_heads, d_model // n_heads
        self.causal, self.scale = causal, scale
        self.q = nn.Linear(d_model, d_model)
        self.kv = nn.Linear(d_model, 2 * self.kvh * self.d)
        self.o = nn.Linear(d_model, d_model)

    def forward(self, x, mask=None):
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.h, self.d).transpose(1, 2)
        k, v = self.kv(x).view(B, T, 2, self.kvh, self.d).permute(2, 0, 3, 1, 4)
        o = attend(q, k, v, attn_mask=mask, is_causal=self.causal, scale=self.scale, enable_gqa=self.kvh != self.h)
        return self.o(o.transpose(1, 2).reshape(B, T, -1))


class Mixed(nn.Module):
    """Every kind at once: attnprobe's own module, nn.MultiheadAttention, a direct sdpa call, hand-written heads."""

    def __init__(self):
        super().__init__()
        self.own = attnprobe.MultiHeadAttention(D_MODEL, N_HEADS, causal=True)
        self.mha = nn.MultiheadAttention(D_MODEL, N_HEADS, batch_first=True)
        self.sdpa = SdpaBlock()
        self.hand = HeadList()

    def forward(self, x):
        x = self.own(x)
        x = self.mha(x, x, x, need_weights=False)[0]
        x = self.sdpa(x)
        return self.hand(x)


def reference_weights(q, k, scaling, allowed):
    """softmax(q k^T * scaling) over allowed keys, rows with no allowed key = 0 (attnprobe's convention)."""
    scores = (q @ k.transpose(-2, -1)) * scaling
    w = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
    return w.masked_fill(~allowed.any(-1, keepdim=True), 0.0)


def leftovers(model: nn.Module) -> list[str]:
    """Everything a capture could leave behind: function modes, the MHA fast-path switch, hooks."""
    from conftest import hooks_on

    left = hooks_on(model)
    if torch.overrides._get_current_function_mode_stack():
        left.append("torch function mode")
    if not torch.backends.mha.get_fastpath_enabled():
        left.append("mha fast path still disabled")
    return left


def attend_heads(q, k, v):
    """A helper in another module, called as ``torch_helpers.attend_heads`` (module attribute access)."""
    return F.scaled_dot_product_attention(q, k, v)
