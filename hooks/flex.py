"""Direct ``flex_attention`` calls (``torch.nn.attention.flex_attention``) in a model's own code.

A module whose ``forward`` calls flex attention through a global name of its file (the function, a
``torch.compile``d version of it, or the module ``torch.nn.attention.flex_attention``) is an attention module of its
own. For the length of a capture that name holds a wrapper (``hooks/slots.py``) that calls what it held with the very
arguments, returns its result untouched and hands the call to the selected module that is running (a forward
pre-hook marks it, in this thread); calls made while no selected module runs pass through unrecorded.

The record: q, k, v and the output as the call received and returned them; ``allowed`` from its ``BlockMask`` as the
kernel applies it (``hooks/hf/kernels.py``: full blocks whole, partial blocks where ``mask_mod`` says so, others not
at all; no mask: every key); the scores from q and k, scaled, then changed by its ``score_mod``, which attnprobe
calls under ``torch.vmap`` on the recomputed logits, as flex does. A ``score_mod`` that cannot be called so (it reads
tensor values on the host, say) leaves the record without scores and weights, and ``meta["scores_unavailable"]``
and a warning say why. Statistics (``keep=("stats",)``) read the mask and the scores block by block; where the model
asked flex for each row's logsumexp (``return_lse=True``, or ``return_aux=AuxRequest(lse=True)``), they take it
(``AttentionCall.lse``) and need no pass to find each row's normaliser. attnprobe never asks for it itself: the call
runs as the model wrote it.

Read in eager code only: a module compiled with ``torch.compile`` is named in a warning and left out (capture
``compiled._orig_mod``).
"""

from __future__ import annotations

import inspect
import threading
from collections.abc import Callable
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from ..probe.engine.attention_math import AttentionCall, attention_logits
from ..probe.errors import warn_user
from ..probe.selection import index_heads, kv_of_heads
from ..probe.threads import elsewhere
from . import slots
from .base import Adapter, Lazy, Site, selected_heads
from .deliver import deliver, listen, listening, number, shared_token, value_of
from .hf import kernels
from .masks import Recomputed, compress_heads, forbids_future

_STRATEGY = "flex_attention call"
_RUNNING = threading.local()  # .modules: the selected modules whose forward runs now, in this thread, innermost last
_WARNED: set = set()


def _flex_function():
    try:
        from torch.nn.attention import flex_attention as module
    except ImportError:  # a torch without flex attention
        return None, None
    return module, module.flex_attention


def flex_slots(cls: type) -> list[tuple[dict, str]]:
    """The globals through which ``cls.forward`` reaches flex attention: ``(globals, name)``, or ``(the flex module's
    dict, "flex_attention")`` where the forward reads the function off the module. Read once per class."""
    found = _SLOTS.get(cls)
    if found is None:
        found = _SLOTS[cls] = _read_slots(cls)
    return found


_SLOTS: dict[type, list[tuple[dict, str]]] = {}


def _read_slots(cls: type) -> list[tuple[dict, str]]:
    module, flex = _flex_function()
    forward = getattr(cls, "forward", None)
    if flex is None or forward is None or cls.__module__.startswith("torch."):
        return []
    forward = inspect.unwrap(forward)
    code = getattr(forward, "__code__", None)
    if code is None:
        return []
    g = forward.__globals__
    found = []
    for name in sorted(_code_names(code)):
        value = g.get(name)
        if value is flex or getattr(value, "_torchdynamo_orig_callable", None) is flex:
            found.append((g, name))
        elif value is module and "flex_attention" in _code_names(code):
            found.append((vars(module), "flex_attention"))
    return found


def _code_names(code) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _code_names(const)
    return names


def _wrapper(fn: Callable) -> Callable:
    """``fn`` (flex attention, maybe compiled), handing each call to the selected module running in this thread."""

    def attnprobe_flex(query, key, value, score_mod=None, block_mask=None, scale=None, enable_gqa=False, **kwargs):
        result = fn(query, key, value, score_mod, block_mask, scale, enable_gqa, **kwargs)
        running = getattr(_RUNNING, "modules", None)
        if running:
            token = shared_token(running[-1], "flex-call")
            if listening(token):
                out, lse = _output_and_lse(result)
                deliver(token, "call", [query, key, value, out, block_mask, score_mod, lse], [number(scale)])
        return result

    attnprobe_flex.__wrapped__ = fn  # type: ignore[attr-defined]
    return attnprobe_flex


def _output_and_lse(result) -> tuple:
    """The output of a flex call and each row's logsumexp where the caller asked for it (``return_lse=True``: the
    tuple's second tensor; ``return_aux=AuxRequest(lse=True)``: its ``lse``), else None: read from what the call
    returned, never asked for."""
    if not isinstance(result, tuple):
        return result, None
    extra = result[1] if len(result) > 1 else None
    lse = extra if isinstance(extra, torch.Tensor) else getattr(extra, "lse", None)
    return result[0], lse if isinstance(lse, torch.Tensor) else None


class FlexAdapter(Adapter):
    """Reads modules whose own forward calls ``flex_attention``."""

    name = "flex"

    def find_named(self, model: nn.Module, named: list, claimed: set[int]) -> list[Site]:
        return [
            Site(name, module, self, info={"strategy": _STRATEGY})
            for name, module in named
            if id(module) not in claimed and flex_slots(type(module))
        ]

    def attach(self, session, model: nn.Module, sites: list[Site], stack: ExitStack) -> None:
        selected = [s for s in sites if s.selected]
        compiled = set(session.compiled)
        for site in [s for s in selected if s.name in compiled]:
            site.selected = False
            warn_user(
                f"{site.name!r} ({type(site.module).__name__}) calls flex_attention inside code compiled with "
                "torch.compile, where attnprobe does not read direct calls: it is not recorded. Capture the module "
                "before compilation (`compiled._orig_mod`)"
            )
        selected = [s for s in selected if s.selected]
        places = {(id(g), name): (g, name) for s in selected for g, name in flex_slots(type(s.module))}
        for g, name in places.values():
            slots.hold(slots.Slot(g, name), stack, _wrapper)
        for site in selected:
            recorder = _Recorder(session, site)
            listen(site.module, "flex-call", recorder.receive, stack, shared=True)
            for handle in (
                site.module.register_forward_pre_hook(_enter),
                site.module.register_forward_hook(_leave, always_call=True),
            ):
                stack.callback(handle.remove)


def _enter(module: nn.Module, args) -> None:
    running = getattr(_RUNNING, "modules", None)
    if running is None:
        running = _RUNNING.modules = []
    running.append(module)


def _leave(module: nn.Module, args, output) -> None:
    running = getattr(_RUNNING, "modules", None)
    if running and running[-1] is module:
        running.pop()


@dataclass(frozen=True)
class _FlexCall:
    """One flex call: q ``(batch, head, query, d)``, k/v ``(batch, kv_head, key, d)``, its output ``(batch, head,
    query, d_v)``, BlockMask and score_mod (None: none given), the scale (None: ``1 / sqrt(d)``), and each row's
    logsumexp ``(batch, head, query)`` where the caller asked flex for it (None: not asked)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    out: torch.Tensor | None
    block_mask: object
    score_mod: Callable | None
    scale: float
    lse: torch.Tensor | None = None

    @property
    def shape(self) -> tuple[int, int, int, int]:
        return (self.q.shape[0], self.q.shape[1], self.q.shape[2], self.k.shape[2])


class _Recorder:
    """The records of one selected module's flex calls."""

    def __init__(self, session, site: Site) -> None:
        self.session, self.site = session, site

    def receive(self, event: str, tensors: list, numbers: list) -> None:
        if not self.site.selected or elsewhere(self.session.thread):
            return
        q, k, v, out, block_mask, score_mod, lse = tensors
        scale = value_of(numbers[0])
        scale = q.shape[-1] ** -0.5 if scale is None else scale  # flex's default
        out = out if isinstance(out, torch.Tensor) else None
        lse = lse if isinstance(lse, torch.Tensor) and lse.shape == q.shape[:3] else None  # (batch, head, query)
        call = _FlexCall(q, k, v, out, block_mask, score_mod, float(scale), lse)
        site = self.site
        if site.num_heads != q.shape[1] or site.num_kv_heads != k.shape[1]:
            site.num_heads, site.num_kv_heads = q.shape[1], k.shape[1]
            self.session.select_site(site)
        if site.selected:
            self._emit(call)

    def _emit(self, call: _FlexCall) -> None:
        session, site = self.session, self.site
        heads, _ = selected_heads(site)
        B, _, L, S = call.shape
        kv_heads = kv_of_heads(heads, call.q.shape[1], call.k.shape[1])  # the key/value head each selected head reads
        mask = self._mask(call, heads)
        scores, why = self._scores(call, heads)
        allowed = None
        if not session.stats_only:  # (batch, 1 or head, query, key); no BlockMask: every key
            every = torch.ones(1, 1, 1, 1, dtype=torch.bool, device=call.q.device).expand(B, 1, L, S)
            allowed = every if mask is None else compress_heads(kernels.dense(mask, L, S, call.q.device))
        values: dict = {}
        if why is None:
            recomputed = Recomputed(
                partial(_logits, call, heads, kv_heads, scores),
                partial(_whole, allowed, mask, call),
                keep_scores=session.wants(site, "scores"),
            )
            values["scores"] = Lazy((B, len(heads), L, S), call.q.dtype, recomputed.scores)
            values["weights"] = Lazy((B, len(heads), L, S), call.q.dtype, recomputed.weights)
            if session.wants(site, "stats"):
                values["stats"] = AttentionCall.for_heads(
                    call.q,
                    call.k,
                    call.v,
                    heads=heads,
                    kv_heads=kv_heads,
                    mask=mask,
                    score_mod=scores,
                    output=call.out,
                    lse=call.lse,
                    scaling=call.scale,
                )
        identified = {"q", "k", "v", "allowed"} | ({"output"} if call.out is not None else set())
        identified |= {"scores", "weights"} if why is None else set()
        session.emit(
            site,
            kind="self" if L == S else "cross",
            q=call.q,
            k=call.k,
            v=call.v,
            output=call.out,
            allowed=allowed,
            preselected=("allowed",) if allowed is not None and allowed.shape[1] > 1 else (),
            causal=None if allowed is None else forbids_future(allowed),
            scaling=call.scale,
            backend="flex_attention",
            dtype=call.q.dtype,
            weights_source="recomputed" if why is None else "none",
            identified=frozenset(identified),
            meta=self._meta(call, site, why),
            **values,
        )

    @staticmethod
    def _mask(call: _FlexCall, heads: tuple[int, ...]) -> kernels.MaskBlocks | None:
        if call.block_mask is None:
            return None
        B, _, L, S = call.shape
        return kernels.FlexMask(call.block_mask, batch=B, heads=heads, q_len=L, k_len=S)

    def _scores(self, call: _FlexCall, heads: tuple[int, ...]) -> tuple[kernels.ScoreBlocks | None, str | None]:
        """The call's ``score_mod`` as a function of blocks, tried on one block first; or why it cannot be."""
        if call.score_mod is None:
            return None, None
        scores = kernels.CalledScores(call.score_mod, batch=call.q.shape[0], heads=heads, device=call.q.device)
        try:
            with torch.no_grad():
                trial = torch.zeros(call.q.shape[0], len(heads), 1, 1, device=call.q.device)
                scores(trial, torch.zeros(1, dtype=torch.long, device=call.q.device), 0, 1)
        except Exception as exc:  # a score_mod attnprobe cannot call over index tensors
            why = (
                f"its score_mod {getattr(call.score_mod, '__qualname__', call.score_mod)!r} cannot be called on "
                f"the recomputed scores under torch.vmap ({type(exc).__name__}: {exc})"
            )
            if (self.site.layer, why) not in _WARNED:
                _WARNED.add((self.site.layer, why))
                warn_user(f"layer {self.site.layer} ({self.site.name!r}): {why}; its records have no scores or weights")
            return None, why
        return scores, None

    @staticmethod
    def _meta(call: _FlexCall, site: Site, why: str | None) -> dict:
        meta: dict = {
            "module_class": type(site.module).__name__,
            "block_mask": call.block_mask is not None,
            "score_mod": getattr(call.score_mod, "__qualname__", None) if call.score_mod is not None else None,
        }
        if why is not None:
            meta["scores_unavailable"] = why
        return meta


def _whole(allowed: torch.Tensor | None, mask: kernels.MaskBlocks | None, call: _FlexCall) -> torch.Tensor:
    """The permission the weights are masked with: the record's, or (a statistics capture keeps none) made now."""
    if allowed is not None:
        return allowed
    B, _, L, S = call.shape
    if mask is None:
        return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=call.q.device).expand(B, 1, L, S)
    return kernels.dense(mask, L, S, call.q.device)


def _logits(call: _FlexCall, heads, kv_heads, scores: kernels.ScoreBlocks | None) -> torch.Tensor:
    """``(batch, head, query, key)`` of the selected heads, in the compute dtype: scaled ``q @ k``, then score_mod."""
    dtype = torch.promote_types(call.q.dtype, torch.float32)
    q = index_heads(call.q.detach(), heads)[0].to(dtype)  # (batch, head, query, d)
    k = index_heads(call.k.detach(), kv_heads)[0].to(dtype)  # (batch, head, key, d): each head's kv head
    s = attention_logits(q, k, scaling=call.scale)  # (batch, head, query, key)
    if scores is not None:
        s = scores(s, torch.arange(s.shape[2], device=s.device), 0, s.shape[3])
    return s
