"""A pure-torch stand-in for the flash-attn functions transformers calls, for testing on machines without CUDA.

``flash_attn_func`` and ``flash_attn_varlen_func`` take what flash-attn 2 takes and compute what it computes, in
float32 with the plain formula: ``(batch, tokens, head, d)`` layout, grouped-query heads read as each group's key
head, ``softmax_scale`` (default ``d ** -0.5``), ``softcap`` (``tanh(s / cap) * cap``), ``causal`` aligned to the
lower right (query ``i`` of ``Tq`` sees keys up to ``i + Tk - Tq``), ``window_size=(left, right)`` around that
aligned position (``-1``: unbounded), a row that may attend no key gives zeros; the varlen function runs each
document of ``cu_seqlens_q`` / ``cu_seqlens_k`` on its own. Nothing here comes from attnprobe: it is the reference
the capture's records are held to.

``install(monkeypatch, version)`` makes transformers load these functions for ``flash_attention_2`` (module
``flash_attn``), ``flash_attention_3`` (module ``flash_attn_interface``) or a hub kernel name, for one test.
"""

from __future__ import annotations

import sys
import types

import torch


def _attend(q, k, v, *, scale, causal, window, softcap):
    """One sequence: q ``(Tq, H, d)``, k/v ``(Tk, Hk, d)`` -> ``(Tq, H, d)``."""
    tq, heads, d = q.shape
    tk, kv_heads = k.shape[0], k.shape[1]
    k = k.float().repeat_interleave(heads // kv_heads, dim=1)  # (Tk, H, d): each group reads its key head
    v = v.float().repeat_interleave(heads // kv_heads, dim=1)
    s = torch.einsum("qhd,khd->hqk", q.float(), k) * (d**-0.5 if scale is None else scale)  # (H, Tq, Tk)
    if softcap:
        s = torch.tanh(s / softcap) * softcap
    i = torch.arange(tq)[:, None] + (tk - tq)  # (Tq, 1): the query's position, aligned to the lower right
    j = torch.arange(tk)[None, :]  # (1, Tk)
    allowed = torch.ones(tq, tk, dtype=torch.bool)
    if causal:
        allowed &= j <= i
    left, right = window
    if left >= 0:
        allowed &= j >= i - left
    if right >= 0:
        allowed &= j <= i + right
    p = torch.softmax(s.masked_fill(~allowed, float("-inf")), dim=-1).nan_to_num(0.0)  # empty rows: zeros
    return torch.einsum("hqk,khd->qhd", p, v).to(q.dtype)  # (Tq, H, d)


CALLS: list[str] = []  # which function ran, in order (tests read it to know the path transformers took)


def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    CALLS.append("flash_attn_func")
    assert dropout_p == 0.0 and alibi_slopes is None, "the stand-in computes no dropout and no ALiBi"
    rows = [
        _attend(q[b], k[b], v[b], scale=softmax_scale, causal=causal, window=window_size, softcap=softcap)
        for b in range(q.shape[0])
    ]
    return torch.stack(rows)  # (batch, Tq, H, d)


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    CALLS.append("flash_attn_varlen_func")
    assert dropout_p == 0.0 and alibi_slopes is None and block_table is None
    out = torch.zeros_like(q)  # (total_q, H, d): tokens past the last document stay 0
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for a, b, c, d in zip(cq[:-1], cq[1:], ck[:-1], ck[1:]):
        out[a:b] = _attend(
            q[a:b], k[c:d], v[c:d], scale=softmax_scale, causal=causal, window=window_size, softcap=softcap
        )
    return out


def flash_attn_with_kvcache(*args, **kwargs):
    raise NotImplementedError("the stand-in has no paged cache")


def _fa3_func(q, k, v, softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, deterministic=False):
    """flash-attn 3's signature: no dropout."""
    return flash_attn_func(q, k, v, 0.0, softmax_scale, causal, window_size, softcap)


def _fa3_varlen(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    deterministic=False,
):
    return flash_attn_varlen_func(
        q,
        k,
        v,
        cu_seqlens_q,
        cu_seqlens_k,
        max_seqlen_q,
        max_seqlen_k,
        0.0,
        softmax_scale,
        causal,
        window_size,
        softcap,
    )


def _module(name: str, **functions) -> types.ModuleType:
    module = types.ModuleType(name)
    for key, fn in functions.items():
        setattr(module, key, fn)
    return module


#: transformers' module globals that cache the flash functions it loaded (restored after each test)
_LOADED = (
    "_loaded_implementation",
    "_flash_fn",
    "_flash_varlen_fn",
    "_flash_with_kvcache_fn",
    "_pad_fn",
    "_unpad_fn",
    "_process_flash_kwargs_fn",
    "_process_with_kvcache_kwargs_fn",
)


def install(monkeypatch, implementation: str) -> None:
    """Make transformers load the stand-in for ``implementation`` ("flash_attention_2", "flash_attention_3" or a
    hub kernel name such as "kernels-community/flash-attn2"), for the length of one test."""
    import transformers.modeling_flash_attention_utils as fa
    from transformers import AttentionInterface
    from transformers.integrations import hub_kernels
    from transformers.integrations.flash_attention import flash_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    CALLS.clear()
    for name in _LOADED:
        monkeypatch.setattr(fa, name, getattr(fa, name, None), raising=False)
    fa2 = _module(
        "flash_attn",
        flash_attn_func=flash_attn_func,
        flash_attn_varlen_func=flash_attn_varlen_func,
        flash_attn_with_kvcache=flash_attn_with_kvcache,
        __version__="2.8.3",
    )
    padding = _module("flash_attn.bert_padding", pad_input=fa._pad_input, unpad_input=fa._unpad_input)
    fa3 = _module(
        "flash_attn_interface",
        flash_attn_func=_fa3_func,
        flash_attn_varlen_func=_fa3_varlen,
        flash_attn_with_kvcache=flash_attn_with_kvcache,
    )
    for module in (fa2, padding, fa3):
        monkeypatch.setitem(sys.modules, module.__name__, module)
    monkeypatch.setattr(fa, "is_flash_attn_2_available", lambda *a, **k: implementation == "flash_attention_2")
    if implementation not in ("flash_attention_2", "flash_attention_3"):  # a hub kernel: what kernels would load
        monkeypatch.setitem(AttentionInterface._global_mapping, implementation, flash_attention_forward)
        monkeypatch.setitem(AttentionMaskInterface._global_mapping, implementation, flash_attention_mask)
        monkeypatch.setattr(hub_kernels, "load_and_register_attn_kernel", lambda *a, **k: fa2)
