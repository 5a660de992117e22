"""Attention the way it is written in the wild, each style written from scratch for the tests of
``test_torch_wild.py`` (nanoGPT, timm ViT, the Annotated Transformer, einsum, GQA, ALiBi, relative
position tables, encoder-decoder, folded-head ``baddbmm``/``bmm``, the Llama reference code).

Each class takes ``bug=`` with one realistic mistake in that style, or None for the correct code.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

D, H = 16, 4
HD = D // H


# ------------------------------------------------------------------------------------------------ 1 nanoGPT
class CausalSelfAttention(nn.Module):
    """nanoGPT: one fused c_attn, a registered tril buffer, an optional flash (sdpa) branch."""

    def __init__(self, n_embd=D, n_head=H, block_size=8, flash=False, dropout=0.0, masking="fill", bug=None):
        super().__init__()
        self.masking = masking  # "fill": masked_fill; "assign": att[:, :, future] = -inf
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.attn_dropout, self.resid_dropout = nn.Dropout(dropout), nn.Dropout(dropout)
        self.n_head, self.n_embd, self.dropout, self.flash, self.bug = n_head, n_embd, dropout, flash, bug
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = F.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True
            )
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
            keep = self.bias[:, :, :T, :T] == (1 if self.bug == "mask_eq_1" else 0)
            if self.masking == "assign":
                att[:, :, keep[0, 0]] = float("-inf")
            else:
                att = att.masked_fill(keep, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v  # (B, nh, T, hs)
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        return self.resid_dropout(self.c_proj(y))


# ------------------------------------------------------------------------------------------------ 2 timm ViT
class VitAttention(nn.Module):
    """timm's Attention: qkv reshaped (B, N, 3, H, D) and permuted, q pre-scaled, optional qk-norm."""

    def __init__(self, dim=D, num_heads=H, qk_norm=False, fused_attn=False, bug=None):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.scale = self.head_dim**-0.5
        self.fused_attn, self.bug = fused_attn, bug
        self.qkv = nn.Linear(dim, dim * 3, bias=True)
        self.q_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.k_norm = nn.LayerNorm(self.head_dim) if qk_norm else nn.Identity()
        self.attn_drop = nn.Dropout(0.0)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # (B, H, N, D) each
        q, k = self.q_norm(q), self.k_norm(k)
        if self.fused_attn:
            x = F.scaled_dot_product_attention(q, k, v)
        else:
            q = q * self.scale
            attn = q @ k.transpose(-2, -1)
            attn = attn.softmax(dim=-1)
            attn = self.attn_drop(attn)
            x = attn @ v
        x = x.reshape(B, N, C) if self.bug == "merge_without_transpose" else x.transpose(1, 2).reshape(B, N, C)
        return self.proj(x)


# ---------------------------------------------------------------------------------------------- 3 Annotated Transformer
def attention(query, key, value, mask=None, dropout=None, bug=None):
    """Scaled dot product attention as a free function, masks with -1e9."""
    d_k = query.size(-1)
    scores = torch.matmul(query, key.transpose(-2, -1)) / math.sqrt(d_k)
    if mask is not None:
        scores = scores.masked_fill(mask == (1 if bug == "mask_eq_1" else 0), -1e9)
    p_attn = scores.softmax(dim=-1)
    if dropout is not None:
        p_attn = dropout(p_attn)
    return torch.matmul(p_attn, value), p_attn


class MultiHeadedAttention(nn.Module):
    def __init__(self, h=H, d_model=D, dropout=0.0, bug=None):
        super().__init__()
        self.d_k, self.h, self.bug = d_model // h, h, bug
        self.linears = nn.ModuleList([nn.Linear(d_model, d_model) for _ in range(4)])
        self.attn = None
        self.dropout = nn.Dropout(p=dropout)

    def forward(self, query, key, value, mask=None):
        if mask is not None:
            mask = mask.unsqueeze(1)  # the same mask for every head
        nbatches = query.size(0)
        query, key, value = [
            lin(x).view(nbatches, -1, self.h, self.d_k).transpose(1, 2)
            for lin, x in zip(self.linears, (query, key, value))
        ]
        x, self.attn = attention(query, key, value, mask=mask, dropout=self.dropout, bug=self.bug)
        x = x.transpose(1, 2).contiguous().view(nbatches, -1, self.h * self.d_k)
        del query, key, value
        return self.linears[-1](x)


def subsequent_mask(size):
    """(1, size, size), True where a query may attend (itself and earlier keys)."""
    return torch.triu(torch.ones((1, size, size)), diagonal=1).type(torch.uint8) == 0


# ------------------------------------------------------------------------------------------------ 4 einsum
class EinsumAttention(nn.Module):
    def __init__(self, dim=D, heads=H, bug=None):
        super().__init__()
        self.heads, self.scale, self.bug = heads, (dim // heads) ** -0.5, bug
        self.to_q, self.to_k, self.to_v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.to_out = nn.Linear(dim, dim)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (f(x).view(b, n, self.heads, -1).permute(0, 2, 1, 3) for f in (self.to_q, self.to_k, self.to_v))
        dots = torch.einsum("bhid,bhjd->bhij", q, k) * self.scale
        attn = dots.softmax(dim=-2 if self.bug == "softmax_dim" else -1)
        out = torch.einsum("bhij,bhjd->bhid", attn, v)
        return self.to_out(out.permute(0, 2, 1, 3).reshape(b, n, -1))


# ------------------------------------------------------------------------------------------------ 5 MQA / GQA
class GroupedQueryAttention(nn.Module):
    """k/v with fewer heads, repeated up to the query heads (``repeat_interleave`` or ``expand``+``reshape``),
    or kept grouped: q viewed (B, KV, G, T, D) against k (B, KV, 1, T, D) by broadcasting."""

    def __init__(self, dim=D, heads=H, kv_heads=2, repeat="interleave", causal=True, bug=None):
        super().__init__()
        self.h, self.kv, self.hd, self.repeat, self.causal, self.bug = (
            heads,
            kv_heads,
            dim // heads,
            repeat,
            causal,
            bug,
        )
        self.wq = nn.Linear(dim, heads * self.hd, bias=False)
        self.wk = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(dim, kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(heads * self.hd, dim, bias=False)

    def forward(self, x):
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.h, self.hd).transpose(1, 2)  # (B, H, T, D)
        k = self.wk(x).view(B, T, self.kv, self.hd).transpose(1, 2)  # (B, KV, T, D)
        v = self.wv(x).view(B, T, self.kv, self.hd).transpose(1, 2)
        rep = self.h // self.kv
        if self.repeat == "interleave":
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        elif self.repeat == "expand":  # Llama's repeat_kv
            k = k[:, :, None].expand(B, self.kv, rep, T, self.hd).reshape(B, self.h, T, self.hd)
            v = v[:, :, None].expand(B, self.kv, rep, T, self.hd).reshape(B, self.h, T, self.hd)
        elif self.repeat == "expand_one":  # multi-query: the single head expanded
            k, v = k.expand(B, self.h, T, self.hd), v.expand(B, self.h, T, self.hd)
        elif self.repeat == "grouped":  # no copy: (B, KV, G, T, D) x (B, KV, 1, T, D)
            q = q.view(B, self.kv, rep, T, self.hd)
            k, v = k[:, :, None], v[:, :, None]
        scores = q @ k.transpose(-2, -1) / math.sqrt(self.hd)
        if self.causal:
            future = torch.ones(T, T, dtype=torch.bool, device=x.device).triu(1)
            scores = scores.masked_fill(future, float("-inf"))
        out = scores.softmax(-1) @ v
        out = out.reshape(B, self.h, T, self.hd)
        return self.wo(out.transpose(1, 2).reshape(B, T, -1))


# ------------------------------------------------------------------------------------------------ 6 additive biases
def alibi_slopes(n_heads):
    start = 2 ** (-8 / n_heads)
    return torch.tensor([start ** (i + 1) for i in range(n_heads)])


class AlibiAttention(nn.Module):
    """Causal attention with ALiBi: slope_h * (j - i) added to the scores, then a float -inf causal mask."""

    def __init__(self, dim=D, heads=H, bug=None):
        super().__init__()
        self.h, self.hd, self.bug = heads, dim // heads, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.register_buffer("slopes", alibi_slopes(heads))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, self.h, self.hd).permute(2, 0, 3, 1, 4)
        pos = torch.arange(T, device=x.device)
        distance = pos[None, :] - pos[:, None]  # j - i, <= 0 for the past
        alibi = self.slopes[:, None, None] * distance[None]  # (H, T, T)
        causal = torch.full((T, T), float("-inf"), device=x.device).triu(1)
        scores = q @ k.transpose(-2, -1) * self.hd**-0.5
        scores = scores + alibi if self.bug == "causal_mask_forgotten" else scores + alibi + causal
        w = F.softmax(scores, dim=-1)
        return (w @ v).transpose(1, 2).reshape(B, T, C)


class RelativeBiasAttention(nn.Module):
    """Swin/T5-like: a learned table of (2 * max_distance - 1, heads) biases gathered by relative position."""

    def __init__(self, dim=D, heads=H, max_len=8, bug=None):
        super().__init__()
        self.h, self.hd, self.bug = heads, dim // heads, bug
        self.qkv = nn.Linear(dim, 3 * dim)
        self.relative_position_bias_table = nn.Parameter(torch.randn(2 * max_len - 1, heads) * 0.5)
        pos = torch.arange(max_len)
        self.register_buffer("relative_position_index", (pos[:, None] - pos[None, :]) + max_len - 1)

    def forward(self, x):
        B, N, C = x.shape
        q, k, v = self.qkv(x).reshape(B, N, 3, self.h, self.hd).permute(2, 0, 3, 1, 4).unbind(0)
        attn = (q * self.hd**-0.5) @ k.transpose(-2, -1)
        index = self.relative_position_index[:N, :N].reshape(-1)
        bias = self.relative_position_bias_table[index].view(N, N, -1).permute(2, 0, 1).contiguous()  # (H, N, N)
        attn = attn + bias.unsqueeze(0)
        attn = attn.softmax(dim=-1)
        return (attn @ v).transpose(1, 2).reshape(B, N, C)


# ------------------------------------------------------------------------------------------------ 7 decoder block
class Projected(nn.Module):
    """q from one sequence, k/v from another (or the same), separate projections, float masks."""

    def __init__(self, dim=D, heads=H):
        super().__init__()
        self.h, self.hd = heads, dim // heads
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(dim, dim) for _ in range(4))

    def split(self, t):
        B, T, _ = t.shape
        return t.view(B, T, self.h, self.hd).transpose(1, 2)

    def forward(self, x, memory, mask=None):
        q, k, v = self.split(self.q_proj(x)), self.split(self.k_proj(memory)), self.split(self.v_proj(memory))
        scores = q @ k.transpose(-1, -2) / self.hd**0.5
        if mask is not None:
            scores = scores.masked_fill(~mask, float("-inf"))
        out = torch.softmax(scores, dim=-1) @ v
        B, _, T, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class DecoderBlock(nn.Module):
    def __init__(self, dim=D, heads=H, bug=None):
        super().__init__()
        self.self_attn, self.cross_attn = Projected(dim, heads), Projected(dim, heads)
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.bug = bug

    def forward(self, x, memory, memory_mask):
        """memory_mask (B, S): 1 = real memory token."""
        T = x.shape[1]
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        h = self.ln1(x)
        x = x + self.self_attn(h, h, causal)
        keep = memory_mask.bool()[:, None, None, :]  # (B, 1, 1, S)
        if self.bug == "memory_mask_ignored":
            keep = None
        return x + self.cross_attn(self.ln2(x), memory, keep)


# ------------------------------------------------------------------------------------------------ 8 folded heads
class FoldedHeadsAttention(nn.Module):
    """GPT-2-style upcast path: heads folded into the batch, scores by ``baddbmm`` (beta=0 on an
    uninitialised buffer), the causal mask applied on a (B, H, T, T) view, the output by ``bmm``."""

    def __init__(self, dim=D, heads=H, max_len=8, scratch=None, bug=None):
        super().__init__()
        self.h, self.hd, self.bug = heads, dim // heads, bug
        self.scratch = scratch  # a fill value standing for what torch.empty happens to hold
        self.c_attn = nn.Linear(dim, 3 * dim)
        self.register_buffer("bias", torch.tril(torch.ones(max_len, max_len, dtype=torch.bool)))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=-1)
        q, k, v = (t.view(B, T, self.h, self.hd).transpose(1, 2).reshape(B * self.h, T, self.hd) for t in (q, k, v))
        empty = torch.empty(B * self.h, T, T, dtype=x.dtype)
        if self.scratch is not None:
            empty.fill_(self.scratch)
        scores = torch.baddbmm(empty, q, k.transpose(-1, -2), beta=0, alpha=self.hd**-0.5)
        scores = scores.view(B, self.h, T, T)
        causal = self.bias[:T, :T] if self.bug != "mask_sliced_wrong" else self.bias[-T:, :T]
        scores = torch.where(causal, scores, torch.finfo(scores.dtype).min)
        w = scores.view(B * self.h, T, T).softmax(dim=-1)
        out = torch.bmm(w, v)  # (B*H, T, D)
        return out.view(B, self.h, T, self.hd).transpose(1, 2).reshape(B, T, C)


class BloomStyleAlibi(nn.Module):
    """Bloom: the ALiBi tensor is baddbmm's input term, called as a method with keyword batches."""

    def __init__(self, dim=D, heads=H, bug=None):
        super().__init__()
        self.h, self.hd = heads, dim // heads
        self.query_key_value = nn.Linear(dim, 3 * dim)
        self.register_buffer("slopes", alibi_slopes(heads))

    def forward(self, x):
        B, T, C = x.shape
        fused = self.query_key_value(x).view(B, T, self.h, 3, self.hd)
        q, k, v = fused[..., 0, :], fused[..., 1, :], fused[..., 2, :]
        q = q.transpose(1, 2).reshape(B * self.h, T, self.hd)
        k = k.permute(0, 2, 3, 1).reshape(B * self.h, self.hd, T)
        v = v.transpose(1, 2).reshape(B * self.h, T, self.hd)
        alibi = (self.slopes[:, None] * torch.arange(T)[None, :]).repeat(B, 1)[:, None, :]  # (B*H, 1, T)
        scores = alibi.baddbmm(batch1=q, batch2=k, beta=1.0, alpha=self.hd**-0.5)
        scores = scores.view(B, self.h, T, T)
        future = torch.ones(T, T, dtype=torch.bool).triu(1)
        scores = scores.masked_fill(future, torch.finfo(scores.dtype).min)
        w = F.softmax(scores, dim=-1, dtype=torch.float32).to(x.dtype)
        out = torch.bmm(w.view(B * self.h, T, T), v)
        return out.view(B, self.h, T, self.hd).permute(0, 2, 1, 3).reshape(B, T, C)


# ------------------------------------------------------------------------------------------------ 9 Llama reference
def precompute_freqs_cis(dim, end, theta=10000.0):
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: (dim // 2)].float() / dim))
    t = torch.arange(end).float()
    return torch.polar(torch.ones(end, dim // 2), torch.outer(t, freqs))  # (end, dim/2) complex


def apply_rotary_emb(xq, xk, freqs_cis):
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs = freqs_cis[None, :, None, :]
    return torch.view_as_real(xq_ * freqs).flatten(3).type_as(xq), torch.view_as_real(xk_ * freqs).flatten(3).type_as(
        xk
    )


class LlamaReferenceAttention(nn.Module):
    """Meta's reference Llama: complex rotary on (B, T, H, D), repeat_kv, ``scores + mask`` with a float -inf
    mask, softmax in float32 cast back with ``type_as``."""

    def __init__(self, dim=D, n_heads=H, n_kv_heads=2, max_len=8, bug=None):
        super().__init__()
        self.n_heads, self.n_kv, self.hd, self.bug = n_heads, n_kv_heads, dim // n_heads, bug
        self.wq = nn.Linear(dim, n_heads * self.hd, bias=False)
        self.wk = nn.Linear(dim, n_kv_heads * self.hd, bias=False)
        self.wv = nn.Linear(dim, n_kv_heads * self.hd, bias=False)
        self.wo = nn.Linear(n_heads * self.hd, dim, bias=False)
        self.register_buffer("freqs_cis", precompute_freqs_cis(self.hd, max_len), persistent=False)
        # the KV cache as Meta's generation code keeps it: buffers written in place
        self.register_buffer("cache_k", torch.zeros(2, max_len, n_kv_heads, self.hd), persistent=False)
        self.register_buffer("cache_v", torch.zeros(2, max_len, n_kv_heads, self.hd), persistent=False)

    def forward(self, x, mask, start_pos=None):
        """``start_pos``: None runs without the cache, else the position of x's first token in the cache."""
        bsz, seqlen, _ = x.shape
        xq = self.wq(x).view(bsz, seqlen, self.n_heads, self.hd)
        xk = self.wk(x).view(bsz, seqlen, self.n_kv, self.hd)
        xv = self.wv(x).view(bsz, seqlen, self.n_kv, self.hd)
        first = start_pos or 0
        xq, xk = apply_rotary_emb(xq, xk, self.freqs_cis[first : first + seqlen])
        if start_pos is not None:
            self.cache_k[:bsz, start_pos : start_pos + seqlen] = xk
            self.cache_v[:bsz, start_pos : start_pos + seqlen] = xv
            xk, xv = self.cache_k[:bsz, : start_pos + seqlen], self.cache_v[:bsz, : start_pos + seqlen]
        n_rep, tk = self.n_heads // self.n_kv, xk.shape[1]
        keys = xk[:, :, :, None, :].expand(bsz, tk, self.n_kv, n_rep, self.hd).reshape(bsz, tk, self.n_heads, self.hd)
        values = xv[:, :, :, None, :].expand(bsz, tk, self.n_kv, n_rep, self.hd).reshape(bsz, tk, self.n_heads, self.hd)
        xq, keys, values = xq.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2)
        scores = torch.matmul(xq, keys.transpose(2, 3)) / math.sqrt(self.hd)
        if mask is not None:
            scores = scores + mask  # (seqlen, seqlen)
        scores = F.softmax(scores.float(), dim=-1).type_as(xq)
        output = torch.matmul(scores, values)
        output = output.transpose(1, 2).contiguous().view(bsz, seqlen, -1)
        return self.wo(output)


def llama_mask(seqlen):
    return torch.full((seqlen, seqlen), float("-inf")).triu(1)


class T5StyleAttention(nn.Module):
    """T5/mT5 reference style: no scaling, a bucketed relative position bias with the padding mask folded in as
    ``finfo.min``, added in place (``scores += position_bias``)."""

    def __init__(self, dim=D, heads=H, max_distance=5, bug=None):
        super().__init__()
        self.h, self.hd, self.max_distance, self.bug = heads, dim // heads, max_distance, bug
        self.q, self.k, self.v = (nn.Linear(dim, dim, bias=False) for _ in range(3))
        self.relative_attention_bias = nn.Embedding(2 * max_distance + 1, heads)

    def position_bias(self, T):
        i = torch.arange(T)
        bucket = (i[None, :] - i[:, None]).clamp(-self.max_distance, self.max_distance) + self.max_distance
        return self.relative_attention_bias(bucket).permute(2, 0, 1)[None]  # (1, H, T, T)

    def forward(self, x, mask):
        B, T, _ = x.shape
        q, k, v = (f(x).view(B, T, self.h, self.hd).transpose(1, 2) for f in (self.q, self.k, self.v))
        scores = torch.matmul(q, k.transpose(3, 2))
        padding = mask[:, None, :, None] if self.bug == "mask_on_queries" else mask[:, None, None, :]
        position_bias = self.position_bias(T) + (1.0 - padding) * torch.finfo(x.dtype).min
        scores += position_bias
        w = F.softmax(scores.float(), dim=-1).type_as(scores)
        return torch.matmul(w, v).transpose(1, 2).reshape(B, T, -1)


class CachedCausalSelfAttention(CausalSelfAttention):
    """nanoGPT with a KV cache for generation: past keys/values concatenated, the mask rows of the new queries."""

    def forward(self, x, past=None):
        B, T, C = x.size()
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in self.c_attn(x).split(C, dim=2))
        if past is not None:
            k, v = torch.cat([past[0], k], dim=-2), torch.cat([past[1], v], dim=-2)
        Tk = k.size(-2)
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, Tk)
        rows = slice(0, T) if self.bug == "mask_rows_from_zero" else slice(Tk - T, Tk)
        att = att.masked_fill(self.bias[:, :, rows, :Tk] == 0, float("-inf"))
        y = F.softmax(att, dim=-1) @ v
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C)), (k, v)
