"""The math of one attention call, written once: logits, the model's mask, softmax (with sinks).

Every recompute in attnprobe goes through here: the adapters' full recompute of scores and weights
(``hooks/hf/recompute.py``, ``hooks/masks.py``) and the blockwise statistics engine (``probe/engine/stats.py``), so
a statistic and a full weight matrix are the same numbers, computed the same way.

``AttentionCall`` describes a call as the attention function received it (q, k, v, mask, bias,
softcapping, sinks, scaling and the mask semantics); ``AttentionCall.block(a, b, c, d)`` gives the
logits and the permission of query rows ``a:b`` against keys ``c:d`` of the selected heads, so no
caller ever needs a ``(query x key)`` tensor larger than one block.

Two mask semantics exist among the backends attnprobe wraps (``additive``):

* **boolean** (sdpa with a bool mask or ``is_causal``, hand-written ``masked_fill(-inf)``): masked
  entries are ``-inf``; a row with no allowed key has weight 0 everywhere (what CPU sdpa returns).
* **additive** (Hugging Face eager functions: ``softmax(logits + mask)`` with ``finfo.min`` where
  masked): a row with no allowed key comes out uniform (every logit rounds to ``finfo.min``), or all
  zero with attention sinks (the sink logit takes all the mass).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..selection import index_heads


def attention_logits(
    q: torch.Tensor,
    k: torch.Tensor,
    *,
    scaling: float,
    bias: torch.Tensor | None = None,
    softcap: float | None = None,
    out: torch.Tensor | None = None,
    group: int = 1,
) -> torch.Tensor:
    """``(batch, head, rows, d) x (batch, head / group, keys, d) -> (batch, head, rows, keys)``: ``q @ k^T *
    scaling``, plus ``bias`` (a position bias), softcapped (``tanh(s / cap) * cap``). A new tensor in ``q``'s dtype,
    or written into ``out`` (contiguous, of that shape: a buffer the caller reuses block after block). ``group``:
    each head of ``k`` serves that many consecutive heads of ``q`` (grouped-query attention, ``grouped_matmul``).

    Example::

        >>> attention_logits(torch.ones(1, 1, 1, 4), torch.ones(1, 1, 2, 4), scaling=0.5).tolist()
        [[[[2.0, 2.0]]]]
    """
    logits = grouped_matmul(q, k.transpose(-1, -2), group, out=out)
    if scaling != 1.0:
        logits.mul_(scaling)
    if bias is not None:
        logits.add_(bias.to(logits.dtype))
    if softcap is not None:
        logits.div_(softcap).tanh_().mul_(softcap)
    return logits


def masked_logits(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, *, scaling: float) -> torch.Tensor:
    """``q @ k^T * scaling + mask`` for a ``mask`` ``(batch or 1, 1 or head, rows, keys)`` of 0 and -inf only, in
    one op after the product: ``mask + scaling * (q @ k^T)``, written into the product. Adding 0 or -inf rounds
    nothing, so the result has the bits of the product scaled, then masked (eager attention's two ops), whether the
    op fuses the multiply and the add or not; it is one pass over the ``(rows, keys)`` tensor fewer. Float32 and
    float64 only (a half product, e.g. under autocast, takes the two ops). q ``(batch, head, rows, d)``, k ``(batch,
    head, keys, d)``.

    Example::

        >>> mask = torch.tensor([[[[0.0, float("-inf")]]]])
        >>> masked_logits(torch.ones(1, 1, 1, 4), torch.ones(1, 1, 2, 4), mask, scaling=0.5).tolist()
        [[[[2.0, -inf]]]]
    """
    logits = torch.matmul(q, k.transpose(-1, -2))  # (batch, head, rows, keys)
    if logits.dtype != mask.dtype or logits.dtype not in (torch.float32, torch.float64):
        # torch's add takes alpha in a half dtype's own precision: the two ops (the product is half under autocast)
        return logits.mul_(scaling).add_(mask)
    return torch.add(mask, logits, alpha=scaling, out=logits)


def grouped_matmul(x: torch.Tensor, y: torch.Tensor, group: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` ``(batch, head, m, n)`` times ``y`` ``(batch, head / group, n, p)``: ``(batch, head, m, p)``, head ``i``
    of ``x`` times head ``i // group`` of ``y`` (grouped-query attention: k and v as the model holds them, never
    repeated per head). The ``group`` heads of ``x`` that share a head of ``y`` go in as one matrix of ``group x m``
    rows (a copy of ``x`` only where its rows cannot be viewed so, e.g. a block of rows cut from each head).
    ``out``: contiguous ``(batch, head, m, p)``.

    Example::

        >>> x, y = torch.ones(1, 4, 2, 3), torch.arange(6.0).view(1, 2, 3, 1)  # 4 heads of x, 2 of y
        >>> grouped_matmul(x, y, 2)[0, :, 0, 0].tolist()
        [3.0, 3.0, 12.0, 12.0]
    """
    if group == 1:
        return torch.matmul(x, y) if out is None else torch.matmul(x, y, out=out)
    B, H, m, n = x.shape
    folded = x.reshape(B, H // group, group * m, n)  # (batch, head / group, group x m, n)
    if out is None:
        return torch.matmul(folded, y).view(B, H, m, y.shape[-1])
    torch.matmul(folded, y, out=out.view(B, H // group, group * m, y.shape[-1]))
    return out


def per_query_head(t: torch.Tensor, group: int) -> torch.Tensor:
    """``t`` ``(batch, kv head, ...)`` repeated for each of the ``group`` consecutive query heads that read a kv
    head: ``(batch, kv head x group, ...)`` (a copy; ``t`` itself for groups of one)."""
    return t if group == 1 else t.repeat_interleave(group, 1)


def kv_grouping(kv_heads: tuple[int, ...]) -> tuple[int, tuple[int, ...]]:
    """``(group, kv)``: the key/value head each selected head reads, ``kv_heads``, as the heads ``kv`` each repeated
    ``group`` times in a row (grouped-query attention); ``(1, kv_heads)`` where they are not of that form.

    Example::

        >>> kv_grouping((0, 0, 0, 1, 1, 1)), kv_grouping((0, 1, 0, 1))
        ((3, (0, 1)), (1, (0, 1, 0, 1)))
    """
    n = len(kv_heads)
    group = next((i for i, x in enumerate(kv_heads) if x != kv_heads[0]), n) if n else 1
    kv = kv_heads[::group] if group > 1 else kv_heads
    if group > 1 and n % group == 0 and tuple(x for x in kv for _ in range(group)) == kv_heads:
        return group, kv
    return 1, kv_heads


def softmax_with_sinks(z: torch.Tensor, sinks: torch.Tensor | None, heads=None) -> torch.Tensor:
    """Softmax over the last axis of ``z`` ``(batch, head, rows, keys)``; with ``sinks`` ``(head,)`` (or the
    model's heads, picked by ``heads``) one extra logit per head takes part and is dropped."""
    if sinks is None:
        return torch.softmax(z, dim=-1)
    b, h, rows, _ = z.shape
    sink = sinks.detach().to(z.device, z.dtype)
    if heads is not None:
        sink = sink.index_select(0, torch.tensor(heads, dtype=torch.long, device=z.device))
    z = torch.cat([z, sink.view(1, h, 1, 1).expand(b, h, rows, 1)], dim=-1)
    z = z - z.max(dim=-1, keepdim=True).values
    return torch.softmax(z, dim=-1)[..., :-1].contiguous()


def masked_softmax(scores: torch.Tensor, allowed: torch.Tensor, *, in_place: bool = False) -> torch.Tensor:
    """Softmax over keys with the entries ``allowed`` forbids at ``-inf``; a row with no allowed key is all zeros
    (what CPU sdpa returns for it). ``allowed`` broadcasts to ``scores``.

    With ``in_place`` the mask is written into ``scores``, which the caller must own and no longer need (it
    saves one (query, key) tensor per selected head, e.g. when a capture keeps the weights but not the scores).
    """
    fill = float("-inf")
    masked = scores.masked_fill_(~allowed, fill) if in_place else scores.masked_fill(~allowed, fill)
    # ``masked`` is ours either way: the softmax is written into it (the same numbers as into a new tensor)
    return torch.softmax(masked, dim=-1, out=masked).masked_fill_(~allowed.any(-1, keepdim=True), 0.0)


def mask_allows(mask: torch.Tensor, masked_at: float | None = None) -> torch.Tensor:
    """A mask as attention code hands it over -> bool, True = may attend: a bool mask as it is, a float mask
    (added to the scores) where the entry is above ``masked_at`` (default ``finfo.min / 2``), an integer 0/1
    mask where it is not 0."""
    if mask.dtype == torch.bool:
        return mask
    if mask.dtype.is_floating_point:
        return mask > (torch.finfo(mask.dtype).min / 2 if masked_at is None else masked_at)
    return mask != 0


def _as_4d(t: torch.Tensor) -> torch.Tensor:
    while t.dim() < 4:
        t = t.unsqueeze(0)
    return t


#: A mask given as a function of blocks (a FlexAttention ``mask_mod``, a varlen kernel's documents): ``fn(rows, c, d)``
#: -> bool ``(batch or 1, 1 or head, len(rows), d - c)``, True = may attend, for the query rows at positions ``rows``
#: (``(n,)`` long, among the call's queries) against keys ``c:d``, for the selected heads.
MaskBlocks = Callable[[torch.Tensor, int, int], torch.Tensor]
#: What a kernel does to the logits beyond scaling, bias and softcapping (a FlexAttention ``score_mod``):
#: ``fn(logits, rows, c, d)`` -> the logits of the same block ``(batch, head, len(rows), d - c)``.
ScoreBlocks = Callable[[torch.Tensor, torch.Tensor, int, int], torch.Tensor]


def _keys_wide(t: torch.Tensor, keys: int) -> torch.Tensor:
    """``t`` over ``keys`` keys: a mask of one key column, which the kernel broadcasts over every key (a view)."""
    return t.expand(*t.shape[:-1], keys) if t.shape[-1] == 1 and keys != 1 else t


def _rows(t: torch.Tensor, a: int, b: int, c: int, d: int) -> torch.Tensor:
    """Rows ``a:b`` and keys ``c:d`` of a 4-D tensor that may broadcast (size 1) along either axis (a view)."""
    t = t if t.shape[-2] == 1 else t[..., a:b, :]
    return t if t.shape[-1] == 1 else t[..., c:d]


@dataclass
class AttentionCall:
    """One attention call as the function received it, for the selected heads.

    ``q`` ``(batch, head, query, d)`` and ``k``/``v`` ``(batch, head / kv_group, key, d)`` are already restricted to
    the selected query heads: head ``i`` of q reads head ``i // kv_group`` of k and v (``for_heads`` keeps k and v
    as the model holds them where the selected heads read them in groups, grouped-query attention, else repeats each
    selected head's kv head beside it, ``kv_group`` 1). ``mask``: None, bool (True =
    attend), or float (added to the logits; entries at or below ``masked_at`` mask), broadcastable to
    ``(batch, 1 or head, query, key)``. ``causal``: query ``i`` may also only attend keys ``<= i + causal_offset``
    (sdpa's ``is_causal`` is upper-left aligned: offset 0). ``bias``: a position bias added to the logits.
    ``output``: what the function returned per head ``(batch, head, query, d_v)``, or None. ``lse``: each row's
    logsumexp as the model's own kernel computed it (``probe.engine.kernel_lse``), or None.
    """

    q: torch.Tensor
    k: torch.Tensor
    scaling: float
    v: torch.Tensor | None = None
    mask: torch.Tensor | MaskBlocks | None = None
    masked_at: float | None = None
    causal: bool = False
    causal_offset: int = 0
    bias: torch.Tensor | None = None
    softcap: float | None = None
    sinks: torch.Tensor | None = None
    """Sink logits of the selected heads ``(head,)``."""
    additive: bool = False
    output: torch.Tensor | None = None
    positions: torch.Tensor | None = None
    """``(query,)`` long, ascending: each q row's position among the call's queries (what ``causal`` and the
    diagonal are counted from); None = ``0 .. query - 1``. Set by ``take_rows`` for a sample of rows."""
    score_mod: ScoreBlocks | None = None
    lse: torch.Tensor | None = None
    """``(batch, head, query)`` float: each row's log-normaliser ``logsumexp(logits)`` over its allowed keys, in
    natural units, as the model's attention kernel returned it beside its output (None: not known). With it the
    statistics engine needs no pass to find each row's normaliser (see ``probe/engine/stats.py``)."""
    kv_group: int = 1
    """Heads of q that read each head of k and v, consecutive ones (1: a head of k and v for every head of q)."""

    @classmethod
    def for_heads(cls, q, k, v=None, *, heads, kv_heads, mask=None, bias=None, sinks=None, output=None, lse=None, **kw):
        """From full-head tensors: pick the selected heads (and the kv head each reads), detached. Where the selected
        heads read their kv heads in groups (``kv_grouping``), k and v keep one head per group (``kv_group``): no
        copy of the keys and values for every head (at 32 heads on 8 kv heads, four times the model's cache)."""

        def pick(t, index, axis=1):
            return None if t is None else index_heads(t.detach(), tuple(index), axis)[0]

        def per_head(t):
            if not isinstance(t, torch.Tensor):
                return t  # None, or a mask function (made for the selected heads)
            t = _as_4d(t.detach())
            return t if t.shape[1] == 1 else pick(t, heads)

        group, kv = kv_grouping(tuple(kv_heads))
        return cls(
            q=pick(q, heads),
            k=pick(k, kv),
            v=pick(v, kv),
            mask=per_head(mask),
            bias=per_head(bias),
            sinks=pick(sinks, heads, 0) if isinstance(sinks, torch.Tensor) and sinks.dim() == 1 else None,
            output=pick(output, heads),
            lse=pick(lse, heads),
            kv_group=group,
            **kw,
        )

    def ungrouped(self) -> AttentionCall:
        """The same call with k and v repeated for every head of q (``kv_group`` 1): copies, ``kv_group`` times the
        size, for readers that index k and v by q's heads."""
        if self.kv_group == 1:
            return self
        v = None if self.v is None else per_query_head(self.v, self.kv_group)
        return dataclasses.replace(self, k=per_query_head(self.k, self.kv_group), v=v, kv_group=1)

    def take_rows(self, rows: torch.Tensor) -> AttentionCall:
        """The same call for the query rows ``rows`` only (``(n,)`` long, ascending, unique): q, the mask, the bias
        and the output cut to those rows; ``positions`` remembers where they were."""
        rows = rows.to(self.q.device, torch.long)
        if rows.dim() != 1 or (rows.numel() > 1 and not bool((rows[1:] > rows[:-1]).all())):
            raise ValueError("take_rows takes ascending, unique row indices (1-D)")

        def cut(t):
            if not isinstance(t, torch.Tensor):
                return t  # None, or a mask function (it reads the rows' positions)
            t = _as_4d(t)
            return t if t.shape[-2] == 1 else t.index_select(-2, rows.to(t.device))

        positions = rows if self.positions is None else self.positions.index_select(0, rows)
        return dataclasses.replace(
            self,
            q=self.q.index_select(2, rows),
            mask=cut(self.mask),
            bias=cut(self.bias),
            output=None if self.output is None else self.output.index_select(2, rows),
            lse=None if self.lse is None else self.lse.index_select(2, rows.to(self.lse.device)),
            positions=positions,
        )

    def row_positions(self, a: int, b: int) -> torch.Tensor:
        """``(b - a,)`` long: the positions of q rows ``a:b``."""
        if self.positions is None:
            return torch.arange(a, b, device=self.q.device)
        return self.positions[a:b].to(self.q.device)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(batch, head, query, key)``."""
        return (self.q.shape[0], self.q.shape[1], self.q.shape[2], self.k.shape[2])

    @property
    def compute_dtype(self) -> torch.dtype:
        return torch.promote_types(self.q.dtype, torch.float32)

    def allowed(self, a: int, b: int, c: int, d: int) -> torch.Tensor | None:
        """``(batch or 1, 1 or head, b - a, d - c)`` bool, True = may attend; None when every key is allowed."""
        allowed = None
        if callable(self.mask):
            allowed = self.mask(self.row_positions(a, b), c, d)
        elif self.mask is not None:
            m = _rows(_as_4d(self.mask), a, b, c, d)
            allowed = _keys_wide(mask_allows(m, self.masked_at), d - c)
        if self.causal:
            rows = self.row_positions(a, b)[:, None] + self.causal_offset
            tril = torch.arange(c, d, device=self.q.device)[None, :] <= rows
            allowed = tril if allowed is None else allowed & tril
        return None if allowed is None else _as_4d(allowed)

    def forbidden(self, a: int, b: int, c: int, d: int) -> torch.Tensor | None:
        """The complement of ``allowed`` (what a softmax input is filled with ``-inf`` at), built directly."""
        forbidden = None
        if callable(self.mask):
            forbidden = ~self.mask(self.row_positions(a, b), c, d)
        elif self.mask is not None:
            forbidden = _keys_wide(~mask_allows(_rows(_as_4d(self.mask), a, b, c, d), self.masked_at), d - c)
        if self.causal:
            rows = self.row_positions(a, b)[:, None] + self.causal_offset
            later = torch.arange(c, d, device=self.q.device)[None, :] > rows
            forbidden = later if forbidden is None else forbidden | later
        return None if forbidden is None else _as_4d(forbidden)

    def logits(
        self, a: int, b: int, c: int, d: int, out: torch.Tensor | None = None, *, times: float = 1.0
    ) -> torch.Tensor:
        """``(batch, head, b - a, d - c)`` in the compute dtype: scaled ``q @ k`` plus bias, softcapped, plus the
        part of a float mask that is not masking (a relative bias folded into the mask, as Swin does), i.e.
        the logits the softmax sees at the allowed keys. ``out``: a buffer to write them into (see
        ``attention_logits``); the result may still be a new tensor (a float mask). ``times``: the logits times
        this (the statistics engine asks for ``log2(e)`` times them, for ``exp2``); with neither bias, softcapping
        nor a float mask, the factor and the scaling go into the block's ``q`` rows, not over the whole block."""
        dtype = self.compute_dtype
        q, k = self.q[:, :, a:b].to(dtype), self.k[:, :, c:d].to(dtype)
        mask = self.mask
        float_mask = mask if isinstance(mask, torch.Tensor) and mask.dtype.is_floating_point else None
        plain = self.bias is None and self.softcap is None and float_mask is None and self.score_mod is None
        group = self.kv_group
        if plain and (times != 1.0 or self.scaling != 1.0):
            return attention_logits(q * (self.scaling * times), k, scaling=1.0, out=out, group=group)
        bias = None if self.bias is None else _rows(_as_4d(self.bias), a, b, c, d)
        s = attention_logits(q, k, scaling=self.scaling, bias=bias, softcap=self.softcap, out=out, group=group)
        if self.score_mod is not None:
            s = self.score_mod(s, self.row_positions(a, b), c, d)
        if float_mask is not None:
            m = _rows(_as_4d(float_mask), a, b, c, d)
            s = torch.where(mask_allows(m, self.masked_at), s + m.to(dtype), s)
        return s if times == 1.0 else s.mul_(times)

    def key_limit(self, b: int) -> int:
        """Keys a block of rows ending at ``b`` can reach: a causal call never lets them see later keys."""
        tk = self.k.shape[2]
        if not self.causal:
            return tk
        last = b - 1 if self.positions is None else int(self.positions[b - 1])
        return max(0, min(tk, last + 1 + self.causal_offset))


def sink_logsumexp(lse: torch.Tensor, sinks: torch.Tensor | None) -> torch.Tensor:
    """``log(exp(lse) + exp(sink))`` per head: the normaliser once the sink logit takes part (``lse`` ``(batch, head,
    query)``, ``sinks`` ``(head,)``)."""
    if sinks is None:
        return lse
    return torch.logaddexp(lse, sinks.to(lse.device, lse.dtype).view(1, -1, 1))


NEG_INF = -math.inf
