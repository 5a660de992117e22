"""Floors: what a figure costs at least, written with no tool (shared by the benchmarks that print one).

A floor is a copy of the model whose attention function, registered with transformers' attention interface, runs
sdpa's own kernel (so the model's outputs stay bitwise the sdpa model's; each benchmark checks it) and then computes
inline, in the fewest torch ops, only what the figure asks for. A figure below its floor cannot be met by a tool
built on torch's ops that keeps the model's outputs bitwise.
"""

from __future__ import annotations

import copy
import math

import torch


def with_attention(model, name: str, fn):
    """A deep copy of ``model`` whose attention function is ``fn``, registered as ``name`` with sdpa's mask
    function (so it receives the masks sdpa would)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, sdpa_mask)
    copied = copy.deepcopy(model)
    copied.set_attn_implementation(name)
    return copied


def run(model, fn, **inputs) -> list:
    """One call of a floor ``model`` whose attention function is ``fn``: what ``fn`` kept during it, one entry per
    attention call. The list is handed over (``fn.kept`` is empty again), so the caller drops it, as a capture's
    records are dropped."""
    fn.kept.clear()
    model(**inputs)
    kept = list(fn.kept)
    fn.kept.clear()
    return kept


def weights_floor(*, six: bool = False):
    """An attention function: sdpa's own kernel, then the weights in the fewest torch ops: one ``q @ k`` with the
    scaling folded into q, sdpa's mask (bool, or causal when it gets none and the module is causal) added in place
    from a tensor made once per shape, a softmax written into the same buffer. With ``six``, q, k, v and the output
    are kept as views and the scores as a tensor of their own. Each call appends to ``fn.kept`` (the weights, or the
    six with the weights fifth). Written for models without a position bias or grouped heads."""
    from attnprobe.hooks.hf import compat as hf_compat

    sdpa_forward = hf_compat.sdpa_forward()
    causal_masks = {}  # made once per shape, not per layer

    def additive(causal: bool, attention_mask, q_len: int, k_len: int, like: torch.Tensor):
        if attention_mask is not None:  # bool, True = attend
            return torch.zeros(attention_mask.shape, dtype=like.dtype, device=like.device).masked_fill_(
                ~attention_mask, float("-inf")
            )
        if not causal or q_len == 1:
            return None
        key = (q_len, k_len, like.device, like.dtype)
        if key not in causal_masks:
            causal_masks[key] = torch.full((q_len, k_len), float("-inf"), dtype=like.dtype, device=like.device).triu_(1)
        return causal_masks[key]

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        out = sdpa_forward(module, query, key, value, attention_mask, *args, **kwargs)
        with torch.no_grad():
            scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
            scores = torch.matmul(query * scaling, key.transpose(-1, -2))
            # sdpa's own rule: the call's is_causal, else the module's (default True), with no mask
            causal = kwargs.get("is_causal")
            causal = getattr(module, "is_causal", True) if causal is None else causal
            mask = additive(causal, attention_mask, scores.shape[-2], scores.shape[-1], scores)
            if six:  # the scores are kept: the masked logits are the weights' own tensor
                weights = scores.clone() if mask is None else torch.add(scores, mask)
                attention.kept.append((query.detach(), key.detach(), value.detach(), scores, weights, out[0].detach()))
            else:
                weights = scores if mask is None else scores.add_(mask)
                attention.kept.append(weights)
            torch.softmax(weights, dim=-1, out=weights)
        return out

    attention.kept = []
    return attention


def lse_weights_floor():
    """An attention function: sdpa's CPU flash kernel called for its logsumexp too (the kernel sdpa itself runs on
    these calls; each benchmark checks the outputs bitwise), then the weights as the lse allows, in the fewest torch
    ops: ``2^(log2(e) * (q @ k * scaling - lse))`` from one batched product (the scaling and the lse in its
    epilogue), the mask added, one ``exp2``. The least a weights-only capture that keeps sdpa's kernel can run.
    Each call appends the weights to ``fn.kept``. CPU only; written for models without a position bias or grouped
    heads."""
    from attnprobe.hooks.hf import compat as hf_compat

    sdpa_forward, log2e = hf_compat.sdpa_forward(), math.log2(math.e)
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu

    def kernel(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, **kwargs):
        # sdpa's own conversion of a bool mask for its fused kernels: 0 where True, -inf where False
        mask = (
            None
            if attn_mask is None
            else torch.full_like(attn_mask, -math.inf, dtype=q.dtype).masked_fill_(attn_mask, 0.0)
        )
        out, lse = flash(q, k, v, dropout_p, is_causal, attn_mask=mask, scale=scale)
        b, h, n, d = q.shape
        scaling = scale if scale is not None else d**-0.5
        with torch.no_grad():
            weights = q.new_empty(b, h, n, k.shape[2])  # (batch, head, query, key), base 2 until the exp2
            shift = lse.mul(-log2e).reshape(b * h, n, 1)
            kt = k.reshape(b * h, k.shape[2], d).transpose(1, 2)
            torch.baddbmm(shift, q.reshape(b * h, n, d), kt, alpha=scaling * log2e, out=weights.view(b * h, n, -1))
            if mask is not None:
                weights.add_(mask)
            elif is_causal:
                weights.add_(torch.full((n, k.shape[2]), -math.inf).triu_(1))
            attention.kept.append(weights.exp2_())
        return out

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        real = torch.nn.functional.scaled_dot_product_attention
        torch.nn.functional.scaled_dot_product_attention = kernel
        try:
            return sdpa_forward(module, query, key, value, attention_mask, *args, **kwargs)
        finally:
            torch.nn.functional.scaled_dot_product_attention = real

    attention.kept = []
    return attention


def stats_floor():
    """An attention function: sdpa's own kernel, then the least that five of the statistics take on torch's ops
    (entropy, max_weight, row_sum_error, max_score, output_error): the scaled ``q @ k`` in base 2 (the scaling folded
    into q), its row max, one ``exp2``, the row sums, the entropy's sum, ``e @ v`` and its largest difference from
    the observed output. Each call appends ``(max in base 2, row sums, entropy, output error)`` to ``fn.kept``."""
    from attnprobe.hooks.hf import compat as hf_compat

    sdpa_forward, log2e = hf_compat.sdpa_forward(), math.log2(math.e)

    def attention(module, query, key, value, attention_mask, *args, **kwargs):
        out = sdpa_forward(module, query, key, value, attention_mask, *args, **kwargs)
        with torch.no_grad():
            scaling = (kwargs.get("scaling") or query.shape[-1] ** -0.5) * log2e
            x = torch.matmul(query * scaling, key.transpose(-1, -2))  # base-2 logits, the scaling folded into q
            if attention_mask is not None:  # bool, True = attend (sdpa's mask); finfo.min: exp2 gives 0 there
                x.masked_fill_(~attention_mask, torch.finfo(x.dtype).min)
            m = x.amax(-1, keepdim=True)
            x.sub_(m)
            e = torch.exp2(x)
            total = e.sum(-1, keepdim=True)
            entropy = total.log() - x.mul_(e).sum(-1, keepdim=True).mul_(math.log(2)).div_(total)
            error = torch.matmul(e, value).div_(total).sub_(out[0].transpose(1, 2)).abs_().amax(-1)
            attention.kept.append((m, total, entropy, error))
        return out

    attention.kept = []
    return attention
