"""Adapter for ``torch.nn.MultiheadAttention``, alone or inside ``nn.TransformerEncoder`` / ``TransformerDecoder``.

How a call is read without changing what the caller gets:

- A forward pre-hook (with kwargs) notes the call's arguments. When the caller asked for weights
  (``need_weights=True``) it also switches ``average_attn_weights`` off: the same kernel runs, the module's
  own per-head weights are observed, and the post-hook hands the caller the head average it asked for,
  computed as torch computes it. When the caller asked for none (``need_weights=False``, as every
  ``TransformerEncoderLayer`` / ``TransformerDecoderLayer`` does), the call runs untouched on torch's
  ``scaled_dot_product_attention`` path, so its output stays bitwise the same, and the per-head weights
  are recomputed from Q and K (``weights_source="recomputed"``).
- Q, K and V are recovered from the module's own projection weights with torch's own in-projection helpers
  (packed ``in_proj_weight`` or separate ``q/k/v_proj_weight``, biases, ``bias_k``/``bias_v``,
  ``add_zero_attn``, ``kdim``/``vdim``): they are the tensors the module computed. The post-hook checks
  that ``weights @ V``, merged and projected, reproduces the module's output (``meta["output_error"]``)
  and warns when it does not.
- The per-head output is observed, not recomputed: torch applies the out-projection as
  ``F.linear(merged, out_proj.weight, out_proj.bias)`` (no module call a hook could see), so for the length
  of each call a small ``TorchDispatchMode`` keeps the input of that product, the heads' outputs merged
  as ``(query, batch, head * d_head)``, and the record's ``output`` is that tensor split per head
  (``meta["output_source"] = "observed"``; in training it is after dropout, like the module's).
  ``check()``'s ``output_match`` therefore compares ``weights @ v`` with what the module really computed.
  Where that input cannot be seen (a torch whose ``multi_head_attention_forward`` no longer multiplies by
  ``out_proj.weight``), ``output`` is ``weights @ V`` recomputed by attnprobe
  (``meta["output_source"] = "recomputed"``), which ``output_match`` cannot contradict, and None in
  training with dropout. This is also the case under
  ``torch.inference_mode()`` (there torch gives a dispatch mode whole ``linear``/``sdpa`` ops, which could run
  on other kernels, so none is installed) and under autocast (the product uses a cast copy of the weight).
  With grad or ``no_grad`` the ops run as called under the mode (the same kernels: outputs stay bitwise
  equal); each op of the call passes through Python once.
- The post-hook is registered first (``prepend=True``), so it reads the module's own ``(output, weights)``
  before any forward hook of the caller's changes it, and those hooks see what the caller asked for.
- The fused fast path (``torch._native_multi_head_attention``, ``TransformerEncoder``'s nested tensors)
  exposes no weights; it is switched off with ``torch.backends.mha.set_fastpath_enabled(False)`` while a
  capture with a selected ``MultiheadAttention`` is open, and restored on exit. Nested tensors the caller
  passes in directly can only run on the fast path: such a call runs untouched and unrecorded (warned).
"""

from __future__ import annotations

import math
import threading
from contextlib import AbstractContextManager, ExitStack, contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from ..probe.engine.attention_math import AttentionCall, attention_logits
from ..probe.errors import AttnprobeError, warn_user
from ..probe.threads import elsewhere
from .base import Adapter, Lazy, Site, selected_heads
from .calls import bind_arguments
from .deliver import deliver, held, hold_recompile, listen, number
from .masks import MASKED_AT, Recomputed, additive_bias, forbids_future
from .modes import exit_mode

#: ``nn.MultiheadAttention.forward`` parameters, in order.
_PARAMS = (
    "query",
    "key",
    "value",
    "key_padding_mask",
    "need_weights",
    "attn_mask",
    "average_attn_weights",
    "is_causal",
)
_DEFAULTS = {
    "key_padding_mask": None,
    "need_weights": True,
    "attn_mask": None,
    "average_attn_weights": True,
    "is_causal": False,
}
_AVERAGE_AT = _PARAMS.index("average_attn_weights")


_FASTPATH_LOCK = threading.Lock()
_fastpath_holders = 0  # blocks (captures) inside fastpath_disabled, in any thread, in any order
_fastpath_outside = True  # the setting before the first of them


@contextmanager
def fastpath_disabled():
    """``torch.backends.mha`` fast path off inside the block, the previous setting restored after.

    The setting is process-wide while blocks may overlap without nesting (captures in two threads, or closed
    out of order): the first block to open saves it, the last to close restores it.
    """
    global _fastpath_holders, _fastpath_outside
    with _FASTPATH_LOCK:
        if _fastpath_holders == 0:
            _fastpath_outside = torch.backends.mha.get_fastpath_enabled()
        _fastpath_holders += 1
        torch.backends.mha.set_fastpath_enabled(False)
    try:
        yield
    finally:
        with _FASTPATH_LOCK:
            _fastpath_holders -= 1
            if _fastpath_holders == 0:
                torch.backends.mha.set_fastpath_enabled(_fastpath_outside)


def _bind(args: tuple, kwargs: dict) -> dict | None:
    return bind_arguments(_PARAMS, _DEFAULTS, args, kwargs, required=3)


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """torch's mask convention (bool True = masked out, float = added) as a float mask to add."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros_like(mask, dtype=dtype).masked_fill_(mask, float("-inf"))
    return mask.to(dtype)


def _in_projection(mod: nn.MultiheadAttention, query, key, value):
    """q, k, v exactly as ``F.multi_head_attention_forward`` computes them (torch's own helpers)."""
    if mod._qkv_same_embed_dim:
        packed = getattr(F, "_in_projection_packed", None)
        if packed is not None:
            return packed(query, key, value, mod.in_proj_weight, mod.in_proj_bias)
        w = mod.in_proj_weight.chunk(3)
        b = (None,) * 3 if mod.in_proj_bias is None else mod.in_proj_bias.chunk(3)
    else:
        w = (mod.q_proj_weight, mod.k_proj_weight, mod.v_proj_weight)
        b = (None,) * 3 if mod.in_proj_bias is None else mod.in_proj_bias.chunk(3)
        separate = getattr(F, "_in_projection", None)
        if separate is not None:
            return separate(query, key, value, *w, *b)
    return F.linear(query, w[0], b[0]), F.linear(key, w[1], b[1]), F.linear(value, w[2], b[2])


@dataclass
class MHAParts:
    """One ``nn.MultiheadAttention`` call taken apart, in attnprobe's layout."""

    q: torch.Tensor  # (batch, head, query, d_head)
    k: torch.Tensor  # (batch, head, key, d_head); key includes bias_k / zero-attention slots
    v: torch.Tensor  # (batch, head, key, d_head)
    mask: torch.Tensor | None  # the float mask added to the scores, (1 or batch, 1 or head, query, key)
    scaling: float
    extra_keys: int  # keys appended by bias_k/bias_v and add_zero_attn
    causal_kernel: bool  # the call ran with sdpa's is_causal instead of its attn_mask

    @property
    def allowed(self) -> torch.Tensor:
        """``(batch, 1 or head, query, key)`` bool, True = may attend: a view where it can be (no mask, a padding
        mask), a (query x key) tensor only under a causal mask, and only when asked for (a statistics capture
        reads the mask and ``causal_kernel`` instead)."""
        B, _, L, _ = self.q.shape
        S = self.k.shape[2]
        if self.mask is None:
            allowed = torch.ones((), dtype=torch.bool, device=self.q.device).expand(B, 1, L, S)  # (B, 1, L, S)
        else:  # (B, 1 or H, L, S); the bias is split off per head
            allowed = (self.mask > MASKED_AT).expand(B, self.mask.shape[1], L, S)
        if self.causal_kernel:  # (B, 1 or H, L, S) & (L, S)
            allowed = allowed & torch.ones(L, S, dtype=torch.bool, device=self.q.device).tril()
        return allowed

    def bias_for(self, heads: tuple[int, ...]) -> torch.Tensor | None:
        """The non-masking part of the float mask (ALiBi, relative positions) for ``heads``, added to their scores.

        Made on demand, for the selected heads only: a capture that keeps no scores or weights never builds it.
        """
        if self.mask is None:
            return None
        mask = self.mask if self.mask.shape[1] == 1 else _pick(self.mask, heads)  # (1 or B, 1 or head, L, S)
        return additive_bias(mask)


def mha_parts(
    mod: nn.MultiheadAttention, query, key, value, key_padding_mask, attn_mask, is_causal: bool, need_weights: bool
) -> MHAParts:
    """Mirror ``F.multi_head_attention_forward`` up to the softmax, keeping every tensor it computes."""
    batched = query.dim() == 3
    # (B, T, E) batch first -> (T, B, E), keeping the identities the packed projection tests (q is k is v)
    if mod.batch_first and batched:
        if key is value:
            if query is key:
                query = key = value = query.transpose(1, 0)
            else:
                query, key = (x.transpose(1, 0) for x in (query, key))
                value = key
        else:
            query, key, value = (x.transpose(1, 0) for x in (query, key, value))
    if not batched:
        query, key, value = query.unsqueeze(1), key.unsqueeze(1), value.unsqueeze(1)  # (T, E) -> (T, 1, E)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)  # (S,) -> (1, S)
    L, B, _ = query.shape
    H, d = mod.num_heads, mod.head_dim

    kpm = _additive(key_padding_mask, query.dtype)  # (B, S)
    causal_kernel = bool(is_causal) and kpm is None and not need_weights  # torch drops attn_mask, sdpa is_causal
    attn = None if causal_kernel else _additive(attn_mask, query.dtype)  # (L, S) or (B*H, L, S)
    attn_2d = attn is not None and attn.dim() == 2

    q, k, v = _in_projection(mod, query, key, value)  # (T, B, E) each
    extra = 0
    if mod.bias_k is not None and mod.bias_v is not None:
        k = torch.cat([k, mod.bias_k.repeat(1, B, 1)])  # (S + 1, B, E)
        v = torch.cat([v, mod.bias_v.repeat(1, B, 1)])  # (S + 1, B, E)
        attn = None if attn is None else F.pad(attn, (0, 1))  # (..., L, S + 1)
        kpm = None if kpm is None else F.pad(kpm, (0, 1))  # (B, S + 1)
        extra += 1
    q = q.view(L, B * H, d).transpose(0, 1)  # (L, B, E) -> (B*H, L, d)
    k = k.view(k.shape[0], B * H, d).transpose(0, 1)  # (S, B, E) -> (B*H, S, d)
    v = v.view(v.shape[0], B * H, d).transpose(0, 1)  # (S, B, E) -> (B*H, S, d)
    if mod.add_zero_attn:
        zeros = torch.zeros((B * H, 1, d), dtype=k.dtype, device=k.device)  # (B*H, 1, d)
        k, v = torch.cat([k, zeros], dim=1), torch.cat([v, zeros], dim=1)  # (B*H, S + 1, d) each
        attn = None if attn is None else F.pad(attn, (0, 1))  # (..., L, S + 1)
        kpm = None if kpm is None else F.pad(kpm, (0, 1))  # (B, S + 1)
        extra += 1
    S = k.shape[1]

    mask = None
    if attn is not None:
        mask = attn.view(1, 1, L, S) if attn_2d else attn.view(B, H, L, S)  # (L, S) or (B*H, L, S) -> 4-D
    if kpm is not None:
        kpm = kpm.view(B, 1, 1, S)  # (B, S) -> (B, 1, 1, S)
        mask = kpm if mask is None else mask + kpm  # (1 or B, 1 or H, L, S)
    return MHAParts(
        q=q.view(B, H, L, d),  # (batch, head, query, d_head)
        k=k.view(B, H, S, d),  # (batch, head, key, d_head)
        v=v.view(B, H, S, d),  # (batch, head, key, d_head)
        mask=mask,
        scaling=math.sqrt(1.0 / float(d)),
        extra_keys=extra,
        causal_kernel=causal_kernel,
    )


def _caller_average(per_head: torch.Tensor, batched: bool) -> torch.Tensor:
    """The head average ``average_attn_weights=True`` returns, computed as torch computes it."""
    if batched:
        return per_head.mean(dim=1)
    return per_head.unsqueeze(0).mean(dim=1).squeeze(0)


def _pick(t: torch.Tensor, index: tuple[int, ...]) -> torch.Tensor:
    return t if index == tuple(range(t.shape[1])) else t[:, list(index)]


def _output_tolerance(dtype: torch.dtype) -> float:
    return 1e-4 if dtype in (torch.float32, torch.float64) else 2e-2


_MM = (torch.ops.aten.addmm.default, torch.ops.aten.mm.default)


class _OutProjInput(TorchDispatchMode):
    """Active for the length of one ``nn.MultiheadAttention`` call: keeps the first operand of the last matrix
    product with the module's ``out_proj.weight`` (transposed), i.e. the heads' outputs merged,
    ``(query * batch, head * d_head)``. Every op runs as called and returns its own result.

    A dispatch mode, not a function mode: ``F.multi_head_attention_forward`` handles function modes itself,
    so a function mode never sees the calls inside it; ``F.linear`` reaches aten as ``t`` + ``addmm``/``mm``.
    """

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight
        self.merged: torch.Tensor | None = None
        self.entered = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _MM and len(args) >= 2:
            mat1, mat2 = (args[1], args[2]) if func is _MM[0] else (args[0], args[1])
            w = self.weight
            try:
                same = (
                    isinstance(mat2, torch.Tensor)
                    and mat2.data_ptr() == w.data_ptr()
                    and tuple(mat2.shape) == (w.shape[1], w.shape[0])
                    and mat2.stride() == (w.stride()[1], w.stride()[0])
                )
            except Exception:  # tensors without storage (fake, functional): nothing to observe, the op runs anyway
                same = False
            if same:
                self.merged = mat1  # the out-projection is the last product with this weight
        return func(*args, **kwargs)

    def start(self) -> _OutProjInput:
        self.__enter__()
        self.entered = True
        return self

    def stop(self) -> None:
        if self.entered:
            self.entered = False
            exit_mode(self, dispatch=True)


@dataclass
class _Call:
    """One call in progress, as the pre-hook saw it."""

    bound: dict
    forced: bool  # average_attn_weights was switched off to observe the per-head weights
    watch: _OutProjInput | None = None  # the out-projection's input, seen while the call runs


@dataclass
class _Untouched:
    """A call on nested tensors: it runs on torch's fast path, unrecorded, as it would without a capture."""

    guard: AbstractContextManager | None  # torch._C.DisableTorchFunction() entered for this call (None: already off)
    fastpath: bool  # the fast-path setting to restore afterwards


@dataclass
class _Returned:
    """What one call took and gave back: the record is made from it."""

    module: nn.MultiheadAttention
    bound: dict  # the call's arguments by name (``_PARAMS``)
    attn_output: torch.Tensor  # the module's output as it returned it
    weights: torch.Tensor | None  # its per-head weights (asked for and not averaged), else None
    merged: torch.Tensor | None = None  # the out-projection's input, ``(query * batch, head * d_v)``, when seen

    @property
    def batched(self) -> bool:
        return self.bound["query"].dim() == 3

    @property
    def self_attention(self) -> bool:
        return self.bound["query"] is self.bound["key"]

    @property
    def dropout(self) -> float:
        """The dropout on the weights during this call (0.0 in eval mode)."""
        return self.module.dropout if self.module.training else 0.0

    def parts(self) -> MHAParts:
        b = self.bound
        with torch.no_grad(), torch._C.DisableTorchFunction():
            return mha_parts(
                self.module,
                b["query"],
                b["key"],
                b["value"],
                b["key_padding_mask"],
                b["attn_mask"],
                bool(b["is_causal"]),
                bool(b["need_weights"]),
            )

    def per_head_output(self, parts: MHAParts) -> torch.Tensor | None:
        """``(batch, head, query, d_v)``: what the module computed per head, from the out-projection's input."""
        B, H, L, _ = parts.q.shape
        d_v = parts.v.shape[-1]
        merged = self.merged
        if not isinstance(merged, torch.Tensor) or merged.shape != (L * B, H * d_v):
            return None
        return merged.detach().reshape(L, B, H, d_v).permute(1, 2, 0, 3)  # (L*B, H*d_v) -> (B, H, L, d_v)

    def query_padding(self) -> torch.Tensor | None:
        """``(batch, query)`` bool, True = a padded query: the key padding of a self-attention call."""
        kpm = self.bound["key_padding_mask"]
        if not self.self_attention or kpm is None:
            return None
        padding = kpm if kpm.dtype == torch.bool else kpm <= MASKED_AT  # (batch, key) or (key,)
        return padding if self.batched else padding.unsqueeze(0)  # (batch, query)

    def causal(self) -> bool:
        """``is_causal``, or an ``attn_mask`` that forbids every later key."""
        attn_mask = self.bound["attn_mask"]
        if bool(self.bound["is_causal"]):
            return True
        if attn_mask is None:
            return False
        return forbids_future(~attn_mask if attn_mask.dtype == torch.bool else attn_mask > MASKED_AT)


class _Derived:
    """Scores, weights and output of the selected heads of one call, each computed on first use (for a field the
    capture keeps, or the output a record checks against the module's).

    The first weights also measure whether they reproduce the module's output (``meta["output_error"]``).
    """

    def __init__(self, call: _Returned, parts: MHAParts, heads: tuple[int, ...], meta: dict, *, keep_scores: bool):
        self.call, self.parts, self.heads, self.meta = call, parts, heads, meta
        # weights returned by the module are after dropout; in training with dropout they are recomputed
        self.use_observed = call.weights is not None and call.dropout == 0.0
        self.recomputed = Recomputed(self._scores, self._allowed, keep_scores=keep_scores)
        self._weights: torch.Tensor | None = None
        self._output: torch.Tensor | None = None

    def _scores(self) -> torch.Tensor:
        """``(batch, head, query, key)``: the logits with the non-masking part of the float mask."""
        parts, heads = self.parts, self.heads
        # q scaled before the product, as F.multi_head_attention_forward scales it (q_scaled = q * scaling)
        q = _pick(parts.q, heads) * parts.scaling  # (batch, head, query, d_head)
        s = attention_logits(q, _pick(parts.k, heads), scaling=1.0)  # (batch, head, query, key)
        bias = parts.bias_for(heads)  # (batch or 1, 1 or head, query, key)
        # added here, out of place: the mask is in the inputs' dtype, which under autocast is not the logits' (the
        # sum then promotes, as before); attention_logits(bias=) would round the mask to the logits' dtype first
        return s if bias is None else s + bias  # (batch, head, query, key)

    def _allowed(self) -> torch.Tensor:
        allowed = self.parts.allowed  # (batch, 1 or head, query, key)
        return allowed if allowed.shape[1] == 1 else _pick(allowed, self.heads)

    def weights(self) -> torch.Tensor:
        """``(batch, head, query, key)``: the module's own when it returned them (without dropout), else
        recomputed."""
        if self._weights is None:
            parts, call = self.parts, self.call
            B, H, L, _ = parts.q.shape
            S = parts.k.shape[2]
            with torch.no_grad(), torch._C.DisableTorchFunction():
                if self.use_observed and call.weights is not None:
                    self._weights = _pick(call.weights.detach().reshape(B, H, L, S), self.heads)  # (B, head, L, S)
                else:
                    self._weights = self.recomputed.weights()  # (batch, head, query, key)
                if call.dropout == 0.0 and len(self.heads) == H:  # the weights reproduce the module's output?
                    self.meta["output_error"] = _output_error(call, self.output())
        return self._weights

    def output(self) -> torch.Tensor:
        """``(batch, head, query, d_v)``: weights @ V."""
        if self._output is None:
            w = self.weights()  # (batch, head, query, key)
            with torch.no_grad(), torch._C.DisableTorchFunction():
                self._output = w @ _pick(self.parts.v, self.heads)  # (B, h, L, S) x (B, h, S, d_v) -> (B, h, L, d_v)
        return self._output


def _output_error(call: _Returned, per_head: torch.Tensor) -> float:
    """Max |out_proj(merge(weights @ V)) - the module's output|, relative to the output's largest entry (at least 1)."""
    mod = call.module
    B, H, L, d = per_head.shape
    merged = per_head.permute(2, 0, 1, 3).reshape(L, B, H * d)  # (B, H, L, d) -> (L, B, H*d), torch's merge order
    projected = F.linear(merged, mod.out_proj.weight, mod.out_proj.bias)  # (L, B, E)
    actual = call.attn_output.detach()  # (L, B, E), (B, L, E) batch first, or (L, E) unbatched
    if not call.batched:
        actual = actual.unsqueeze(1)
    elif mod.batch_first:
        actual = actual.transpose(0, 1)  # (B, L, E) -> (L, B, E)
    scale = max(1.0, float(actual.abs().max())) if actual.numel() else 1.0
    return float((projected - actual).abs().max()) / scale if actual.numel() else 0.0


def _record(session, site: Site, call: _Returned, warned: set[str]) -> None:
    """One record of a selected module's call: q, k, v from its projections, the weights (observed or recomputed),
    the output per head (observed where the out-projection's input was seen, else weights @ V)."""
    parts = call.parts()
    B, _, L, _ = parts.q.shape
    S, d_v = parts.k.shape[2], parts.v.shape[-1]
    heads, _ = selected_heads(site)
    dropout = call.dropout
    per_head_out = call.per_head_output(parts)  # (batch, head, query, d_v) or None
    meta = {
        "module_class": type(call.module).__name__,
        "batch_first": call.module.batch_first,
        "need_weights": bool(call.bound["need_weights"]),
        "extra_keys": parts.extra_keys,
        "output_source": "observed" if per_head_out is not None else "recomputed",
    }
    derived = _Derived(call, parts, heads, meta, keep_scores=session.wants(site, "scores"))

    def lazy(fn, width: int) -> Lazy:
        return Lazy((B, len(heads), L, width), parts.q.dtype, fn)  # (batch, head, query, key or d_v)

    query_padding = call.query_padding()
    if per_head_out is not None:
        output: torch.Tensor | Lazy | None = per_head_out
    else:
        output = lazy(derived.output, d_v) if dropout == 0.0 else None
    record = session.emit(
        site,
        kind="self" if call.self_attention else "cross",
        stats=_stats(parts, heads, per_head_out) if session.wants(site, "stats") and dropout == 0.0 else None,
        q=parts.q,
        k=parts.k,
        v=parts.v,
        scores=lazy(derived.recomputed.scores, S),
        weights=lazy(derived.weights, S),
        output=output,
        allowed=None if session.stats_only else parts.allowed,
        query_padding=query_padding,
        causal=call.causal(),
        scaling=parts.scaling,
        backend="torch_mha",
        dtype=parts.q.dtype,  # the dtype the projections ran in (autocast included)
        weights_source="observed" if derived.use_observed else "recomputed",
        dropout=float(dropout),
        identified=frozenset({"q", "k", "v", "scores", "weights", "allowed"})
        | ({"output"} if per_head_out is not None or dropout == 0.0 else set())
        | ({"query_padding"} if query_padding is not None else set()),
        meta=meta,
    )
    if record is not None:
        _warn_output_error(site, meta.get("output_error"), parts.q.dtype, warned)


def _stats(parts: MHAParts, heads: tuple[int, ...], per_head_out: torch.Tensor | None) -> AttentionCall:
    """Blockwise statistics from q and k with the call's own mask: no (query x key) tensor (the module's sdpa made
    none)."""
    return AttentionCall.for_heads(
        parts.q,
        parts.k,
        parts.v,
        heads=heads,
        kv_heads=heads,
        mask=parts.mask,
        masked_at=MASKED_AT,
        causal=parts.causal_kernel,
        scaling=parts.scaling,
        output=per_head_out,
    )


def _warn_output_error(site: Site, error: float | None, dtype: torch.dtype, warned: set[str]) -> None:
    if error is None or error <= _output_tolerance(dtype) or "output" in warned:
        return
    warned.add("output")
    warn_user(
        f"nn.MultiheadAttention {site.name!r}: weights @ V from its projection weights does not reproduce "
        f"the module's output (max error {error:.3g}); its forward or parameters may have been patched, "
        "so this record's q/k/v/weights may not be what ran"
    )


def _warn_unreadable(site: Site, output, warned: set[str]) -> None:
    if "unreadable" not in warned:
        warned.add("unreadable")
        warn_user(
            f"nn.MultiheadAttention {site.name!r} returned {type(output).__name__}, not torch's (output, weights) "
            "pair; its calls are not recorded"
        )


def _let_nested_through(site: Site, warned: set[str]) -> _Untouched:
    """Nested tensors run only on torch's fast path, which exposes no weights and refuses any
    ``__torch_function__`` handler: let this one call run as if no capture were open."""
    if "nested" not in warned:
        warned.add("nested")
        warn_user(
            f"nn.MultiheadAttention {site.name!r} received nested tensors: such calls run on torch's fused fast "
            "path, unchanged and not captured; pass a padded batch with key_padding_mask to capture them"
        )
    guard = None
    if torch._C._is_torch_function_enabled():  # a capture's function mode would force the slow path
        guard = torch._C.DisableTorchFunction()
        guard.__enter__()
    untouched = _Untouched(guard, torch.backends.mha.get_fastpath_enabled())
    torch.backends.mha.set_fastpath_enabled(_fastpath_outside or untouched.fastpath)
    return untouched


class _Delivered:
    """The run-time side of the hooks on a model with compiled parts: the calls their ``deliver`` handed over (from
    the graph, or eagerly), each paired with its output and recorded."""

    def __init__(self, session, site: Site, module: nn.MultiheadAttention) -> None:
        self.session, self.site, self.module = session, site, module
        self.calls: list[dict | None] = []  # the calls whose output has not come yet
        self.warned: set[str] = set()

    def receive(self, event: str, tensors: list, numbers: list) -> None:
        if elsewhere(self.session.thread):
            return  # another thread's forward: not this capture's
        if event == "call":
            self.calls.append(self._bound(tensors, numbers))
            return
        bound = self.calls.pop() if self.calls else None
        site = self.site
        if bound is None or not site.selected:
            return
        if not tensors:
            _warn_unreadable(site, None, self.warned)
            return
        attn_output, weights = tensors
        per_head = weights if bound["need_weights"] and not bound["average_attn_weights"] else None
        _record(self.session, site, _Returned(self.module, bound, attn_output, per_head), self.warned)

    def _bound(self, tensors: list, numbers: list) -> dict | None:
        """The call's arguments by name; None for arguments the hook could not read (the module raises its own
        error)."""
        if not tensors:
            return None
        names = ("query", "key", "value", "key_padding_mask", "attn_mask")
        b = dict(zip(names, map(held, tensors) if self.site.selected else tensors))
        b.update(need_weights=bool(numbers[0]), average_attn_weights=bool(numbers[1]), is_causal=bool(numbers[2]))
        if numbers[4]:  # the identities the module's packed in-projection tests (self-attention: q is k is v)
            b["value"] = b["key"]
        if numbers[3]:
            b["key"] = b["query"]
        return b


class _EagerHooks:
    """The hooks on one selected module of a model without compiled parts: the pre-hook notes the call (and asks
    for per-head weights where the caller asked for averaged ones), the post-hook records it and hands the caller
    what it asked for."""

    def __init__(self, session, site: Site) -> None:
        self.session, self.site = session, site
        self.calls: list[_Call | _Untouched | None] = []  # one per call in progress
        self.warned: set[str] = set()
        self.owner = session.thread  # calls from other threads pass through untouched

    def attach(self, stack: ExitStack) -> None:
        module = self.site.module
        handles = [
            module.register_forward_pre_hook(self.before, with_kwargs=True),
            # first among the forward hooks: it reads (and, when it forced per-head weights, restores) the module's
            # own return value before any hook of the caller's sees or changes it
            module.register_forward_hook(self.after, with_kwargs=True, always_call=True, prepend=True),
        ]
        for h in handles:
            stack.callback(h.remove)
        stack.callback(self.unwind)

    def before(self, mod, args, kwargs):
        # compiled code this capture did not know of (a compiled wrapper it was not given): nothing here traces,
        # so the call runs untouched and unrecorded, and the capture's closing warning names capture(compiled=True)
        if elsewhere(self.owner) or torch.compiler.is_compiling():
            return None
        bound = _bind(args, kwargs)
        if bound is not None and any(getattr(bound[n], "is_nested", False) for n in _PARAMS[:3]):
            self.calls.append(_let_nested_through(self.site, self.warned))
            return None
        if bound is None:
            self.calls.append(None)
            return None
        forced = bool(bound["need_weights"]) and bool(bound["average_attn_weights"])
        # no dispatch mode under inference_mode: there torch hands a dispatch mode whole ops (linear, sdpa)
        # that may then run on other kernels; the output is recomputed instead
        session, site = self.session, self.site
        observe = (
            session.wants(site, "output") or session.wants(site, "stats")
        ) and not torch.is_inference_mode_enabled()
        watch = _OutProjInput(mod.out_proj.weight).start() if observe else None
        self.calls.append(_Call(bound, forced, watch))
        if not forced:
            return None
        if len(args) > _AVERAGE_AT:
            return args[:_AVERAGE_AT] + (False,) + args[_AVERAGE_AT + 1 :], kwargs
        return args, {**kwargs, "average_attn_weights": False}

    @staticmethod
    def undo(call: _Call | _Untouched | None) -> None:
        """Undo what the pre-hook switched for ``call`` (the dispatch mode, or the nested-tensor bypass)."""
        if isinstance(call, _Untouched):
            torch.backends.mha.set_fastpath_enabled(call.fastpath)
            if call.guard is not None:
                call.guard.__exit__(None, None, None)
        elif call is not None and call.watch is not None:
            call.watch.stop()

    def unwind(self) -> None:
        # torch runs no always-called hook for a BaseException (Ctrl-C) raised in the forward: calls left in
        # progress must not leave their dispatch mode, or torch functions disabled, behind the capture
        while self.calls:
            self.undo(self.calls.pop())

    def after(self, mod, args, kwargs, output):
        if not self.calls or elsewhere(self.owner) or torch.compiler.is_compiling():
            return None
        call = self.calls.pop()
        self.undo(call)
        if call is None or isinstance(call, _Untouched) or output is None:
            return None  # arguments we cannot read, a call on nested tensors, or the forward raised
        if not (isinstance(output, tuple) and len(output) == 2 and isinstance(output[0], torch.Tensor)):
            _warn_unreadable(self.site, output, self.warned)  # a forward hook that ran before ours changed it
            return None
        attn_output, per_head = output
        if call.forced:
            with torch._C.DisableTorchFunction():
                output = (attn_output, _caller_average(per_head, call.bound["query"].dim() == 3))
        merged = call.watch.merged if call.watch is not None else None
        returned = _Returned(mod, call.bound, attn_output, per_head if call.bound["need_weights"] else None, merged)
        try:
            _record(self.session, self.site, returned, self.warned)
        except AttnprobeError:
            raise  # the byte budget, a selection error: the user's to see
        except Exception as exc:  # never break the model's forward over a reading problem
            if "record-error" not in self.warned:
                self.warned.add("record-error")
                warn_user(
                    f"attnprobe could not read nn.MultiheadAttention {self.site.name!r} ({type(exc).__name__}: "
                    f"{exc}); the module ran unchanged, its calls are not in the capture"
                )
        return output if call.forced else None


class TorchMHAAdapter(Adapter):
    """Reads ``torch.nn.MultiheadAttention`` modules (those that keep torch's own ``forward``)."""

    name = "torch_mha"

    def find_named(self, model: nn.Module, named: list, claimed: set[int]) -> list[Site]:
        sites, skipped = [], []
        for name, m in named:
            if not isinstance(m, nn.MultiheadAttention) or id(m) in claimed:
                continue
            if type(m).forward is nn.MultiheadAttention.forward:
                sites.append(
                    Site(name, m, self, m.num_heads, m.num_heads, info={"strategy": "forward hooks + in-projection"})
                )
            else:
                skipped.append(f"{name!r} ({type(m).__name__})")
        if skipped:  # its forward may change what reaches torch's attention: the hooks could not tell
            warn_user(
                f"nn.MultiheadAttention subclass(es) overriding forward are not read: {', '.join(skipped[:5])}"
                + (f" and {len(skipped) - 5} more" if len(skipped) > 5 else "")
            )
        return sites

    def attach(self, session, model: nn.Module, sites: list[Site], stack: ExitStack) -> None:
        selected = [s for s in sites if s.selected]
        if not selected:
            return
        stack.enter_context(fastpath_disabled())
        if session.compiled:
            hold_recompile(session, stack)  # a model compiled before the capture runs these hooks too
            for site in sites:  # every module, whatever is selected: the graph compiled now serves later captures
                self._attach_traceable(session, site, stack)
            return
        for site in selected:
            _EagerHooks(session, site).attach(stack)

    def _attach_traceable(self, session, site: Site, stack: ExitStack) -> None:
        """Hooks for a model with compiled parts: inside the forward they only hand the call's tensors to
        ``deliver`` (Dynamo traces them into the graph) and change nothing; the call runs as the caller made it,
        so the weights are the module's own only when the caller asked for per-head weights, else recomputed
        from Q and K, and the per-head output is ``weights @ V`` (no dispatch mode can run in a compiled graph)."""
        module = site.module
        assert isinstance(module, nn.MultiheadAttention)  # find_named makes sites of these only
        delivered = _Delivered(session, site, module)
        stack.callback(delivered.calls.clear)

        def before(mod, args, kwargs):
            b = _bind(args, kwargs)
            if b is None:
                deliver(token, "call", [], [])
            else:
                deliver(
                    token,
                    "call",
                    [b["query"], b["key"], b["value"], b["key_padding_mask"], b["attn_mask"]],
                    [
                        number(bool(b["need_weights"])),
                        number(bool(b["average_attn_weights"])),
                        number(bool(b["is_causal"])),
                        number(b["query"] is b["key"]),
                        number(b["key"] is b["value"]),
                    ],
                )

        def after(mod, args, output):
            ok = isinstance(output, tuple) and len(output) == 2 and isinstance(output[0], torch.Tensor)
            deliver(token, "output", [output[0], output[1]] if ok else [], [])

        token = listen(module, "torch_mha", delivered.receive, stack)
        for h in (
            module.register_forward_pre_hook(before, with_kwargs=True),
            module.register_forward_hook(after, prepend=True),
        ):
            stack.callback(h.remove)
