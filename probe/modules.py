"""attnprobe's own attention modules, written so a reader sees the math.

Every intermediate passes through an identity ``HookPoint`` that plain ``register_forward_hook``
can observe, which is also how ``attnprobe.capture`` reads these modules.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import nn


class HookPoint(nn.Module):
    """Identity module: ``register_forward_hook`` on it sees the tensor that flows through."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x


@dataclass(frozen=True)
class CallInfo:
    """What one call of a ``MultiHeadAttention`` is asked to do, resolved from its arguments."""

    kind: str  # "self" or "cross"
    causal: bool
    query_padding: torch.Tensor | None  # (batch, query) bool, True = padding
    batched: bool


def key_padding_to_bool(attention_mask: torch.Tensor) -> torch.Tensor:
    """Hugging Face key padding (1 = real token, 0 = padding; bool or numeric) to bool, True = real."""
    if attention_mask.dtype == torch.bool:
        return attention_mask
    if attention_mask.is_floating_point() and not torch.all((attention_mask == 0) | (attention_mask == 1)):
        raise ValueError(
            "attention_mask must hold 1 for real tokens and 0 for padding (the Hugging Face "
            "convention, shape (batch, key)); for an additive float mask use attn_mask= instead"
        )
    return attention_mask != 0


def sdpa_mask_to_allowed(attn_mask: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor | None]:
    """An ``F.scaled_dot_product_attention``-style mask to (allowed, additive bias or None).

    A bool mask means True = take part in attention. A float mask is added to the scores; entries at
    or below half the dtype's most negative value (or -inf) count as masked (their weight is exactly 0),
    the rest are a bias. NaN or +inf in a float mask is refused (it would make the weights NaN).
    """
    if attn_mask.dtype == torch.bool:
        return attn_mask, None
    if not attn_mask.is_floating_point():
        raise TypeError(
            f"attn_mask must be bool (True = attend) or floating point (added to the scores), got {attn_mask.dtype}"
        )
    if not bool((attn_mask < math.inf).all()):
        raise ValueError(
            "attn_mask holds NaN or +inf; a float mask is added to the scores: use 0 where a key may be attended "
            "and -inf (or a large negative number) where it may not, or pass a bool mask (True = attend)"
        )
    threshold = torch.finfo(attn_mask.dtype).min / 2
    allowed = attn_mask > threshold
    return allowed, attn_mask.masked_fill(~allowed, 0.0).to(dtype)


def _check_attn_mask(attn_mask, shape: tuple[int, int, int, int], batched: bool) -> None:
    """``attn_mask`` must be a bool or float tensor that broadcasts to ``shape`` = (batch, head, query, key)."""
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError(
            f"attn_mask must be a tensor (bool: True = attend, or float: added), got {type(attn_mask).__name__}"
        )
    if attn_mask.dtype != torch.bool and not attn_mask.is_floating_point():
        raise TypeError(
            f"attn_mask must be bool (True = attend) or floating point (added to the scores), got {attn_mask.dtype}; "
            "for Hugging Face key padding (1 = real token, 0 = padding) use attention_mask= instead"
        )
    B, H, Tq, Tk = shape
    target = (B, H, Tq, Tk) if batched else (H, Tq, Tk)
    ok = attn_mask.dim() <= len(target)
    if ok:
        try:
            ok = torch.broadcast_shapes(tuple(attn_mask.shape), target) == target
        except RuntimeError:
            ok = False
    if not ok:
        what = "(batch, head, query, key)" if batched else "(head, query, key) for unbatched input"
        raise ValueError(
            f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to {what} = {target}; "
            "give it shape (query, key) for one mask shared by all, or add batch/head axes of size 1 or of full size"
        )


class MultiHeadAttention(nn.Module):
    """Multi-head scaled dot-product attention: self, causal self, and cross-attention.

    ``forward(x, context=None, *, attention_mask=None, attn_mask=None, is_causal=None)``

    - ``x``: queries ``(batch, query, d_model)`` or unbatched ``(query, d_model)``.
    - ``context``: keys/values ``(batch, key, d_context)`` for cross-attention; None = self-attention.
    - ``attention_mask``: key padding in the Hugging Face convention, ``(batch, key)``, 1 = real token,
      0 = padding. For self-attention it also marks the padded query rows.
    - ``attn_mask``: an explicit mask in the ``F.scaled_dot_product_attention`` convention, bool
      (True = may attend) or float (added to the scores; -inf, or at most half the dtype's lowest value,
      masks the key: weight exactly 0), broadcastable to ``(batch, head, query, key)`` (``(head, query, key)``
      for unbatched input) without growing it.
    - ``is_causal``: overrides the module's ``causal`` for this call.

    Query rows with no allowed key (a padded query under a causal mask) get zero weights and a zero
    output, never NaN. Hook points: ``hook_q``, ``hook_k``, ``hook_v`` ``(batch, head, seq, d_head)``,
    ``hook_scores`` (pre-softmax, before masking; a float ``attn_mask``'s finite values are already added
    there, as a bias), ``hook_allowed`` (bool), ``hook_weights``
    (post-softmax, before dropout), all ``(batch, head, query, key)``; ``hook_output`` the merged
    heads ``(batch, query, head * d_head)`` before the output projection.

    Example::

        >>> import torch
        >>> attn = MultiHeadAttention(16, num_heads=4, d_context=12)   # cross-attention
        >>> attn(torch.randn(2, 9, 16), torch.randn(2, 8, 12)).shape
        torch.Size([2, 9, 16])
    """

    def __init__(
        self,
        d_model: int,
        num_heads: int = 1,
        *,
        d_context: int | None = None,
        d_head: int | None = None,
        causal: bool = False,
        bias: bool = True,
        out_proj: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        if num_heads < 1:
            raise ValueError(f"num_heads must be at least 1, got {num_heads}")
        if d_head is None:
            if d_model % num_heads:
                raise ValueError(
                    f"d_model={d_model} is not divisible by num_heads={num_heads}; pass d_head= explicitly"
                )
            d_head = d_model // num_heads
        if not 0.0 <= dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {dropout}")
        self.d_model = d_model
        self.d_context = d_context if d_context is not None else d_model
        self.num_heads = num_heads
        self.d_head = d_head
        self.causal = causal
        self.scaling = 1.0 / math.sqrt(d_head)
        inner = num_heads * d_head
        # Created in this order (q, k, v, out) so a seeded module has reproducible weights.
        self.q_proj = nn.Linear(d_model, inner, bias=bias)
        self.k_proj = nn.Linear(self.d_context, inner, bias=bias)
        self.v_proj = nn.Linear(self.d_context, inner, bias=bias)
        self.out_proj = nn.Linear(inner, d_model, bias=bias) if out_proj else None
        self.attn_dropout = nn.Dropout(dropout)

        self.hook_q = HookPoint()  # (batch, head, query, d_head)
        self.hook_k = HookPoint()  # (batch, head, key, d_head)
        self.hook_v = HookPoint()  # (batch, head, key, d_head)
        self.hook_scores = HookPoint()  # (batch, head, query, key), pre-softmax, float-mask bias added, not masked
        self.hook_allowed = HookPoint()  # (batch, 1 or head, query, key), bool, True = may attend
        self.hook_weights = HookPoint()  # (batch, head, query, key), post-softmax, before dropout
        self.hook_output = HookPoint()  # (batch, query, head * d_head), before out_proj

    def resolve_call(self, x, context=None, *, attention_mask=None, attn_mask=None, is_causal=None) -> CallInfo:
        """Validate one call's arguments and say what it will do (used by forward and by capture)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"x must be a tensor (batch, query, d_model) or (query, d_model), got {type(x).__name__}")
        if x.dim() not in (2, 3):
            raise ValueError(f"x must be (batch, query, d_model) or (query, d_model), got shape {tuple(x.shape)}")
        batched = x.dim() == 3
        if x.shape[-1] != self.d_model:
            raise ValueError(f"x has width {x.shape[-1]}, this module expects d_model={self.d_model}")
        kind = "self" if context is None else "cross"
        if context is not None:
            if not isinstance(context, torch.Tensor):
                raise TypeError(f"context must be a tensor (batch, key, d_context), got {type(context).__name__}")
            if context.dim() != x.dim():
                raise ValueError(
                    f"context must be batched like x ({'3' if batched else '2'}-D), got shape {tuple(context.shape)}"
                )
            if context.shape[-1] != self.d_context:
                raise ValueError(
                    f"context has width {context.shape[-1]}, this module expects d_context={self.d_context}"
                )
            if batched and context.shape[0] != x.shape[0]:
                raise ValueError(f"x has batch {x.shape[0]} but context has batch {context.shape[0]}")
        elif self.d_context != self.d_model:
            raise ValueError(
                f"this module does cross-attention (d_context={self.d_context} != d_model={self.d_model}): "
                "pass context=(batch, key, d_context)"
            )
        causal = self.causal if is_causal is None else bool(is_causal)
        key_len = (x if context is None else context).shape[-2]
        if causal and key_len != x.shape[-2]:
            raise ValueError(
                f"causal attention needs as many keys as queries, got {x.shape[-2]} queries and {key_len} keys; "
                "use is_causal=False for cross-attention"
            )
        if attn_mask is not None:
            batch = x.shape[0] if batched else 1
            _check_attn_mask(attn_mask, (batch, self.num_heads, x.shape[-2], key_len), batched)
        query_padding = None
        if attention_mask is not None:
            if not isinstance(attention_mask, torch.Tensor):
                raise TypeError(
                    f"attention_mask must be a tensor (batch, key) with 1 = real token and 0 = padding, "
                    f"got {type(attention_mask).__name__}"
                )
            expected = (x.shape[0], key_len) if batched else (key_len,)
            if tuple(attention_mask.shape) != expected:
                raise ValueError(
                    f"attention_mask must be (batch, key) = {expected} with 1 = real token and 0 = padding, "
                    f"got shape {tuple(attention_mask.shape)}"
                )
            if kind == "self":
                query_padding = ~key_padding_to_bool(attention_mask)
                if not batched:
                    query_padding = query_padding.unsqueeze(0)
        return CallInfo(kind=kind, causal=causal, query_padding=query_padding, batched=batched)

    def forward(self, x, context=None, *, attention_mask=None, attn_mask=None, is_causal=None):
        info = self.resolve_call(x, context, attention_mask=attention_mask, attn_mask=attn_mask, is_causal=is_causal)
        if not info.batched:
            x = x.unsqueeze(0)
            context = None if context is None else context.unsqueeze(0)
            attention_mask = None if attention_mask is None else attention_mask.unsqueeze(0)
        source = x if context is None else context
        B, Tq, _ = x.shape
        Tk = source.shape[1]
        H, D = self.num_heads, self.d_head

        # project and split heads: (B, T, H*D) -> (B, H, T, D)
        q = self.hook_q(self.q_proj(x).view(B, Tq, H, D).transpose(1, 2))
        k = self.hook_k(self.k_proj(source).view(B, Tk, H, D).transpose(1, 2))
        v = self.hook_v(self.v_proj(source).view(B, Tk, H, D).transpose(1, 2))

        scores = (q @ k.transpose(-2, -1)) * self.scaling  # (B, H, Tq, Tk)
        allowed = torch.ones(B, 1, Tq, Tk, dtype=torch.bool, device=x.device)  # (B, 1, Tq, Tk)
        if attn_mask is not None:
            mask_allowed, bias = sdpa_mask_to_allowed(attn_mask, scores.dtype)
            if bias is not None:
                scores = scores + bias
            allowed = allowed & mask_allowed  # shape checked in resolve_call: (B, 1 or H, Tq, Tk)
        if attention_mask is not None:
            allowed = allowed & key_padding_to_bool(attention_mask)[:, None, None, :]
        if info.causal:
            allowed = allowed & torch.ones(Tq, Tk, dtype=torch.bool, device=x.device).tril()
        scores = self.hook_scores(scores)
        allowed = self.hook_allowed(allowed)

        # masked softmax; rows with no allowed key come out all -inf -> NaN, then exactly 0
        weights = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1)
        weights = self.hook_weights(weights.masked_fill(~allowed, 0.0))
        out = self.attn_dropout(weights) @ v  # (B, H, Tq, D)

        out = self.hook_output(out.transpose(1, 2).reshape(B, Tq, H * D))  # merge heads
        if self.out_proj is not None:
            out = self.out_proj(out)
        return out if info.batched else out.squeeze(0)

    def extra_repr(self) -> str:
        return (
            f"d_model={self.d_model}, num_heads={self.num_heads}, d_head={self.d_head}, "
            f"d_context={self.d_context}, causal={self.causal}"
        )


class CrossAttention(MultiHeadAttention):
    """Cross-attention: queries of width ``d_model`` attend a context of width ``d_context``.

    ``forward(x, context, *, attention_mask=None, attn_mask=None)``; ``attention_mask`` marks padding
    in the context ``(batch, key)``.

    Example::

        >>> import torch
        >>> CrossAttention(16, 12, num_heads=2)(torch.randn(9, 16), torch.randn(8, 12)).shape
        torch.Size([9, 16])
    """

    def __init__(self, d_model: int, d_context: int, num_heads: int = 1, **kwargs) -> None:
        if kwargs.get("causal"):
            raise ValueError("CrossAttention cannot be causal; use MultiHeadAttention(causal=True) for self-attention")
        super().__init__(d_model, num_heads, d_context=d_context, **kwargs)

    def forward(self, x, context, *, attention_mask=None, attn_mask=None, is_causal=None):
        if context is None:
            raise ValueError("CrossAttention needs a context (batch, key, d_context) to attend")
        return super().forward(x, context, attention_mask=attention_mask, attn_mask=attn_mask, is_causal=is_causal)
