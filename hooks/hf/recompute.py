"""The math of one Hugging Face attention call, redone from the arguments the call received.

Two mask semantics exist among the backends attnprobe wraps:

* **additive** (the model file's own eager function; sdpa when a position bias is folded into a
  float mask): ``softmax(logits + mask)`` with masked entries at ``finfo.min``. A row with no
  allowed key comes out (nearly) uniform, exactly as the backend computes it.
* **boolean** (sdpa with a bool mask or ``is_causal``): masked entries are ``-inf``; a row with no
  allowed key has weight 0 everywhere, which is what CPU sdpa returns for it.

Everything is computed in ``torch.promote_types(q.dtype, float32)`` (float32 for half precision,
float64 for float64 models, whose weights must sum to 1 within float64's tolerance) from detached
inputs, only for the selected heads, and cast to the dtype the attention ran in.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import torch

from ...probe.engine.attention_math import attention_logits, masked_logits, softmax_with_sinks
from ...probe.selection import index_heads

T = TypeVar("T")


def as_4d(mask: torch.Tensor) -> torch.Tensor:
    """A mask broadcastable to ``(batch, head, query, key)`` as a 4-D view."""
    while mask.dim() < 4:
        mask = mask.unsqueeze(0)
    return mask


def allowed_from(mask, *, batch: int, q_len: int, k_len: int, implicit_causal: bool, device) -> torch.Tensor:
    """Boolean ``(batch, 1 or head, query, key)``: True where the query may attend the key.

    ``mask`` is what the attention function received: None, a bool mask (True = attend) or a float
    additive mask where "masked" means ``<= finfo.min / 2`` (other values, e.g. Swin's relative
    bias folded into the mask, are not masking). ``implicit_causal`` is sdpa's ``is_causal`` with
    no mask, which sdpa aligns to the upper left (query i sees keys 0..i).
    """
    if mask is None:
        if implicit_causal:
            allowed = torch.ones(q_len, k_len, dtype=torch.bool, device=device).tril_()  # (query, key)
        else:
            allowed = torch.ones(1, 1, dtype=torch.bool, device=device)  # (1, 1): every key
        return allowed.view(1, 1, *allowed.shape).expand(batch, 1, q_len, k_len)  # (batch, 1, query, key)
    mask = as_4d(mask)[..., :k_len]  # (batch or 1, 1 or head, query or 1, key)
    if mask.dtype == torch.bool:
        allowed = mask
    elif mask.dtype.is_floating_point:
        allowed = mask > torch.finfo(mask.dtype).min / 2
    else:  # an integer 0/1 mask handed straight to the function
        allowed = mask != 0
    return allowed.expand(batch, allowed.shape[1], q_len, k_len)  # (batch, 1 or head, query, key)


class MaskInfo:
    """One mask as the softmax sees it, derived once and shared by every layer that receives it.

    Hugging Face builds one mask per forward and hands the same tensor to every layer, so the
    boolean ``allowed``, the float mask to add and the check for rows with no allowed key are
    computed once per forward, not once per layer.
    """

    def __init__(self, mask, allowed: torch.Tensor, *, selected: bool = False) -> None:
        self.mask, self.allowed = mask, allowed
        #: ``allowed`` (and a tensor ``mask``) hold the selected heads already, one per head (a flex mask_mod that
        #: reads the head): for_heads takes them as they are
        self.selected = selected
        self._add: dict = {}
        self._empty: tuple[torch.Tensor | None] | None = None  # (the rows with no allowed key, or None), once known

    def to_add(self, fill: float, heads, dtype: torch.dtype = torch.float32) -> torch.Tensor | None:
        """``dtype`` ``(batch or 1, 1 or head, query, key)``: 0 where allowed, ``fill`` elsewhere (None: all allowed).
        A mask that is the same for every sequence (sdpa's ``is_causal``, expanded over the batch) stays one."""
        key = (fill, dtype, heads if self.allowed.shape[1] > 1 else None)
        if key not in self._add:
            allowed = self.for_heads(heads)  # (batch, 1 or head, query, key)
            if allowed.shape[0] > 1 and allowed.stride(0) == 0:
                allowed = allowed[:1]  # (1, 1 or head, query, key): broadcasting does the rest
            if self.mask is None and bool(allowed.all()):
                self._add[key] = None
            else:  # (batch or 1, 1 or head, query, key)
                self._add[key] = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(
                    ~allowed, fill
                )
        return self._add[key]

    def float_mask(self, heads, dtype: torch.dtype, k_len: int) -> torch.Tensor:
        """A float mask (the additive one eager functions receive) for ``heads``, in ``dtype``, cut to ``k_len``
        keys: converted once per forward, not once per layer."""
        key = ("float", dtype, k_len, heads if as_4d(self.mask).shape[1] > 1 else None)
        if key not in self._add:
            t = as_4d(self.mask.detach())[..., :k_len]  # (batch or 1, 1 or head, query or 1, key)
            pick = t.shape[1] > 1 and not self.selected
            self._add[key] = (index_heads(t, heads)[0] if pick else t).to(dtype)  # heads selected
        return self._add[key]

    def float_bias(self, heads, dtype: torch.dtype, k_len: int) -> torch.Tensor | None:
        """The part of a float mask that is not masking (Swin folds a relative bias into it): the mask where it
        allows, 0 where it masks. Added to the logits, it gives the scores. None when it is 0 everywhere (a mask
        that only masks, what eager attention usually receives): the scores are then the logits themselves, with
        no (query, key) sum made per layer (at 1 x 1,024 tokens that sum cost a tenth of an eager layer)."""
        key = ("bias", dtype, k_len, heads if as_4d(self.mask).shape[1] > 1 else None)
        if key not in self._add:
            bias = self.float_mask(heads, dtype, k_len).masked_fill(~self.for_heads(heads), 0.0)  # (b, 1 or h, q, k)
            self._add[key] = bias if bool(bias.any()) else None
        return self._add[key]

    def for_heads(self, heads) -> torch.Tensor:
        """``(batch, 1 or head, query, key)``: ``allowed`` of the selected heads (one mask for all stays one)."""
        a = self.allowed
        return index_heads(a, heads)[0] if a.shape[1] > 1 and not self.selected else a

    def empty_rows(self, heads) -> torch.Tensor | None:
        """``(batch, 1 or head, query, 1)`` True for rows with no allowed key; None when there are none."""
        if self._empty is None or self.allowed.shape[1] > 1:
            empty = ~self.for_heads(heads).any(dim=-1, keepdim=True)  # (batch, 1 or head, query, 1)
            self._empty = (empty if bool(empty.any()) else None,)
        return self._empty[0]


class MaskMemo:
    """The last few masks seen in one capture, by identity."""

    def __init__(self, size: int = 4) -> None:
        self.size = size
        self._entries: list[tuple[tuple, MaskInfo]] = []
        self._derived: list[tuple[tuple, tuple, object]] = []

    def derived(self, key: tuple[tuple, tuple], build: Callable[[], T]) -> T:
        """What ``build()`` makes from the objects ``key[0]`` (the same objects, unchanged: compared by identity and
        version) and the values ``key[1]`` (compared by equality), made once for the layers that share them (flex's
        BlockMask, flash's padding mask and position ids, the permission built from them)."""
        sources, values = key
        versions = tuple(
            None if t is None or getattr(t, "is_inference", lambda: True)() else t._version for t in sources
        )
        for objects, seen, value in self._derived:
            if (
                seen == (versions, values)
                and len(objects) == len(sources)
                and all(a is b for a, b in zip(objects, sources))
            ):
                return value  # type: ignore[return-value]
        value = build()
        self._derived = [(sources, (versions, values), value)] + self._derived[: self.size - 1]
        return value

    def get(self, mask, *, batch: int, q_len: int, k_len: int, implicit_causal: bool, device) -> MaskInfo:
        if isinstance(mask, torch.Tensor) and mask.is_inference():
            # inference tensors (torch.inference_mode) keep no version counter, so an in-place change
            # between two calls could not be seen: read such a mask afresh every call
            return MaskInfo(
                mask,
                allowed_from(
                    mask, batch=batch, q_len=q_len, k_len=k_len, implicit_causal=implicit_causal, device=device
                ),
            )
        # the version counter catches a mask tensor changed in place between two calls
        key = (batch, q_len, k_len, implicit_causal, getattr(mask, "_version", None))
        for k, info in self._entries:
            if k == key and info.mask is mask:
                return info
        info = MaskInfo(
            mask,
            allowed_from(mask, batch=batch, q_len=q_len, k_len=k_len, implicit_causal=implicit_causal, device=device),
        )
        self._entries = [(key, info)] + self._entries[: self.size - 1]
        return info

    def clear(self) -> None:
        self._entries = []
        self._derived = []


class Recompute:
    """Scores and weights of the selected heads of one call, each computed at most once.

    ``scores`` are the logits the softmax sees before masking: scaled ``q @ k``, plus any position
    bias, softcapped, then what a flex ``score_mod`` does, plus the non-masking part of a float mask.
    ``weights`` follow the backend's own mask semantics (see the module docstring), including attention
    sinks. Both are new tensors (a record keeps them without another copy); ``weights`` never changes what
    ``scores`` returned.
    """

    def __init__(
        self,
        q,
        k,
        mask_info: MaskInfo,
        *,
        heads,
        kv_heads,
        scaling,
        additive,
        position_bias=None,
        softcap=None,
        sinks=None,
        score_mod=None,
        out_dtype=None,
        scores_wanted=True,
        keep_q=False,
    ):
        self.q, self.k, self.info, self.mask = q, k, mask_info, mask_info.mask
        self.heads, self.kv_heads = heads, kv_heads
        self.scaling, self.additive = scaling, additive
        self.position_bias, self.softcap, self.sinks = position_bias, softcap, sinks
        self.score_mod = score_mod  # what a flex kernel does to the softcapped logits (``AttentionCall.score_mod``)
        self.out_dtype = out_dtype or q.dtype
        self.compute_dtype = torch.promote_types(q.dtype, torch.float32)
        self._logits: torch.Tensor | None = None
        self._scores: torch.Tensor | None = None
        self._weights: torch.Tensor | None = None
        #: False when nobody will ask for ``scores``: ``weights`` may then add the mask to the logits in place
        self.scores_wanted = scores_wanted
        #: True when a record keeps q as ``kept_q()``: the very copy the product reads
        self.keep_q = keep_q
        self._inputs: tuple | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.q.shape[0], len(self.heads), self.q.shape[2], self.k.shape[2])

    def inputs(self) -> tuple[torch.Tensor, torch.Tensor]:
        """q of the selected heads and k of the kv head each reads, in the compute dtype. With ``keep_q``, q is a
        new contiguous tensor: the batched product would copy a strided view of the model's projection anyway, so
        the record's copy and the product's are one. (Not k: the product reads k transposed, and a contiguous copy
        of k hands the matrix library another layout than eager attention does: another last bit for some shapes.)"""
        if self._inputs is None:
            with torch.no_grad():
                q, fresh = index_heads(self.q.detach(), self.heads)  # (batch, head, query, d_head)
                q = q.to(self.compute_dtype)
                if self.keep_q and not fresh:
                    q = q.clone(memory_format=torch.contiguous_format)
                # (batch, head, key, d_head): the kv head each selected head reads
                k = index_heads(self.k.detach(), self.kv_heads)[0].to(self.compute_dtype)
            self._inputs = (q, k)
        return self._inputs

    def kept_q(self) -> torch.Tensor:
        """q as the record keeps it (``keep_q``): the copy the product reads."""
        return self.inputs()[0]

    def logits(self) -> torch.Tensor:
        """``(batch, head, query, key)`` in the compute dtype: scaled q @ k (+ position bias), softcapped."""
        if self._logits is None:
            with torch.no_grad():
                q, k = self.inputs()
                bias = None if self.position_bias is None else self._per_head(self.position_bias)  # (b, 1 or h, q, k)
                # (batch, head, query, d_head) x (batch, head, key, d_head) -> (batch, head, query, key)
                logits = attention_logits(q, k, scaling=self.scaling, bias=bias, softcap=self.softcap)
                if self.score_mod is not None:
                    rows = torch.arange(logits.shape[2], device=logits.device)
                    logits = self.score_mod(logits, rows, 0, logits.shape[3])  # (batch, head, query, key)
            self._logits = logits
        return self._logits

    def _per_head(self, t: torch.Tensor) -> torch.Tensor:
        t = as_4d(t.detach())[..., : self.k.shape[2]]  # (batch or 1, 1 or head, query, key)
        return index_heads(t, self.heads)[0] if t.shape[1] > 1 else t

    def allowed(self) -> torch.Tensor:
        """Where the selected heads' queries may attend, from the mask the call received."""
        return self.info.for_heads(self.heads)

    def _mask_to_add(self) -> torch.Tensor | None:
        """The float mask added to the logits before the softmax (None when nothing is added)."""
        if self.mask is not None and self.mask.dtype.is_floating_point:
            return self.info.float_mask(self.heads, self.compute_dtype, self.k.shape[2])
        # boolean semantics mask with -inf; sdpa with a position bias turns a bool or causal mask into
        # finfo.min where masked (create_position_bias_mask), which is the additive semantics
        fill = torch.finfo(self.q.dtype).min if self.additive else float("-inf")
        return self.info.to_add(fill, self.heads, self.compute_dtype)

    def scores(self) -> torch.Tensor:
        if self._scores is None:
            logits = self.logits()
            if self.mask is not None and self.mask.dtype.is_floating_point:
                # a float mask may carry more than masking (Swin folds its relative bias into it): its bias part
                # (0 where it masks) is added, a new tensor; the logits stay free for the weights
                bias = self.info.float_bias(self.heads, logits.dtype, self.k.shape[2])  # (batch, 1 or head, q, k)
                if bias is not None:
                    with torch.no_grad():
                        logits = logits + bias  # (batch, head, query, key)
            self._scores = logits
        return self._scores.to(self.out_dtype)

    def weights(self) -> torch.Tensor:
        if self._weights is None:
            with torch.no_grad():
                add = self._mask_to_add()  # (batch or 1, 1 or head, query, key)
                weights = self._softmax(add)  # (batch, head, query, key)
                if not self.additive and add is not None:
                    empty = self.info.empty_rows(self.heads)
                    if empty is not None:
                        weights.masked_fill_(empty, 0.0)  # rows with no allowed key attend nothing
            self._weights = weights
        return self._weights.to(self.out_dtype)

    def _masked_logits(self, add: torch.Tensor | None) -> torch.Tensor | None:
        """The masked logits in one op after the product (``attention_math.masked_logits``), where nothing else
        reads the logits (weights only), the mask only masks (0 and -inf: sdpa's bool or causal mask) and nothing
        else comes between the scaling and the mask; None elsewhere."""
        plain = self.position_bias is None and self.softcap is None and self.score_mod is None and self.sinks is None
        only_masks = not self.additive and not (self.mask is not None and self.mask.dtype.is_floating_point)
        if add is None or self.scores_wanted or self._logits is not None or not (plain and only_masks):
            return None
        q, k = self.inputs()
        with torch.no_grad():
            return masked_logits(q, k, add, scaling=self.scaling)  # (batch, head, query, key)

    def _softmax(self, add: torch.Tensor | None) -> torch.Tensor:
        """The weights from the logits: the mask added, then torch's softmax (with bitwise eager's logits, bitwise
        eager's weights). Not ``exp(z - lse)`` from the kernel's lse: measured on CPU (MiniLM's 8 x 12 x 128 x 128,
        two threads) the fused softmax costs 1.75 ms where the subtraction and an ``exp2`` cost 1.81 (torch's
        ``exp``: 2.54), and its weights are eager's to the bit, where the lse's are within 2e-6."""
        fused = self._masked_logits(add)  # (batch, head, query, key)
        if fused is not None:
            return torch.softmax(fused, dim=-1, out=fused)
        logits = self.logits()  # (batch, head, query, key)
        # the logits are free when no record keeps them (no scores wanted, or the scores are a tensor of their own):
        # the mask and the softmax are then written into them, and the weights are the only (query, key) tensor made
        # here. Otherwise the masked logits are the one new tensor, and the softmax is written into it. (Each op
        # gives the same numbers in place as out of place.)
        own = not self.scores_wanted or (
            self._scores is not None
            and self._scores is not logits
            # (logits + add in place keeps the logits' dtype: under autocast the product is bfloat16 and the sum must
            # stay float32, as it is out of place)
            and (add is None or torch.result_type(logits, add) == logits.dtype)
        )
        if own:
            self._logits = None
            z = logits if add is None else logits.add_(add)  # (batch, head, query, key)
        elif add is not None:
            z, own = torch.add(logits, add), True  # (batch, head, query, key)
        else:
            z = logits  # kept as the scores: the softmax makes the weights' own tensor
        if self.sinks is None:  # (batch, head, query, key)
            return torch.softmax(z, dim=-1, out=z) if own else torch.softmax(z, dim=-1)
        # attention sinks: one extra logit per head that takes probability mass and no value
        return softmax_with_sinks(z, self.sinks, self.heads)
