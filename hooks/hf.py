"""Adapter for Hugging Face ``transformers`` 5.x: a private attention implementation around the backend.

Interface-based attention modules ask ``ALL_ATTENTION_FUNCTIONS`` for the function named by
``config._attn_implementation``. During a capture that name points to a private implementation
(``attnprobe_sdp`` over sdpa, ``attnprobe_eager`` over the model file's own eager function) that
calls the backend the model already used, returns its result untouched, and records what the
call received. Both names are registered with ``AttentionInterface`` and with ``AttentionMaskInterface``
(so masks are built exactly as for the base backend) while a capture is open; after the last one
closes, both registries hold the names they held before.

The implementation of every reachable (sub)config is saved and restored on exit, also when the
forward raises. Models built from the same config object see the private name meanwhile, but
their modules are not part of the capture and go straight to the base backend, so nothing of
theirs changes. Models without the attention interface use ``hf_fallback``.
"""

from __future__ import annotations

import inspect
import sys
import threading
from contextlib import ExitStack
from dataclasses import dataclass
from functools import lru_cache
from typing import Callable

import torch
from torch import nn

from ..probe.attention_math import AttentionCall
from ..probe.errors import UnsupportedModelError, warn_user
from ..probe.threads import elsewhere
from . import hf_compat
from .base import Adapter, Lazy, Site
from .hf_context import KindProbe, Surroundings, head_counts, parents_of, static_kind
from .hf_math import MaskMemo, Recompute, kv_of_heads
from .hf_source import name_branches, record_dtype, softmax_dtype

#: base backend -> the private name that wraps it. No "sdpa" and no "flash" inside the names:
#: transformers treats names containing those substrings specially. Custom attention functions a
#: user registered with ``AttentionInterface`` get names of their own (``attnprobe_fn1``, ...) on demand.
PRIVATE_NAMES = {"sdpa": "attnprobe_sdp", "eager": "attnprobe_eager"}
BASE_OF = {private: base for base, private in PRIVATE_NAMES.items()}
#: Substrings of implementation names attnprobe does not wrap: kernels with their own dispatch,
#: cache layouts or hub loading, whose calls do not receive a plain (q, k, v, mask).
_NOT_WRAPPED = ("flash", "flex", "paged", "|", "/", ":")

_STRATEGY = "attention interface"
_HANDLERS: dict[int, list["_Recorder"]] = {}  # id(attention module) -> recorders of active captures
_LOCK = threading.Lock()
_WARNED: set = set()


# --------------------------------------------------------------------------------------- classes
@dataclass(frozen=True)
class _ClassInfo:
    uses_interface: bool
    interface: object | None = None  # the ALL_ATTENTION_FUNCTIONS the forward reads (may be file-local)
    eager: Callable | None = None  # the model file's own eager function (the dispatch default)


def _code_names(code) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _code_names(const)
    return names


@lru_cache(maxsize=None)
def class_info(cls: type) -> _ClassInfo:
    """Whether ``cls.forward`` dispatches through the attention interface, and to what."""
    forward = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    code = getattr(forward, "__code__", None)
    if code is None:
        return _ClassInfo(False)
    names = _code_names(code)
    if "ALL_ATTENTION_FUNCTIONS" not in names:
        return _ClassInfo(False)
    g = forward.__globals__
    eager = [g[n] for n in sorted(names) if "eager" in n and n.endswith("attention_forward") and callable(g.get(n))]
    return _ClassInfo(True, g.get("ALL_ATTENTION_FUNCTIONS"), eager[0] if len(eager) == 1 else None)


def _sdpa_forward():
    return hf_compat.sdpa_forward()


def _base_function(cls: type, base: str) -> Callable:
    """The function the dispatch of ``cls`` calls for ``base`` right now.

    Looked up on every call for registered names: a user may register another function under the
    same name at any time, and the capture must call what the model would call.
    """
    if base == "eager":
        return _eager_function(cls)
    return class_info(cls).interface[base]


@lru_cache(maxsize=None)
def _eager_function(cls: type) -> Callable:
    """The model file's own eager function (the dispatch default of ``cls``), which never changes."""
    info = class_info(cls)
    if info.eager is None:
        raise UnsupportedModelError(
            f"cannot find the eager attention function of {cls.__qualname__} (module {cls.__module__}): its forward "
            "names no single `*eager_attention_forward` function; load the model with attn_implementation='sdpa'"
        )
    if hasattr(cls, "_upcast_and_reordered_attn"):  # GPT-2: the eager name selects this path when the flag is set
        eager = info.eager

        def gpt2_eager(module, query, key, value, attention_mask, *args, **kwargs):
            if module.reorder_and_upcast_attn:
                return module._upcast_and_reordered_attn(query, key, value, attention_mask)
            return eager(module, query, key, value, attention_mask, *args, **kwargs)

        return gpt2_eager
    return info.eager


# ---------------------------------------------------------------------------- the private backend
def _private_attention(base: str) -> Callable:
    def attnprobe_attention(module, query, key, value, attention_mask, *args, **kwargs):
        fn = _base_function(type(module), base)
        result = fn(module, query, key, value, attention_mask, *args, **kwargs)
        recorders = _HANDLERS.get(id(module))
        if recorders:
            for recorder in tuple(recorders):
                if elsewhere(recorder.session.thread):
                    continue  # another thread's forward: its call is not this capture's
                recorder.on_call(fn, query, key, value, attention_mask, args, kwargs, result)
        return result

    attnprobe_attention.__qualname__ = attnprobe_attention.__name__ = f"attnprobe_over_{base}"
    return attnprobe_attention


_FUNCTIONS = {PRIVATE_NAMES[base]: _private_attention(base) for base in PRIVATE_NAMES}


def private_name(base: str) -> str:
    """The private name wrapping ``base`` (made on first need for a user's custom function)."""
    with _LOCK:
        name = PRIVATE_NAMES.get(base)
        if name is None:
            name = f"attnprobe_fn{len(PRIVATE_NAMES) - 1}"
            PRIVATE_NAMES[base], BASE_OF[name] = name, base
            _FUNCTIONS[name] = _private_attention(base)
    return name


def register() -> None:
    """Register the private names with the attention and mask interfaces (global, idempotent).

    Each private name gets the mask function of the backend it wraps, so masks are built exactly as
    for that backend (a custom function registered without one gets none, as it would without us).
    """
    with _LOCK:
        functions, masks = hf_compat.attention_registry(), hf_compat.mask_registry()
        for private, fn in _FUNCTIONS.items():
            if functions.get(private) is not fn:
                hf_compat.register_attention(private, fn)
            mask_fn = masks.get(BASE_OF[private])
            if mask_fn is None:
                masks.pop(private, None)
            elif masks.get(private) is not mask_fn:
                hf_compat.register_mask(private, mask_fn)


_ACTIVE = 0  # captures that hold the private names registered (see ``hold_registration``)
_ADDED: set[tuple[str, str]] = set()  # ("attention" or "mask", name) entries the first of them added


def hold_registration(stack: ExitStack) -> None:
    """Register the private names for the length of a capture (``register``); the last capture open removes
    again every entry the registries did not hold before the first one, so their keys are left as found."""
    global _ACTIVE
    with _LOCK:
        if _ACTIVE == 0:
            _ADDED.clear()
        # (with captures open, only a private name made meanwhile for a custom function is missing)
        for kind, mapping in (("attention", hf_compat.attention_registry()), ("mask", hf_compat.mask_registry())):
            _ADDED.update((kind, name) for name in _FUNCTIONS if name not in mapping)
        _ACTIVE += 1
    stack.callback(_release_registration)
    register()


def _release_registration() -> None:
    global _ACTIVE
    with _LOCK:
        _ACTIVE -= 1
        if _ACTIVE:
            return
        mappings = {"attention": hf_compat.attention_registry(), "mask": hf_compat.mask_registry()}
        for kind, name in _ADDED:
            mapping = mappings[kind]
            ours = _FUNCTIONS[name] if kind == "attention" else mappings["mask"].get(BASE_OF[name])
            if mapping.get(name) is ours:  # not if the user registered something else under the name meanwhile
                mapping.pop(name, None)
        _ADDED.clear()


def mask_style(base: str) -> str:
    """How masks reach ``base``.

    "eager": float, additive (``eager_mask``); "sdpa": bool, or None with ``is_causal`` (``sdpa_mask``);
    "none": no mask function is registered for ``base``, so transformers hands it no mask at all;
    "custom": the user's own mask function, whose result is read on each call if it is a 4-D tensor.
    Raises for mask functions whose result is not a ``(query, key)`` mask (flash's 2-D padding mask,
    flex's BlockMask).
    """
    if base in ("sdpa", "eager"):
        return base
    fn = hf_compat.mask_registry().get(base)
    if fn is None:
        return "none"
    eager_mask, sdpa_mask, unreadable = hf_compat.mask_functions()
    if fn is eager_mask:
        return "eager"
    if fn is sdpa_mask:
        return "sdpa"
    if fn in unreadable:
        raise UnsupportedModelError(
            f"the attention function registered as {base!r} gets its masks from {fn.__name__}, which builds no "
            "(query, key) mask attnprobe can read (a 2-D padding mask or a flex BlockMask). Register the function "
            f"with sdpa_mask or eager_mask (AttentionMaskInterface.register({base!r}, sdpa_mask)), or capture "
            "with attn_implementation='sdpa'"
        )
    return "custom"


def _check_mask(mask, base: str, *, batch: int, heads: int, q_len: int, k_len: int) -> None:
    """Refuse, by name, a mask from a user's own mask function that is not a (query, key) mask."""
    if mask is None:
        return
    readable = (isinstance(mask, torch.Tensor) and mask.dim() == 4 and mask.shape[0] in (1, batch)
                and mask.shape[1] in (1, heads) and mask.shape[2] in (1, q_len) and mask.shape[3] >= k_len
                and (mask.dtype == torch.bool or mask.dtype.is_floating_point))
    if not readable:
        fn = hf_compat.mask_registry().get(base)
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else None
        raise UnsupportedModelError(
            f"the mask function registered for {base!r} ({getattr(fn, '__qualname__', fn)!r}) handed the attention "
            f"function a {type(mask).__name__}{'' if shape is None else f' of shape {shape}'}; attnprobe reads "
            f"4-D (batch, 1 or head={heads}, query={q_len}, key>={k_len}) bool or float masks only. Register "
            "the function with sdpa_mask or eager_mask, or capture with attn_implementation='sdpa'"
        )


# ------------------------------------------------------------------------------------ configs
def reachable_configs(model: nn.Module, modules) -> list:
    """Every config object the model's modules read, with all their sub-configs (each once)."""
    PretrainedConfig = hf_compat.config_class()
    roots = [getattr(m, "config", None) for m in model.modules()] + [getattr(m, "config", None) for m in modules]
    seen: dict[int, object] = {}
    todo = [c for c in roots if isinstance(c, PretrainedConfig)]
    while todo:
        config = todo.pop()
        if id(config) in seen:
            continue
        seen[id(config)] = config
        for key in getattr(config, "sub_configs", {}) or {}:
            sub = getattr(config, key, None)
            if isinstance(sub, PretrainedConfig):
                todo.append(sub)
    return list(seen.values())


def base_of(config) -> str | None:
    """The backend a config dispatches to ("sdpa", "eager" or the name of a custom function registered
    with ``AttentionInterface``), None when attnprobe cannot wrap it."""
    impl = getattr(config, "_attn_implementation", None)
    if impl is None:
        return "eager"  # get_interface(None, default) falls back to the eager default
    if impl in ("sdpa", "eager"):
        return impl
    if impl in BASE_OF:
        return BASE_OF[impl]  # a capture is already active on this config (nested captures)
    if impl in hf_compat.attention_registry() and not any(s in impl for s in _NOT_WRAPPED):
        return impl
    return None


_SWITCHED: dict[int, list] = {}  # id(config) -> [config, its implementation before, captures holding it]


def switch_configs(configs, stack: ExitStack) -> None:
    """Point every wrappable config at its private name; restore each one on exit.

    Every private name is made and registered before the first config switches: a sub-config
    whose backend no selected module uses (a vision tower on a custom function while only text
    layers are selected) still runs its modules, and an unregistered name would fail there, or
    lose its masks. A config several captures switched (nested, or closed out of order) keeps the
    private name until the last of them closes, then gets back what it had before the first.
    """
    plan = []
    for config in configs:
        base = base_of(config)
        impl = getattr(config, "_attn_implementation", None)
        if base is not None and (impl not in BASE_OF or id(config) in _SWITCHED):
            plan.append((config, hf_compat.implementation_internal(config), private_name(base)))
    hold_registration(stack)  # its undo runs after the configs are restored (the stack unwinds in reverse)
    held = []

    def restore():
        with _LOCK:
            for config in reversed(held):
                entry = _SWITCHED.get(id(config))
                if entry is None:
                    continue
                entry[2] -= 1
                if entry[2] == 0:
                    del _SWITCHED[id(config)]
                    hf_compat.set_implementation_internal(config, entry[1])

    stack.callback(restore)  # registered first: a failure halfway still restores what was switched
    with _LOCK:
        for config, impl, private in plan:
            entry = _SWITCHED.get(id(config))
            if entry is None:
                _SWITCHED[id(config)] = [config, impl, 1]
                hf_compat.set_implementation_internal(config, private)
            else:
                entry[2] += 1
            held.append(config)


# --------------------------------------------------------------------------------- recording
class _Recorder:
    """Turns the calls of one selected module into records for one capture session."""

    def __init__(self, session, site: Site, base: str, surroundings: Surroundings, masks: MaskMemo,
                 stack: ExitStack) -> None:
        module = site.module
        self.masks = masks
        self.session, self.site, self.base = session, site, base
        self.module = module
        self.state = surroundings.stack_of(module)
        kind = static_kind(module)
        self.kind_probe = None if kind is not None else KindProbe(module, stack)
        self.kind = kind
        self.style = mask_style(base)
        # Weights are recomputed from what the call received with the textbook formula. For a custom
        # function (or an overridden "sdpa") that is what the arguments ask for, not necessarily what
        # the function did: the output it returned is recorded as it is, so `output_match` tells.
        self.recomputable = True
        self._fn, self._fn_params = None, []
        meta = {
            "module_class": type(module).__name__,
            "layer_idx": getattr(module, "layer_idx", None),
            "base": base,
        }
        part = surroundings.part_of(module)
        if part is not None:
            meta["stack"] = part
        self.meta = meta
        # many eager functions run their softmax in float32 whatever the model's dtype: the weights of a
        # float64 model are then only float32-accurate, and the record says so (checks use its dtype)
        self.softmax_dtype = softmax_dtype(_base_function(type(module), base)) if base == "eager" else None
        self._kv_of_heads = None
        self._verified: dict[frozenset, bool] = {}

    # -- helpers --------------------------------------------------------------------------
    def _sync_heads(self, heads: int, kv_heads: int) -> None:
        site = self.site
        if site.num_heads != heads or site.num_kv_heads != kv_heads:
            site.num_heads, site.num_kv_heads = heads, kv_heads
            self.session.select_site(site)
            self._kv_of_heads = None

    def _use(self, fn: Callable) -> None:
        """Describe the function this call ran (a user may register another one under the same name)."""
        self._fn = fn
        self._fn_params = None
        self._verified = {}  # another function: its math is judged afresh
        meta = {k: v for k, v in self.meta.items() if k != "base_function"}
        if self.base != "eager" and fn is not _sdpa_forward():
            meta["base_function"] = getattr(fn, "__qualname__", repr(fn))
        self.meta = meta

    def _named(self, args: tuple, kwargs: dict) -> dict:
        """kwargs with positional extras (after the mask) named by the base function's signature."""
        if not args:
            return kwargs
        if self._fn_params is None:
            self._fn_params = list(inspect.signature(self._fn).parameters)[5:]
        named = dict(zip(self._fn_params, args))
        named.update(kwargs)
        return named

    # -- one call -------------------------------------------------------------------------
    def on_call(self, fn, q, k, v, mask, args, kwargs, result) -> None:
        if fn is not self._fn:
            self._use(fn)
        site, module, base = self.site, self.module, self.base
        kwargs = self._named(args, kwargs)
        batch, heads, q_len, _ = q.shape
        kv_heads, k_len = k.shape[1], k.shape[2]
        self._sync_heads(heads, kv_heads)

        scaling = kwargs.get("scaling")
        scaling = float(q.shape[-1] ** -0.5 if scaling is None else scaling)
        is_causal = kwargs.get("is_causal")
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True if self.style != "eager" else None)
        dropout = float(kwargs.get("dropout") or 0.0)
        if base == "eager" and not module.training:
            dropout = 0.0
        position_bias = kwargs.get("position_bias")
        softcap = kwargs.get("softcap")
        sinks = kwargs.get("s_aux") if base != "sdpa" else None  # sdpa ignores s_aux; eager and others take it
        if self.style == "custom":
            _check_mask(mask, base, batch=batch, heads=heads, q_len=q_len, k_len=k_len)
        implicit_causal = self.style != "eager" and bool(is_causal) and mask is None and q_len > 1
        if self.session.stats_only:
            mask_info = allowed = None  # a statistics capture reads the mask block by block, never whole
        else:
            mask_info = self.masks.get(mask, batch=batch, q_len=q_len, k_len=k_len, implicit_causal=implicit_causal,
                                       device=q.device)
            allowed = mask_info.allowed

        state = self.state
        step = state.step if state is not None else None
        offset = state.position if state is not None else 0
        query_padding = state.query_padding(batch, q_len) if state is not None else None
        kind = self.kind or self.kind_probe.kind
        if offset is None:  # a cache that cannot say its length: the keys before the queries are cached ones
            offset = max(k_len - q_len, 0) if kind == "self" else 0

        out = result[0] if isinstance(result, tuple) and result else None
        output = out.transpose(1, 2) if (isinstance(out, torch.Tensor) and out.dim() == 4
                                          and tuple(out.shape[:3]) == (batch, q_len, heads)) else None
        observed = result[1] if isinstance(result, tuple) and len(result) > 1 else None
        if not (base != "sdpa" and dropout == 0.0 and isinstance(observed, torch.Tensor)
                and tuple(observed.shape) == (batch, heads, q_len, k_len)):
            observed = None

        wants = self.session.wants
        values: dict = {}
        identified = {"q", "k", "v", "allowed"}
        weights_source = "none"
        if self.recomputable and (wants(site, "scores") or (wants(site, "weights") and observed is None)):
            if self._kv_of_heads is None:
                self._kv_of_heads = kv_of_heads(site.heads, heads, kv_heads)
            rec = Recompute(
                q, k, mask_info, heads=site.heads, kv_heads=self._kv_of_heads, scaling=scaling,
                additive=self.style == "eager" or position_bias is not None
                or (mask is not None and mask.dtype.is_floating_point),
                position_bias=position_bias, softcap=softcap, sinks=sinks, scores_wanted=wants(site, "scores"),
            )
            shape = rec.shape
            trusted = self._scores_trusted(rec, observed, kwargs)
            if trusted:
                values["scores"] = Lazy(shape, q.dtype, rec.scores)
                identified.add("scores")
            if observed is None:
                values["weights"] = Lazy(shape, q.dtype, rec.weights)
                weights_source = "recomputed"
        if self.recomputable and wants(site, "stats"):
            if self._kv_of_heads is None:
                self._kv_of_heads = kv_of_heads(site.heads, heads, kv_heads)
            values["stats"] = AttentionCall.for_heads(
                q, k, v, heads=site.heads, kv_heads=self._kv_of_heads,
                mask=None if mask is None else mask[..., :k_len], causal=implicit_causal, bias=position_bias,
                softcap=softcap, sinks=sinks, output=output, scaling=scaling,
                additive=self.style == "eager" or position_bias is not None
                or (mask is not None and mask.dtype.is_floating_point),
            )
        if observed is not None:
            values["weights"] = observed
            weights_source = "observed"
        elif self.recomputable and "weights" not in values:
            weights_source = "recomputed"  # recomputable, only not kept
        if weights_source != "none":
            identified.add("weights")
        if output is not None:
            values["output"] = output
            identified.add("output")
        if query_padding is not None:
            identified.add("query_padding")

        meta = self.meta
        if kind == "self" and state is not None and state.step is not None and k_len < offset + q_len:
            meta = {**meta, "first_key_pos": offset + q_len - k_len}  # a sliding-window cache dropped keys
        if state is not None:
            meta = state.generation_meta(meta)
        if scaling != getattr(module, "scaling", scaling):
            meta = {**meta, "module_scaling": float(module.scaling)}  # e.g. Whisper scales q before the call

        dtype = record_dtype(q.dtype, self.softmax_dtype)
        if dtype != q.dtype:
            meta = {**meta, "softmax_dtype": str(dtype).removeprefix("torch.")}

        sliding = kwargs.get("sliding_window")
        self.session.emit(
            site,
            kind=kind,
            q=q, k=k, v=v,
            allowed=allowed,
            query_padding=query_padding,
            causal=None if is_causal is None else bool(is_causal),
            scaling=scaling,
            backend=base,
            dtype=dtype,
            weights_source=weights_source,
            dropout=dropout,
            step=step,
            query_offset=offset,
            sinks=sinks,
            softcap=None if softcap is None else float(softcap),
            sliding_window=sliding if isinstance(sliding, int) else None,
            identified=frozenset(identified),
            meta=meta,
            **values,
        )

    def _scores_trusted(self, rec: Recompute, observed, kwargs: dict) -> bool:
        """Whether attnprobe's formula is what the backend computed.

        sdpa's semantics are known (it ignores unknown keyword arguments). A model file's eager
        function may do its own math: the first call with each set of argument names compares the
        recomputed weights of the selected heads with the ones the function returned (before the
        budget check, once). In training mode with dropout there is nothing to compare with, and
        the formula every transformers eager function uses is assumed.
        """
        if self.base == "sdpa":
            return True
        key = frozenset(n for n, val in kwargs.items() if val is not None)
        verdict = self._verified.get(key)
        if verdict is None:
            if observed is None:
                return True  # dropout active: nothing to compare with; the formula is the standard one
            with torch.no_grad():
                mine = rec.weights().float()
                theirs = observed.detach()
                theirs = theirs.index_select(1, torch.tensor(self.site.heads, device=theirs.device)).float()
                rows = rec._allowed().any(dim=-1, keepdim=True).expand_as(mine)
                error = float((mine - theirs).abs().masked_fill(~rows, 0).max()) if mine.numel() else 0.0
            tolerance = 1e-5 if observed.dtype in (torch.float32, torch.float64) else 1e-2
            verdict = self._verified[key] = error <= tolerance
            if not verdict:
                _warn_once(
                    ("eager-math", type(self.module)),
                    f"the eager attention function of {type(self.module).__name__} computes weights attnprobe "
                    f"does not reproduce (max difference {error:.2e}); records of {self.site.name!r} keep the "
                    "function's own weights but no scores",
                )
        return verdict


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

    def find(self, model: nn.Module, claimed: set[int]) -> list[Site]:
        return self.find_named(model, list(model.named_modules()), claimed)

    def find_named(self, model: nn.Module, named: list, claimed: set[int]) -> list[Site]:
        if "transformers" not in sys.modules:  # no transformers model can exist yet
            return []
        from .hf_fallback import find_old_style

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
        surroundings = Surroundings(model, stack)
        interface = [s for s in selected if s.info["strategy"] == _STRATEGY]
        old_style = [s for s in selected if s.info["strategy"] != _STRATEGY]
        if interface:
            self._attach_interface(session, model, sites, interface, surroundings, stack)
        if old_style and "weights" not in session.selection.keep:
            # the fallback records weights only: asking the model for output_attentions would keep every layer's
            # weights alive until it returns, for nothing
            warn_user(
                f"{type(model).__name__}: {len(old_style)} attention module(s) without the attention interface "
                f"({', '.join(sorted({type(s.module).__name__ for s in old_style}))}) give attnprobe only their "
                f"weights (through output_attentions), which keep={sorted(session.selection.keep)} leaves out: they "
                "are not recorded. Add 'weights' to keep= to record them")
            for site in old_style:
                site.selected = False  # not captured (the session's end-of-capture warnings count them out)
        elif old_style:
            from .hf_fallback import attach_fallback

            attach_fallback(session, model, old_style, surroundings, stack)

    def _attach_interface(self, session, model, sites, selected, surroundings, stack) -> None:
        bases = {id(s): self._check_site(s) for s in selected}
        switch_configs(reachable_configs(model, [s.module for s in sites]), stack)
        masks = MaskMemo()
        stack.callback(masks.clear)
        for site in selected:
            recorder = _Recorder(session, site, bases[id(site)], surroundings, masks, stack)
            key = id(site.module)
            with _LOCK:
                _HANDLERS.setdefault(key, []).append(recorder)
            stack.callback(_unregister, key, recorder)

    @staticmethod
    def _check_site(site: Site) -> str:
        """The base backend of ``site``, or a clear error when attnprobe cannot wrap it."""
        module = site.module
        cls = type(module)
        config = getattr(module, "config", None)
        where = f"attention module {site.name!r} ({cls.__name__}, layer {site.layer})"
        if config is None or not hasattr(config, "_attn_implementation"):
            raise UnsupportedModelError(
                f"{where} has no `config` with an `_attn_implementation`, so its dispatch cannot be redirected; "
                f"exclude it with layers=[...]"
            )
        base = base_of(config)
        if base is None:
            raise UnsupportedModelError(
                f"{where} runs attn_implementation={config._attn_implementation!r}; attnprobe wraps 'sdpa', "
                "'eager' and attention functions registered with AttentionInterface, not flash, flex, paged or "
                "hub kernels. Load the model with attn_implementation='sdpa' (or call "
                "model.set_attn_implementation('sdpa')) for the capture"
            )
        branches = name_branches(cls.__module__)
        if branches:
            raise UnsupportedModelError(
                f"{where}: {cls.__module__} branches on the attention implementation's name "
                f"({branches[0]!r}); attnprobe's private name would change what the model computes, so it "
                "does not capture this model"
            )
        _base_function(cls, base)  # raises when the eager default cannot be found
        mask_style(base)  # raises for mask functions whose masks attnprobe cannot read
        return base


def _unregister(key: int, recorder: _Recorder) -> None:
    with _LOCK:
        recorders = _HANDLERS.get(key, [])
        if recorder in recorders:
            recorders.remove(recorder)
        if not recorders:
            _HANDLERS.pop(key, None)
