"""Adapter for Hugging Face ``transformers`` 5.x: the attention function the model already uses, wrapped in place.

Interface-based attention modules ask ``ALL_ATTENTION_FUNCTIONS`` for the function named by
``config._attn_implementation`` (the model file's own eager function by default). While a capture is open that
function is wrapped where the dispatch finds it, under its own name (``hooks/hf/dispatch.py``): the wrapper calls
it with the very arguments, returns its result untouched, and hands what the call received to the recorder of the
module, if a capture reads that module. No config and no name changes, so model code that branches on
``config._attn_implementation`` takes the path it takes without attnprobe. Modules not selected, other models on
the same function and other threads' calls pass through unrecorded; the last capture to close puts the function
back, also when the forward raises.

What the function computes, attnprobe recomputes with that function's own semantics: sdpa's (bool or float
masks, ``is_causal`` aligned to the upper left), the model file's eager function (additive float masks; its own
weights are recorded as they are), flex attention (the ``BlockMask`` as the kernel applies it, softcap and the
bias its ``score_mod`` adds) and flash attention (documents from the padding mask, ``cu_seq_lens`` or packed
``position_ids``, causal to the lower right, sliding window, softcap, grouped-query heads): see
``hooks/hf/kernels.py``. Models without the attention interface use ``hf_fallback``.
"""

from __future__ import annotations

import sys
import weakref
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import nn

from ...probe.engine.attention_math import AttentionCall
from ...probe.errors import UnsupportedModelError, warn_user
from ...probe.selection import index_heads, kv_of_heads
from ...probe.threads import elsewhere
from ..base import Adapter, Lazy, Site, selected_heads
from ..deliver import held, listen, value_of
from ..masks import compress_heads
from ..sdpa_lse import want_lse
from . import compat as hf_compat
from . import dispatch as hf_dispatch
from . import kernels
from .context import KindProbe, Surroundings, call_kind, head_counts, parents_of, static_kind
from .dispatch import NUMBER_ARGS, TENSOR_ARGS, Dispatch, class_info
from .expects import Projections, config_expects, inputs_expects, scale_expects, text_decoder_expects
from .recompute import MaskInfo, MaskMemo, Recompute
from .source import record_dtype, softmax_dtype

_STRATEGY = "attention interface"
_WARNED: set = set()
#: Verdicts of ``_Recorder._scores_trusted``, kept across captures: module -> {(function, argument names, mask dtype,
#: weights dtype, heads, the module's plain attributes): verdict}. A function's math for one such key does not change
#: between captures, and judging it costs a softmax and four passes over (query x key) per layer (at 1 x 1,024
#: tokens, two thirds of what the eager forward itself costs), so a module is judged once per process, not once per
#: capture. Its plain attributes (numbers, flags, strings: the scaling, ``is_causal``, ``training``, GPT-2's scaling
#: switches) are part of the key, so a function whose math follows one of them is judged again when it changes.
_VERDICTS: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


def mask_style(name: str, kernel: str) -> str:
    """How masks reach the function registered as ``name``.

    "eager": float, additive (``eager_mask``); "sdpa": bool, or None with ``is_causal`` (``sdpa_mask``);
    "flex": a ``BlockMask`` (or a float mask added to the scores); "flash": a 2-D padding mask or None;
    "none": no mask function is registered for ``name``, so transformers hands it no mask at all;
    "custom": the user's own mask function, whose result is read on each call if it is a 4-D tensor.
    Raises for a function attnprobe does not know that gets masks it cannot read (flash's 2-D padding mask,
    flex's BlockMask: their meaning is the kernel's).
    """
    if kernel in ("sdpa", "eager", "flex", "flash"):
        return kernel
    fn = hf_compat.mask_registry().get(name)
    if fn is None:
        return "none"
    eager_mask, sdpa_mask, unreadable = hf_compat.mask_functions()
    if fn is eager_mask:
        return "eager"
    if fn is sdpa_mask:
        return "sdpa"
    if fn in unreadable:
        raise UnsupportedModelError(
            f"the attention function registered as {name!r} gets its masks from {fn.__name__}, which builds no "
            "(query, key) mask attnprobe can read (a 2-D padding mask or a flex BlockMask) for a function whose "
            f"math it does not know. Register the function with sdpa_mask or eager_mask "
            f"(AttentionMaskInterface.register({name!r}, sdpa_mask)), or capture with attn_implementation='sdpa'"
        )
    return "custom"


def _check_mask(mask, name: str, *, batch: int, heads: int, q_len: int, k_len: int) -> None:
    """Refuse, by name, a mask from a user's own mask function that is not a (query, key) mask."""
    if mask is None:
        return
    readable = (
        isinstance(mask, torch.Tensor)
        and mask.dim() == 4
        and mask.shape[0] in (1, batch)
        and mask.shape[1] in (1, heads)
        and mask.shape[2] in (1, q_len)
        and mask.shape[3] >= k_len
        and (mask.dtype == torch.bool or mask.dtype.is_floating_point)
    )
    if not readable:
        fn = hf_compat.mask_registry().get(name)
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else None
        raise UnsupportedModelError(
            f"the mask function registered for {name!r} ({getattr(fn, '__qualname__', fn)!r}) handed the attention "
            f"function a {type(mask).__name__}{'' if shape is None else f' of shape {shape}'}; attnprobe reads "
            f"4-D (batch, 1 or head={heads}, query={q_len}, key>={k_len}) bool or float masks only. Register "
            "the function with sdpa_mask or eager_mask, or capture with attn_implementation='sdpa'"
        )


# --------------------------------------------------------------------------------- recording
@dataclass
class _Call:
    """One attention call as ``dispatch.call_payload`` delivered it."""

    q: torch.Tensor  # (batch, head, query, d_head), after RoPE
    k: torch.Tensor  # (batch, kv_head, key, d_head)
    v: torch.Tensor
    mask: (
        object  # what the function received: None, a 4-D bool or float tensor, a 2-D padding mask (flash), a BlockMask
    )
    out: torch.Tensor | None  # the function's output, (batch, query, head, d_head)
    weights: torch.Tensor | None  # its second result: the weights (eager), flex's logsumexp on GPUs, or None
    kwargs: dict  # the keyword arguments the record reads, those that were given
    mask_hidden: bool  # the mask was an object a compiled graph could not hand over (a flex BlockMask)
    lse: torch.Tensor | None = None  # (batch, head, query): each row's logsumexp from sdpa's own kernel, if read

    @classmethod
    def read(cls, tensors: list, numbers: list) -> _Call:
        q, k, v, mask, out, weights, *extra, lse = tensors
        given, hidden = int(numbers[-2]), bool(value_of(numbers[-1]))
        names = NUMBER_ARGS + TENSOR_ARGS
        values = [value_of(x) for x in numbers[: len(NUMBER_ARGS)]] + extra
        kwargs = {name: value for i, (name, value) in enumerate(zip(names, values)) if given >> i & 1}
        if "is_causal" in kwargs:
            kwargs["is_causal"] = bool(kwargs["is_causal"])
        return cls(q, k, v, mask, out, weights, kwargs, hidden, lse)

    @property
    def mask_tensor(self) -> torch.Tensor | None:
        """The mask as a tensor (None: no mask). Only tensors come this far: the built-in functions hand over tensors
        (flex's BlockMask and flash's padding mask are read by ``hooks/hf/kernels.py``) and ``_check_mask`` refuses
        any other object a custom mask function makes."""
        mask = self.mask
        if mask is None or isinstance(mask, torch.Tensor):
            return mask
        raise UnsupportedModelError(
            f"an attention function received a {type(mask).__name__} as its mask; attnprobe reads 4-D (batch, "
            "1 or head, query, key) bool or float masks only"
        )

    def per_head_output(self) -> torch.Tensor | None:
        """``(batch, head, query, d_head)``: the function's output ``(batch, query, head, d_head)`` with its axes
        in the record's order; None when it is not laid out so."""
        out = self.out
        if out is not None and out.dim() == 4 and tuple(out.shape[:3]) == (self.batch, self.q_len, self.heads):
            return out.transpose(1, 2)  # (batch, query, head, d_head) -> (batch, head, query, d_head)
        return None

    @property
    def batch(self) -> int:
        return self.q.shape[0]

    @property
    def heads(self) -> int:
        return self.q.shape[1]

    @property
    def q_len(self) -> int:
        return self.q.shape[2]

    @property
    def kv_heads(self) -> int:
        return self.k.shape[1]

    @property
    def k_len(self) -> int:
        return self.k.shape[2]


@dataclass(frozen=True)
class _Semantics:
    scaling: float
    is_causal: bool | None
    dropout: float
    position_bias: torch.Tensor | None
    softcap: float | None
    sinks: torch.Tensor | None
    sliding_window: int | None
    score_mod: kernels.ScoreBlocks | None = None  # flex: what its score_mod adds after the softcap


@dataclass(frozen=True)
class _Where:
    kind: str  # "self" or "cross"
    step: int | None
    offset: int
    query_padding: torch.Tensor | None


@dataclass(frozen=True)
class _KernelMask:
    """A flex or flash call's permission as a function of blocks, and the same whole for records that keep weights."""

    blocks: kernels.MaskBlocks
    info: MaskInfo | None  # None for a statistics capture (no (query x key) tensor)


class _Recorder:
    """Turns the calls of one selected module into records for one capture session."""

    def __init__(
        self, session, site: Site, route: Dispatch, surroundings: Surroundings, masks: MaskMemo, stack: ExitStack
    ) -> None:
        module = site.module
        self.masks = masks
        self.session, self.site, self.route = session, site, route
        self.base, self.kernel = route.name, route.kernel
        self.module = module
        self.state = surroundings.stack_of(module)
        kind = static_kind(module)
        self.kind_probe = None if kind is not None else KindProbe(module, stack)
        self.kind = kind
        self.style = mask_style(route.name, route.kernel)
        # Weights are recomputed from what the call received with the math of the function's kind. For a custom
        # function (or an overridden "sdpa") that is what the arguments ask for, not necessarily what the function
        # did: the output it returned is recorded as it is, so `output_match` tells.
        self._fn = route.function  # the verdicts of _scores_trusted are keyed by function
        meta = {
            "module_class": type(module).__name__,
            "layer_idx": getattr(module, "layer_idx", None),
            "base": route.name,
        }
        if route.kernel == "custom" or (route.kernel == "sdpa" and route.function is not hf_compat.sdpa_forward()):
            meta["base_function"] = getattr(route.function, "__qualname__", repr(route.function))
        part = surroundings.part_of(module)
        if part is not None:
            meta["stack"] = part
        self.meta = meta
        # what the config and the model's structure declare (record.meta["expects"])
        self.expects = {**config_expects(module, part), **text_decoder_expects(self.state, part)}
        self.projections = None if session.compiled else Projections(module, stack)  # q and k before the kernel
        # many eager functions run their softmax in float32 whatever the model's dtype: the weights of a
        # float64 model are then only float32-accurate, and the record says so (checks use its dtype)
        self.softmax_dtype = softmax_dtype(route.function) if route.kernel == "eager" else None
        self._kv_of_heads: tuple[int, ...] | None = None

    # -- helpers --------------------------------------------------------------------------
    def _sync_heads(self, heads: int, kv_heads: int) -> None:
        site = self.site
        if site.num_heads != heads or site.num_kv_heads != kv_heads:
            site.num_heads, site.num_kv_heads = heads, kv_heads
            self.session.select_site(site)
            self._kv_of_heads = None

    # -- one call, in steps ---------------------------------------------------------------
    def receive(self, event: str, tensors: list, numbers: list) -> None:
        """One call of the module, as the attention wrapper delivered it (``dispatch.call_payload``); runs outside any
        compiled graph: after the graph's forward, with the tensors it computed, when the model is compiled."""
        if not self.site.selected or elsewhere(self.session.thread):
            return  # another thread's forward: its call is not this capture's
        call = _Call.read(tensors, numbers)
        self._sync_heads(call.heads, call.kv_heads)
        semantics = self._semantics(call)
        readable = self._readable(call)
        kernel_mask = self._kernel_mask(call, semantics) if readable else None
        mask_info = self._mask_info(call, semantics, kernel_mask) if readable else None
        where = self._position(call)
        observed = self._observed(call, semantics)
        values, identified, weights_source = self._tensors(call, semantics, mask_info, kernel_mask, observed)
        if where.query_padding is not None:
            identified.add("query_padding")
        dtype = record_dtype(call.q.dtype, self.softmax_dtype)
        allowed = None if mask_info is None else mask_info.allowed
        causal, causal_source = self._record_causal(call, semantics, where)
        meta = self._meta(call, semantics, where, dtype)
        if causal_source is not None:
            meta = {**meta, "causal_source": causal_source}
        self.session.emit(
            self.site,
            kind=where.kind,
            **{"q": call.q, "k": call.k, "v": call.v, **values},  # q may be Lazy (``_q_shared``)
            allowed=allowed,
            preselected=("allowed",) if mask_info is not None and mask_info.selected else (),
            query_padding=where.query_padding,
            causal=causal,
            scaling=semantics.scaling,
            backend=self.base,
            dtype=dtype,
            weights_source=weights_source,
            dropout=semantics.dropout,
            step=where.step,
            query_offset=where.offset,
            sinks=semantics.sinks,
            softcap=None if semantics.softcap is None else float(semantics.softcap),
            sliding_window=semantics.sliding_window,
            identified=frozenset(identified),
            meta=meta,
        )

    def _semantics(self, call: _Call) -> _Semantics:
        """What the function was asked to compute: scaling, causality, dropout, bias, softcap, sinks, window."""
        module, kwargs, kernel = self.module, call.kwargs, self.kernel
        scaling = kwargs.get("scaling")
        is_causal = kwargs.get("is_causal")
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True if self.style != "eager" else None)
        dropout = float(kwargs.get("dropout") or 0.0)
        if kernel == "eager" and not module.training:
            dropout = 0.0
        sliding = kwargs.get("sliding_window")
        bias, softcap = kwargs.get("position_bias"), kwargs.get("softcap")
        score_mod = None
        if kernel == "flex":  # its score_mod adds the float mask and the bias after the softcap
            score_mod, bias = self._flex_scores(call, bias), None
        return _Semantics(
            scaling=float(call.q.shape[-1] ** -0.5 if scaling is None else scaling),
            is_causal=is_causal,
            dropout=dropout,
            position_bias=bias,
            softcap=softcap,
            sinks=self._sinks(kwargs),
            sliding_window=int(sliding) if sliding is not None and float(sliding).is_integer() else None,
            score_mod=score_mod,
        )

    def _record_causal(self, call: _Call, semantics: _Semantics, where: _Where) -> tuple[bool | None, str | None]:
        """What the record says about causality, and from what where it is not the module's own word (``None``: its
        ``is_causal``, or the call's). A module that sets no ``is_causal`` is causal to transformers' sdpa only when
        no mask is given: the mask decides otherwise (a BERT-style encoder's padding mask, Mllama's vision layers),
        and flex never reads it. Such a record says causal where sdpa ran it so, or where its stack runs with a
        key/value cache (a decoder, as the default means); else nothing (``None``: declare ``causal=``). Only the
        kernels that read the default reach the cache reading: eager and old-style modules that set nothing say
        nothing (a cache is no proof: GIT's prefix of image tokens is cached and bidirectional)."""
        if call.kwargs.get("is_causal") is not None or hasattr(self.module, "is_causal"):
            return (None if semantics.is_causal is None else bool(semantics.is_causal)), None
        if not semantics.is_causal:  # eager: no default
            return None, None
        cls = type(self.module).__name__
        if self._implicit_causal(call, semantics):
            return True, f"{cls} sets no is_causal and got no mask: sdpa ran it causally"
        if where.kind == "self" and self.state is not None and self.state.caches:
            return True, f"{cls} sets no is_causal (transformers' default: causal) and its stack runs with a cache"
        return None, None

    def _sinks(self, kwargs: dict) -> torch.Tensor | None:
        """The sink logits the function takes into its softmax: sdpa ignores ``s_aux``; a flash kernel takes it only
        where its functions have a parameter for it (transformers drops it for the others)."""
        if self.kernel == "sdpa" or (self.kernel == "flash" and not hf_compat.flash_takes_sinks()):
            return None
        return kwargs.get("s_aux")

    def _flex_scores(self, call: _Call, bias: torch.Tensor | None) -> kernels.FlexScores | None:
        """The bias transformers' flex function adds to the softcapped logits (T5's position bias), for the selected
        heads. (A float mask it adds too is read as every float mask is: ``_mask``.)"""
        if bias is None:
            return None
        heads, _ = selected_heads(self.site)
        bias = bias.detach()[..., : call.k_len]  # (batch or 1, head or 1, query, key)
        return kernels.FlexScores(index_heads(bias, heads)[0] if bias.shape[1] > 1 else bias)

    def _readable(self, call: _Call) -> bool:
        """False when the call's mask stayed inside a compiled graph (a flex BlockMask): said once per module."""
        if not call.mask_hidden:
            return True
        _warn_once(
            ("hidden-mask", self.module),
            f"{self.site.name!r} ({type(self.module).__name__}) runs flex attention inside a torch.compile'd graph, "
            "which keeps the BlockMask's mask_mod to itself: its records hold q, k, v and the output, but no mask, "
            "scores, weights or statistics. Capture the model before compiling it (or `compiled._orig_mod`) for them",
        )
        return False

    def _kernel_mask(self, call: _Call, semantics: _Semantics) -> _KernelMask | None:
        """A flex BlockMask's or a flash call's permission (None for every other mask)."""
        if self.kernel == "flex":
            block_mask_class = hf_compat.block_mask_class()
            if block_mask_class is None or not isinstance(call.mask, block_mask_class):
                return None
            heads, _ = selected_heads(self.site)
            key = ((call.mask,), (heads, call.batch, call.q_len, call.k_len))
            blocks: kernels.MaskBlocks = self.masks.derived(
                key,
                lambda: kernels.FlexMask(call.mask, batch=call.batch, heads=heads, q_len=call.q_len, k_len=call.k_len),
            )
        elif self.kernel == "flash":
            flash = self._flash_call(call, semantics)
            blocks = self.masks.derived(
                (
                    (flash.padding, flash.position_ids, flash.cu_q, flash.cu_k),
                    (flash.q_len, flash.k_len, flash.batch, flash.causal, flash.sliding_window, flash.top_left),
                ),
                lambda: kernels.flash_documents(flash),
            )
        else:
            return None
        if self.session.stats_only:
            return _KernelMask(blocks, None)
        return _KernelMask(blocks, self.masks.derived(((blocks,), ()), lambda: _dense_info(blocks, call)))

    def _flash_call(self, call: _Call, semantics: _Semantics) -> kernels.FlashCall:
        kwargs, mask = call.kwargs, call.mask_tensor
        return kernels.FlashCall(
            batch=call.batch,
            q_len=call.q_len,
            k_len=call.k_len,
            padding=None if mask is None else mask.detach(),
            position_ids=kwargs.get("position_ids"),
            cu_q=kwargs.get("cu_seq_lens_q"),
            cu_k=kwargs.get("cu_seq_lens_k"),
            causal=bool(semantics.is_causal),
            sliding_window=semantics.sliding_window,
            top_left=hf_compat.flash_top_left(),
            device=call.q.device,
        )

    def _mask_info(self, call: _Call, semantics: _Semantics, kernel_mask: _KernelMask | None):
        """The mask as the softmax saw it (shared by the layers that received the same mask); None for a statistics
        capture, which reads the mask block by block, never whole."""
        if kernel_mask is not None:
            return kernel_mask.info
        mask, q_len = call.mask, call.q_len
        if self.style == "custom":
            _check_mask(mask, self.base, batch=call.batch, heads=call.heads, q_len=q_len, k_len=call.k_len)
        if self.session.stats_only:
            return None
        implicit_causal = self._implicit_causal(call, semantics)
        return self.masks.get(
            self._mask(call),
            batch=call.batch,
            q_len=q_len,
            k_len=call.k_len,
            implicit_causal=implicit_causal,
            device=call.q.device,
        )

    def _mask(self, call: _Call) -> torch.Tensor | None:
        """The mask tensor the softmax sees: flex adds its float mask's head 0 to the scores of every head."""
        mask = call.mask_tensor
        return mask[:, :1] if self.kernel == "flex" and mask is not None and mask.dim() == 4 else mask

    def _implicit_causal(self, call: _Call, semantics: _Semantics) -> bool:
        """sdpa's is_causal with no mask (aligned to the upper left)."""
        return (
            self.style in ("sdpa", "custom", "none")
            and bool(semantics.is_causal)
            and call.mask is None
            and (call.q_len > 1)
        )

    def _position(self, call: _Call) -> _Where:
        """Where the call sits: self or cross, generation step, position of the first query, padded query rows."""
        state = self.state
        kind = call_kind(self.kind, self.kind_probe)
        step = state.step if state is not None else None
        offset = state.position if state is not None else 0
        query_padding = state.query_padding(call.batch, call.q_len) if state is not None else None
        if offset is None:  # a cache that cannot say its length: the keys before the queries are cached ones
            offset = max(call.k_len - call.q_len, 0) if kind == "self" else 0
        return _Where(kind, step, offset, query_padding)

    def _observed(self, call: _Call, semantics: _Semantics):
        """The weights the function returned, when they are the softmax's (eager or a custom function's, not sdpa's
        None, flex's logsumexp or weights after dropout)."""
        observed = call.weights
        if (
            self.kernel in ("eager", "custom")
            and semantics.dropout == 0.0
            and observed is not None
            and tuple(observed.shape) == (call.batch, call.heads, call.q_len, call.k_len)
        ):
            return observed
        return None

    def _tensors(
        self, call: _Call, semantics: _Semantics, mask_info, kernel_mask: _KernelMask | None, observed
    ) -> tuple[dict, set, str]:
        """The record's scores / weights / output (recomputed lazily where not observed), what was identified,
        and where the weights come from."""
        site, wants = self.site, self.session.wants
        values: dict = {}
        recomputable = not call.mask_hidden  # the mask is needed to redo the math
        if recomputable and (wants(site, "scores") or (wants(site, "weights") and observed is None)):
            values.update(self._recomputed(call, semantics, mask_info, observed))
        output = call.per_head_output()  # (batch, head, query, d_head)
        if recomputable and wants(site, "stats"):
            values["stats"] = self._statistics(call, semantics, kernel_mask, output)
        if observed is not None:
            values["weights"] = self._observed_weights(observed, call)
            weights_source = "observed"
        else:  # recomputed, kept or not; none when the call's mask could not be read
            weights_source = "recomputed" if recomputable else "none"
        identified = {"q", "k", "v"} | ({"allowed"} if recomputable else set())
        identified |= {"scores"} if "scores" in values else set()
        if weights_source != "none":
            identified.add("weights")
        if output is not None:
            values["output"] = output
            identified.add("output")
        return values, identified, weights_source

    def _recomputed(self, call: _Call, semantics: _Semantics, mask_info, observed) -> dict:
        """Lazy recomputed tensors: q (where the record keeps the very copy the product reads), the scores (where
        attnprobe's formula is what the backend computed) and the weights (where the function returned none)."""
        site, wants, q = self.site, self.session.wants, call.q
        heads, _ = selected_heads(site)
        keep_q = self._q_shared(call)
        rec = Recompute(
            q,
            call.k,
            mask_info,
            heads=heads,
            kv_heads=self._kv_heads(call),
            scaling=semantics.scaling,
            additive=self._additive(call, semantics),
            position_bias=semantics.position_bias,
            softcap=semantics.softcap,
            sinks=semantics.sinks,
            score_mod=semantics.score_mod,
            scores_wanted=wants(site, "scores"),
            keep_q=keep_q,
        )
        values: dict = {}
        if keep_q:  # (batch, head, query, d_head)
            values["q"] = Lazy((call.batch, len(heads), call.q_len, q.shape[-1]), q.dtype, rec.kept_q)
        if self._scores_trusted(rec, observed, call.kwargs):
            values["scores"] = Lazy(rec.shape, q.dtype, rec.scores)  # (batch, head, query, key)
        if observed is None:
            values["weights"] = Lazy(rec.shape, q.dtype, rec.weights)  # (batch, head, query, key)
        return values

    def _statistics(
        self, call: _Call, semantics: _Semantics, kernel_mask: _KernelMask | None, output: torch.Tensor | None
    ) -> AttentionCall:
        """The call for the blockwise statistics engine, with its own mask (no (query x key) tensor): the tensor the
        call received, or a flex or flash call's permission as a function of blocks."""
        heads, _ = selected_heads(self.site)
        mask: torch.Tensor | kernels.MaskBlocks | None = self._mask(call) if kernel_mask is None else kernel_mask.blocks
        if isinstance(mask, torch.Tensor):
            mask = mask[..., : call.k_len]  # (batch or 1, 1 or head, query or 1, key)
        return AttentionCall.for_heads(
            call.q,
            call.k,
            call.v,
            heads=heads,
            kv_heads=self._kv_heads(call),
            mask=mask,
            causal=self._implicit_causal(call, semantics),
            bias=semantics.position_bias,
            softcap=semantics.softcap,
            sinks=semantics.sinks,
            output=output,
            lse=call.lse,
            scaling=semantics.scaling,
            additive=self._additive(call, semantics),
            score_mod=semantics.score_mod,
        )

    def _kv_heads(self, call: _Call) -> tuple[int, ...]:
        """The key/value head each selected head reads (grouped-query attention), derived once per head count."""
        if self._kv_of_heads is None:
            heads, _ = selected_heads(self.site)
            self._kv_of_heads = kv_of_heads(heads, call.heads, call.kv_heads)
        return self._kv_of_heads

    def _additive(self, call: _Call, semantics: _Semantics) -> bool:
        """Whether the function adds its mask to the logits (``finfo.min`` where masked) rather than masking them
        with ``-inf`` (see ``hooks/hf/recompute.py``): eager functions, sdpa with a position bias, any float mask
        (flex adds one to its scores). A flex BlockMask and flash's documents mask."""
        mask = call.mask
        float_mask = isinstance(mask, torch.Tensor) and mask.dtype.is_floating_point and self.kernel != "flash"
        bias = semantics.position_bias is not None and self.kernel != "flex"
        return self.style == "eager" or bias or float_mask

    def _observed_weights(self, observed: torch.Tensor, call: _Call):
        """The weights the function returned, as the record takes them: the function's own tensor (a ``Lazy`` that
        hands it over) where nothing but the model's caller can still reach it, else the tensor, which the record
        copies. Kept as it is when every head is selected, it is a whole tensor of its own (not a view, not an
        inference tensor) and autograd does not hold it (no grad): what ``output_attentions`` returns, the same
        tensor. A copy at 1 x 1,024 tokens cost a tenth of an eager layer. Delivered by a compiled graph, it is one
        of the graph's buffers: ``held`` copies it then."""
        if (
            observed.requires_grad
            or observed.is_inference()
            or observed._is_view()
            or not observed.is_contiguous()
            or self.site.heads != tuple(range(call.heads))
            or observed.untyped_storage().nbytes() != observed.numel() * observed.element_size()
        ):
            return observed
        return Lazy(tuple(observed.shape), observed.dtype, lambda: held(observed))

    def _q_shared(self, call: _Call) -> bool:
        """Whether the record keeps q as the very copy the recompute's product reads (``Recompute.inputs``): q kept,
        stored as it is (same device and dtype, the compute dtype), no statistics. Written once, not twice."""
        site, sel, q = self.site, self.session.selection, call.q
        return (
            self.session.wants(site, "q")
            and not self.session.wants(site, "stats")
            and q.dtype == torch.promote_types(q.dtype, torch.float32)
            and sel.device == q.device
            and sel.dtype in (None, q.dtype)
        )

    def _meta(self, call: _Call, semantics: _Semantics, where: _Where, dtype: torch.dtype) -> dict:
        meta, state, module = self.meta, self.state, self.module
        if where.kind == "self" and where.step is not None and call.k_len < where.offset + call.q_len:
            meta = {
                **meta,
                "first_key_pos": where.offset + call.q_len - call.k_len,
            }  # a sliding-window cache dropped keys (the left padding among them: said, for chunk_size's origin)
            left = state.left_padding(call.batch) if state is not None else None
            if left is not None and any(left):
                meta["left_padding"] = left
        if state is not None:
            meta = state.generation_meta(meta)
        module_scaling = getattr(module, "scaling", semantics.scaling)
        if semantics.scaling != module_scaling:
            meta = {**meta, "module_scaling": float(module_scaling)}  # e.g. Whisper scales q before the call
        if dtype != call.q.dtype:
            meta = {**meta, "softmax_dtype": str(dtype).removeprefix("torch.")}
        return self._declared(meta, call, where)

    def _declared(self, meta: dict, call: _Call, where: _Where) -> dict:
        """``meta`` with what the config and the inputs declare (``expects``), the inputs ``check`` may read
        (``inputs``) and the factor q and k got after their projections (``projection_scale``)."""
        expects, inputs = inputs_expects(self.state, self.module, where.kind)
        expects = {**self.expects, **expects}
        measured = self.projections.measure(call.q, call.k) if self.projections is not None else None
        if measured is not None:
            meta = {**meta, "projection_scale": measured}
            expects.update(scale_expects(self.module, measured, call.q.shape[-1]))
        if expects:
            meta = {**meta, "expects": expects}
        return {**meta, "inputs": inputs} if inputs else meta

    def _scores_trusted(self, rec: Recompute, observed, kwargs: dict) -> bool:
        """Whether attnprobe's formula is what the backend computed.

        The math of sdpa, flex and flash is known (sdpa ignores unknown keyword arguments). A model file's eager
        function may do its own math: the first call of each module with each function, set of
        argument names, mask dtype, weights dtype, head selection and set of plain attribute values
        (``_VERDICTS``) compares the recomputed weights of the selected heads with the ones the
        function returned (before the budget check, once per process: the verdict is kept for later
        captures). In training mode with dropout there is nothing to
        compare with, and the formula every transformers eager function uses is assumed.
        """
        if self.kernel in ("sdpa", "flex", "flash"):
            return True
        if observed is None:
            return True  # dropout active: nothing to compare with; the formula is the standard one
        mask = rec.mask
        key = (
            self._fn,
            frozenset(n for n, val in kwargs.items() if val is not None),
            None if mask is None else mask.dtype,
            observed.dtype,
            self.site.heads,
            tuple((n, val) for n, val in vars(self.module).items() if type(val) in (bool, int, float, str)),
        )
        verdicts = _VERDICTS.setdefault(self.module, {})
        verdict = verdicts.get(key)
        if verdict is None:
            with torch.no_grad():
                mine = rec.weights().float()
                theirs = index_heads(observed.detach(), self.site.heads)[0].float()  # a view for every head
                error = 0.0
                if mine.numel():
                    # rows with no allowed key are left out (the two mask semantics differ there by design)
                    difference = torch.sub(mine, theirs).abs_().masked_fill_(~rec.allowed().any(-1, keepdim=True), 0)
                    error = float(difference.max())
            tolerance = 1e-5 if observed.dtype in (torch.float32, torch.float64) else 1e-2
            verdict = verdicts[key] = error <= tolerance
            if not verdict:
                _warn_once(
                    ("eager-math", type(self.module)),
                    f"the eager attention function of {type(self.module).__name__} computes weights attnprobe "
                    f"does not reproduce (max difference {error:.2e}); records of {self.site.name!r} keep the "
                    "function's own weights but no scores",
                )
        return verdict


def _dense_info(blocks: kernels.MaskBlocks, call: _Call) -> MaskInfo:
    """The whole permission of a flex or flash call, for records that keep weights: ``(batch, 1, query, key)`` when
    every selected head has the same, else one per selected head."""
    allowed = compress_heads(kernels.dense(blocks, call.q_len, call.k_len, call.q.device))
    return MaskInfo(allowed, allowed, selected=allowed.shape[1] > 1)


def _warn_once(key, message: str) -> None:
    if key not in _WARNED:
        _WARNED.add(key)
        warn_user(message)


# ------------------------------------------------------------------------------------ adapter
class HuggingFaceAdapter(Adapter):
    """Reads every transformers 5.x attention module that dispatches through the attention interface.

    Modules of old-style models (no interface) get weights-only records through
    ``output_attentions`` (see ``hf_fallback``), with a warning saying what is missing.
    """

    name = "huggingface"

    def __init__(self, traced=None) -> None:
        #: the functional adapter, whose ``modules=`` are traced rather than read through output_attentions
        self.traced = traced

    def find_named(self, model: nn.Module, named: list, claimed: set[int]) -> list[Site]:
        if "transformers" not in sys.modules:  # no transformers model can exist yet
            return []
        from .fallback import find_old_style

        PreTrainedModel = hf_compat.pretrained_model_class()

        sites, pretrained = [], False
        for name, module in named:
            pretrained = pretrained or isinstance(module, PreTrainedModel)
            if id(module) in claimed or not class_info(type(module)).uses_interface:
                continue
            heads, kv_heads = head_counts(module)
            sites.append(Site(name, module, self, heads, kv_heads, info={"strategy": _STRATEGY}))
        if pretrained:  # old-style modules (whole models, or next to interface ones: LongT5, BigBirdPegasus)
            taken = claimed | {id(s.module) for s in sites}
            if self.traced is not None:  # named in modules=: traced whole by the functional adapter
                taken |= self.traced.traced_ids(model)
            for name, module in find_old_style(model, taken, parents_of(model, named), named):
                heads, kv_heads = head_counts(module)
                sites.append(Site(name, module, self, heads, kv_heads, info={"strategy": "output_attentions"}))
        return sites

    def attach(self, session, model: nn.Module, sites: list[Site], stack: ExitStack) -> None:
        selected = [s for s in sites if s.selected]
        if not selected:
            return  # an idle capture touches nothing
        surroundings = Surroundings(model, stack, session.walk)
        interface = [s for s in selected if s.info["strategy"] == _STRATEGY]
        old_style = [s for s in selected if s.info["strategy"] != _STRATEGY]
        if interface:
            self._attach_interface(session, interface, surroundings, stack)
        if old_style and not {"weights", "stats"} & set(session.selection.keep):
            # the fallback reads weights only (and the statistics of them): asking the model for output_attentions
            # would keep every layer's weights alive until it returns, for nothing
            warn_user(
                f"{type(model).__name__}: {len(old_style)} attention module(s) without the attention interface "
                f"({', '.join(sorted({type(s.module).__name__ for s in old_style}))}) give attnprobe only their "
                f"weights (through output_attentions), which keep={sorted(session.selection.keep)} leaves out: they "
                "are not recorded. Add 'weights' to keep= to record them"
            )
            for site in old_style:
                site.selected = False  # not captured (the session's end-of-capture warnings count them out)
        elif old_style:
            from .fallback import attach_fallback

            attach_fallback(session, model, old_style, surroundings, stack)

    def _attach_interface(self, session, selected: list[Site], surroundings: Surroundings, stack: ExitStack) -> None:
        """Wrap the function of every selected module where its dispatch finds it (each slot once), then listen."""
        routes = {id(s): self._check_site(s) for s in selected}  # every refusal before anything changes
        slots = {route.slot.ident: route.slot for route in routes.values()}
        for site in selected:  # GPT-2's upcast eager path bypasses the interface
            upcast = hf_dispatch.upcast_slot(site.module) if routes[id(site)].kernel == "eager" else None
            if upcast is not None:
                slots[upcast.ident] = upcast
        for slot in slots.values():
            hf_dispatch.hold(slot, stack)
        masks = MaskMemo()
        stack.callback(masks.clear)
        for site in selected:
            if routes[id(site)].kernel == "sdpa" and "stats" in session.selection.keep:
                want_lse(site.module, stack)  # the lse of sdpa's own kernel: one pass less for the statistics
            recorder = _Recorder(session, site, routes[id(site)], surroundings, masks, stack)
            listen(site.module, "hf-call", recorder.receive, stack, shared=True)  # the one wrapper serves every capture

    @staticmethod
    def _check_site(site: Site) -> Dispatch:
        """Where the calls of ``site`` go, or a clear error when attnprobe cannot read them."""
        where = f"attention module {site.name!r} ({type(site.module).__name__}, layer {site.layer})"
        route = hf_dispatch.resolve(site.module, where)
        mask_style(route.name, route.kernel)  # raises for a custom function's masks attnprobe cannot read
        return route
