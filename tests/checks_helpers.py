"""Deliberately broken attention for the invariant-check tests.

``BuggyAttention`` is attnprobe's own ``MultiHeadAttention`` math with one named bug switched on,
keeping every hook point, so ``attnprobe.capture`` reads it like the real module. Grouped-query
attention and Hugging Face-style records (sinks, KV-cache steps, sliding windows, eager's uniform
rows) are built as ``AttentionRecord``s directly, the way an adapter would.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

import attnprobe
from attnprobe import AttentionRecord, CrossAttention, MultiHeadAttention
from attnprobe.probe.modules import key_padding_to_bool

BUGS = (
    "mask_not_applied",  # masked_fill without assignment: the mask is built and thrown away
    "inverted_mask",  # the module builds ~allowed and uses it consistently
    "inverted_fill",  # the hook sees the right mask, the softmax gets masked_fill(allowed, -inf)
    "causal_plus_one",  # tril(diagonal=1): each query sees the next token
    "causal_minus_one",  # tril(diagonal=-1): a query may not attend itself
    "softmax_wrong_axis",  # softmax over the queries (dim=-2)
    "padding_not_masked",  # the key padding never enters the mask
    "nan_rows",  # naive -inf softmax: fully masked rows become NaN
    "dropout_in_eval",  # F.dropout(..., training=True) on the weights used for the output
    "dropout_before_hook",  # the same, and the hook sees the dropped weights
    "doubled_scale",  # q pre-scaled, then a fused kernel scales again (Whisper-style)
)


class BuggyAttention(MultiHeadAttention):
    """``MultiHeadAttention`` with one deliberate bug (``bug=None`` is the correct math)."""

    def __init__(self, *args, bug: str | None = None, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        if bug is not None and bug not in BUGS:
            raise ValueError(f"unknown bug {bug!r}")
        self.bug = bug

    def forward(self, x, context=None, *, attention_mask=None, attn_mask=None, is_causal=None):
        info = self.resolve_call(x, context, attention_mask=attention_mask, attn_mask=attn_mask, is_causal=is_causal)
        bug = self.bug
        source = x if context is None else context
        B, Tq, _ = x.shape
        Tk = source.shape[1]
        H, D = self.num_heads, self.d_head
        q = self.hook_q(self.q_proj(x).view(B, Tq, H, D).transpose(1, 2))  # (B, H, Tq, D)
        k = self.hook_k(self.k_proj(source).view(B, Tk, H, D).transpose(1, 2))
        v = self.hook_v(self.v_proj(source).view(B, Tk, H, D).transpose(1, 2))

        scores = self.hook_scores((q @ k.transpose(-2, -1)) * self.scaling)  # (B, H, Tq, Tk)
        allowed = torch.ones(B, 1, Tq, Tk, dtype=torch.bool)
        if attention_mask is not None and bug != "padding_not_masked":
            allowed = allowed & key_padding_to_bool(attention_mask)[:, None, None, :]
        if info.causal:
            shift = {"causal_plus_one": 1, "causal_minus_one": -1}.get(bug, 0)
            allowed = allowed & torch.ones(Tq, Tk, dtype=torch.bool).tril(shift)
        if bug == "inverted_mask":
            allowed = ~allowed
        allowed = self.hook_allowed(allowed)

        if bug == "mask_not_applied":
            scores.masked_fill(~allowed, float("-inf"))  # the bug: result thrown away
            masked = scores
        elif bug == "inverted_fill":
            masked = scores.masked_fill(allowed, float("-inf"))
        else:
            masked = scores.masked_fill(~allowed, float("-inf"))
        weights = torch.softmax(masked, dim=-2 if bug == "softmax_wrong_axis" else -1)
        if bug not in ("mask_not_applied", "inverted_fill", "nan_rows"):
            weights = weights.masked_fill(~allowed, 0.0)  # rows with no allowed key: NaN -> 0
        if bug == "dropout_before_hook":
            weights = F.dropout(weights, 0.5, training=True)
        weights = self.hook_weights(weights)
        used = F.dropout(weights, 0.5, training=True) if bug == "dropout_in_eval" else self.attn_dropout(weights)
        if bug == "doubled_scale":
            out = F.scaled_dot_product_attention(q * self.scaling, k, v, attn_mask=allowed)
        else:
            out = used @ v  # (B, H, Tq, D)
        out = self.hook_output(out.transpose(1, 2).reshape(B, Tq, H * D))
        return out if self.out_proj is None else self.out_proj(out)


class DropsMaskBlock(nn.Module):
    """A transformer block whose attention wrapper accepts a mask and never passes it on."""

    def __init__(self, d: int = 16, heads: int = 4) -> None:
        super().__init__()
        self.attn = MultiHeadAttention(d, num_heads=heads)
        self.norm = nn.LayerNorm(d)

    def forward(self, x, attention_mask=None):
        return x + self.attn(self.norm(x))  # the bug: attention_mask is dropped here


class TinyTransformer(nn.Module):
    """Layer 0: encoder self-attention; 1 and 2: causal decoder self-attention (layer 1 may carry a
    ``bug``); 3: cross-attention to the encoder."""

    def __init__(self, d: int = 16, d_ctx: int = 12, heads: int = 4, bug: str | None = None) -> None:
        super().__init__()
        self.enc = MultiHeadAttention(d_ctx, num_heads=2)
        self.dec0 = BuggyAttention(d, num_heads=heads, causal=True, bug=bug)
        self.dec1 = MultiHeadAttention(d, num_heads=heads, causal=True)
        self.cross = CrossAttention(d, d_ctx, num_heads=heads)

    def forward(self, x, ctx, attention_mask=None, context_mask=None):
        ctx = self.enc(ctx, attention_mask=context_mask)
        x = x + self.dec0(x, attention_mask=attention_mask)
        x = x + self.dec1(x, attention_mask=attention_mask)
        return x + self.cross(x, ctx, attention_mask=context_mask)


def declarations(mask, ctx_mask) -> dict:
    """What a user of ``TinyTransformer`` declares: per layer, since the layers see different sequences."""
    return {
        "causal": {0: False, 1: True, 2: True},
        "attention_mask": {0: ctx_mask, 1: mask, 2: mask, 3: ctx_mask},
    }


def capture_one(module: nn.Module, *args, options: dict | None = None, train: bool = False, **kwargs):
    """Run ``module`` once (eval mode unless ``train``) under ``attnprobe.capture(module, **options)``;
    check that no hook is left behind and return the Capture."""
    from conftest import hooks_on

    module.train(train)
    with torch.no_grad(), attnprobe.capture(module, **(options or {})) as cap:
        module(*args, **kwargs)
    assert not hooks_on(module), hooks_on(module)
    return cap


LEFT_PADDED = torch.tensor([[0, 0, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]])
RIGHT_PADDED = torch.tensor([[1, 1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1, 1]])


# --------------------------------------------------------------------------- records built directly
def reference_record(
    q,
    k,
    v,
    *,
    allowed,
    scaling=None,
    sinks=None,
    bias=None,
    softcap=None,
    wrong_kv_mapping=False,
    uniform_empty_rows=False,
    **fields,
) -> AttentionRecord:
    """A self-attention record computed by hand the way an eager backend does.

    q ``(B, H, Tq, D)``, k/v ``(B, KV, Tk, D)`` (grouped-query when KV < H), allowed
    ``(B, 1, Tq, Tk)``. ``wrong_kv_mapping`` computes the output with query head h reading kv head
    ``h % KV`` instead of ``h // (H // KV)`` (the weights stay right: only the output is wrong).
    ``uniform_empty_rows``: rows with no allowed key get uniform weights, as eager's finfo.min mask gives.
    ``bias`` (T5-style position bias, broadcast to the scores) and ``softcap`` (Gemma2) enter the scores.
    """
    B, H, Tq, D = q.shape
    KV = k.shape[1]
    group = H // KV
    scaling = 1 / math.sqrt(D) if scaling is None else scaling
    right = torch.arange(H) // group
    k_h = k[:, right]
    scores = (q @ k_h.transpose(-2, -1)) * scaling
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if bias is not None:
        scores = scores + bias
    fill = torch.finfo(scores.dtype).min if uniform_empty_rows else float("-inf")
    logits = scores.masked_fill(~allowed, fill)
    if sinks is not None:
        sink = sinks.reshape(1, H, 1, 1).expand(B, H, Tq, 1).to(scores.dtype)
        weights = torch.softmax(torch.cat([logits, sink], -1), -1)[..., :-1]
    else:
        weights = torch.softmax(logits, -1)
    weights = weights.nan_to_num(0.0)
    mapping = torch.arange(H) % KV if wrong_kv_mapping else right
    output = weights @ v[:, mapping]
    return AttentionRecord(
        name=fields.pop("name", "attn"),
        layer=fields.pop("layer", 0),
        call=0,
        kind=fields.pop("kind", "self"),
        num_heads=H,
        num_kv_heads=KV,
        heads=tuple(range(H)),
        kv_heads=tuple(range(KV)),
        q=q,
        k=k,
        v=v,
        scores=scores,
        weights=weights,
        output=output,
        allowed=allowed,
        scaling=scaling,
        sinks=sinks,
        softcap=softcap,
        backend=fields.pop("backend", "eager"),
        dtype=q.dtype,
        weights_source="recomputed",
        **fields,
    )


def causal_allowed(B: int, Tq: int, Tk: int, *, offset: int = 0, window: int | None = None, padding=None):
    """(B, 1, Tq, Tk) bool: query i (at key index offset + i) may attend keys <= its position, within
    ``window`` (which includes the query itself), and not padded keys (``padding``: (B, Tk), 1 = real)."""
    pos = torch.arange(Tq)[:, None] + offset
    keys = torch.arange(Tk)[None, :]
    allowed = keys <= pos
    if window is not None:
        allowed = allowed & (keys > pos - window)
    allowed = allowed.expand(B, 1, Tq, Tk)
    if padding is not None:
        allowed = allowed & padding.bool()[:, None, None, :]
    return allowed.contiguous()
