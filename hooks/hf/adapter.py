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
import weakref
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass

import torch
from torch import nn

from ...probe.engine.attention_math import AttentionCall
from ...probe.errors import UnsupportedModelError, warn_user
from ...probe.selection import index_heads, kv_of_heads
from ...probe.threads import elsewhere
from ...probe.walk import walk_of
from ..base import Adapter, Lazy, Site, selected_heads
from ..deliver import deliver, held, listen, number, value_of
from . import compat as hf_compat
from .context import KindProbe, Surroundings, call_kind, head_counts, parents_of, static_kind
from .recompute import MaskMemo, Recompute
from .source import name_branches, record_dtype, softmax_dtype

#: base backend -> the private name that wraps it. No "sdpa" and no "flash" inside the names:
#: transformers treats names containing those substrings specially. Custom attention functions a
#: user registered with ``AttentionInterface`` get names of their own (``attnprobe_fn1``, ...) on demand.
PRIVATE_NAMES = {"sdpa": "attnprobe_sdp", "eager": "attnprobe_eager"}
BASE_OF = {private: base for base, private in PRIVATE_NAMES.items()}
#: Substrings of implementation names attnprobe does not wrap: kernels with their own dispatch,
#: cache layouts or hub loading, whose calls do not receive a plain (q, k, v, mask).
_NOT_WRAPPED = ("flash", "flex", "paged", "|", "/", ":")

_STRATEGY = "attention interface"
_LOCK = threading.Lock()
_WARNED: set = set()
#: Verdicts of ``_Recorder._scores_trusted``, kept across captures: module -> {(function, argument names, mask dtype,
#: weights dtype, heads, the module's plain attributes): verdict}. A function's math for one such key does not change
#: between captures, and judging it costs a softmax and four passes over (query x key) per layer (at 1 x 1,024
#: tokens, two thirds of what the eager forward itself costs), so a module is judged once per process, not once per
#: capture. Its plain attributes (numbers, flags, strings: the scaling, ``is_causal``, ``training``, GPT-2's scaling
#: switches) are part of the key, so a function whose math follows one of them is judged again when it changes.
_VERDICTS: weakref.WeakKeyDictionary[nn.Module, dict] = weakref.WeakKeyDictionary()


# --------------------------------------------------------------------------------------- classes
@dataclass(frozen=True)
class _ClassInfo:
    uses_interface: bool
    interface: Mapping[str, Callable] | None = None  # the ALL_ATTENTION_FUNCTIONS the forward reads (maybe file-local)
    eager: Callable | None = None  # the model file's own eager function (the dispatch default)


def _code_names(code) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _code_names(const)
    return names


_CLASS_INFO: dict[type, _ClassInfo] = {}
_EAGER: dict[type, Callable] = {}


def class_info(cls: type) -> _ClassInfo:
    """Whether ``cls.forward`` dispatches through the attention interface, and to what (read once per class).

    Memoised in a plain dict, not ``lru_cache``: the attention wrapper reads it inside compiled forwards."""
    info = _CLASS_INFO.get(cls)
    if info is None:
        info = _CLASS_INFO[cls] = _read_class_info(cls)
    return info


def _read_class_info(cls: type) -> _ClassInfo:
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
        fn = _EAGER.get(cls)
        return _eager_function(cls) if fn is None else fn
    interface = class_info(cls).interface
    if interface is None:  # the forward names ALL_ATTENTION_FUNCTIONS, but not as a global of its module
        raise UnsupportedModelError(
            f"{cls.__name__}.forward dispatches through an ALL_ATTENTION_FUNCTIONS that is not a global of its "
            f"module ({cls.__module__}), so attnprobe cannot tell which function it calls for {base!r}; exclude the "
            "module with layers=[...]"
        )
    return interface[base]


def _eager_function(cls: type) -> Callable:
    """The model file's own eager function (the dispatch default of ``cls``), which never changes."""
    fn = _EAGER[cls] = _find_eager_function(cls)
    return fn


def _find_eager_function(cls: type) -> Callable:
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
        # the token of `listen(module, "hf-call", ..., shared=True)`: channel 0, slot 0, i.e. id(module)
        deliver(id(module), "call", *_call_payload(fn, query, key, value, attention_mask, args, kwargs, result))
        return result

    attnprobe_attention.__qualname__ = attnprobe_attention.__name__ = f"attnprobe_over_{base}"
    return attnprobe_attention


#: keyword arguments of attention calls the record reads (numbers, then tensors), in the order ``deliver`` sends them
_NUMBER_ARGS = ("scaling", "is_causal", "dropout", "softcap", "sliding_window")
_TENSOR_ARGS = ("position_bias", "s_aux")
_PARAMS: dict[Callable, tuple[str, ...]] = {}  # attention function -> names of its parameters after the mask


def _call_payload(fn, q, k, v, mask, args: tuple, kwargs: dict, result) -> tuple[list, list]:
    """What one attention call hands to its recorders: traceable (no inspection, no branch on tensor values).

    tensors: q, k, v, mask, the output and weights the function returned, position_bias, s_aux;
    numbers: the values of ``_NUMBER_ARGS`` (nan: not given), then a bit per argument name that was given.
    """
    if args:  # positional extras after the mask, named by the function's signature (read outside any graph)
        names = _PARAMS.get(fn)
        if names is None and not torch.compiler.is_compiling():
            names = _PARAMS[fn] = tuple(list(inspect.signature(fn).parameters)[5:])
        kwargs = {**dict(zip(names or (), args)), **kwargs}
    out = result[0] if isinstance(result, tuple) and result else None
    weights = result[1] if isinstance(result, tuple) and len(result) > 1 else None
    given = sum(1 << i for i, name in enumerate(_NUMBER_ARGS + _TENSOR_ARGS) if kwargs.get(name) is not None)
    tensors = [
        q,
        k,
        v,
        mask,
        out if isinstance(out, torch.Tensor) else None,
        weights if isinstance(weights, torch.Tensor) else None,
        *(kwargs.get(n) for n in _TENSOR_ARGS),
    ]
    return tensors, [*(number(kwargs.get(n)) for n in _NUMBER_ARGS), float(given)]


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
        fn = hf_compat.mask_registry().get(base)
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else None
        raise UnsupportedModelError(
            f"the mask function registered for {base!r} ({getattr(fn, '__qualname__', fn)!r}) handed the attention "
            f"function a {type(mask).__name__}{'' if shape is None else f' of shape {shape}'}; attnprobe reads "
            f"4-D (batch, 1 or head={heads}, query={q_len}, key>={k_len}) bool or float masks only. Register "
            "the function with sdpa_mask or eager_mask, or capture with attn_implementation='sdpa'"
        )


# ------------------------------------------------------------------------------------ configs
def reachable_configs(model: nn.Module, modules, named: list | None = None) -> list:
    """Every config object the model's modules read, with all their sub-configs (each once); ``named``: the
    model's ``named_modules()``, if walked already."""
    PretrainedConfig = hf_compat.config_class()
    roots = [c for _, c in walk_of(model, named).configs] + [getattr(m, "config", None) for m in modules]
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
    held: list[object] = []  # the configs switched, for restore()

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
@dataclass
class _Call:
    """One attention call as ``_call_payload`` delivered it."""

    q: torch.Tensor  # (batch, head, query, d_head), after RoPE
    k: torch.Tensor  # (batch, kv_head, key, d_head)
    v: torch.Tensor
    mask: object  # what the function received: None, a 4-D bool or float tensor (or a custom function's object)
    out: torch.Tensor | None  # the function's output, (batch, query, head, d_head)
    weights: torch.Tensor | None  # the weights it returned (eager), (batch, head, query, key)
    kwargs: dict  # the keyword arguments the record reads, those that were given

    @classmethod
    def read(cls, tensors: list, numbers: list) -> _Call:
        q, k, v, mask, out, weights, *extra = tensors
        given = int(numbers[-1])
        names = _NUMBER_ARGS + _TENSOR_ARGS
        values = [value_of(x) for x in numbers[: len(_NUMBER_ARGS)]] + extra
        kwargs = {name: value for i, (name, value) in enumerate(zip(names, values)) if given >> i & 1}
        if "is_causal" in kwargs:
            kwargs["is_causal"] = bool(kwargs["is_causal"])
        return cls(q, k, v, mask, out, weights, kwargs)

    @property
    def mask_tensor(self) -> torch.Tensor | None:
        """The mask as a tensor (None: no mask). Only tensors come this far: the built-in bases hand over tensors and
        ``_check_mask`` refuses any other object a custom mask function makes."""
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


@dataclass(frozen=True)
class _Where:
    kind: str  # "self" or "cross"
    step: int | None
    offset: int
    query_padding: torch.Tensor | None


class _Recorder:
    """Turns the calls of one selected module into records for one capture session."""

    def __init__(
        self, session, site: Site, base: str, surroundings: Surroundings, masks: MaskMemo, stack: ExitStack
    ) -> None:
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
        self._fn: Callable | None = None
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
        self._kv_of_heads: tuple[int, ...] | None = None

    # -- helpers --------------------------------------------------------------------------
    def _sync_heads(self, heads: int, kv_heads: int) -> None:
        site = self.site
        if site.num_heads != heads or site.num_kv_heads != kv_heads:
            site.num_heads, site.num_kv_heads = heads, kv_heads
            self.session.select_site(site)
            self._kv_of_heads = None

    def _use(self, fn: Callable) -> None:
        """Describe the function this call ran (a user may register another one under the same name)."""
        self._fn = fn  # another function: its math is judged afresh (the verdicts are keyed by function)
        meta = {k: v for k, v in self.meta.items() if k != "base_function"}
        if self.base != "eager" and fn is not _sdpa_forward():
            meta["base_function"] = getattr(fn, "__qualname__", repr(fn))
        self.meta = meta

    # -- one call, in steps ---------------------------------------------------------------
    def receive(self, event: str, tensors: list, numbers: list) -> None:
        """One call of the module, as the attention wrapper delivered it (``_call_payload``); runs outside any
        compiled graph: after the graph's forward, with the tensors it computed, when the model is compiled."""
        if not self.site.selected or elsewhere(self.session.thread):
            return  # another thread's forward: its call is not this capture's
        call = _Call.read(tensors, numbers)
        fn = _base_function(type(self.module), self.base)
        if fn is not self._fn:
            self._use(fn)
        self._sync_heads(call.heads, call.kv_heads)
        semantics = self._semantics(call)
        mask_info = self._mask_info(call, semantics)
        where = self._position(call)
        observed = self._observed(call, semantics)
        values, identified, weights_source = self._tensors(call, semantics, mask_info, observed)
        if where.query_padding is not None:
            identified.add("query_padding")
        dtype = record_dtype(call.q.dtype, self.softmax_dtype)
        self.session.emit(
            self.site,
            kind=where.kind,
            **{"q": call.q, "k": call.k, "v": call.v, **values},  # q may be Lazy (``_q_shared``)
            allowed=None if mask_info is None else mask_info.allowed,
            query_padding=where.query_padding,
            causal=None if semantics.is_causal is None else bool(semantics.is_causal),
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
            meta=self._meta(call, semantics, where, dtype),
        )

    def _semantics(self, call: _Call) -> _Semantics:
        """What the backend was asked to compute: scaling, causality, dropout, bias, softcap, sinks, window."""
        module, base, kwargs = self.module, self.base, call.kwargs
        scaling = kwargs.get("scaling")
        is_causal = kwargs.get("is_causal")
        if is_causal is None:
            is_causal = getattr(module, "is_causal", True if self.style != "eager" else None)
        dropout = float(kwargs.get("dropout") or 0.0)
        if base == "eager" and not module.training:
            dropout = 0.0
        sliding = kwargs.get("sliding_window")
        return _Semantics(
            scaling=float(call.q.shape[-1] ** -0.5 if scaling is None else scaling),
            is_causal=is_causal,
            dropout=dropout,
            position_bias=kwargs.get("position_bias"),
            softcap=kwargs.get("softcap"),
            sinks=kwargs.get("s_aux") if base != "sdpa" else None,  # sdpa ignores s_aux; eager and others take it
            sliding_window=int(sliding) if sliding is not None and float(sliding).is_integer() else None,
        )

    def _mask_info(self, call: _Call, semantics: _Semantics):
        """The mask as the softmax saw it (shared by the layers that received the same mask); None for a statistics
        capture, which reads the mask block by block, never whole."""
        mask, q_len = call.mask, call.q_len
        if self.style == "custom":
            _check_mask(mask, self.base, batch=call.batch, heads=call.heads, q_len=q_len, k_len=call.k_len)
        if self.session.stats_only:
            return None
        implicit_causal = self._implicit_causal(call, semantics)
        return self.masks.get(
            mask, batch=call.batch, q_len=q_len, k_len=call.k_len, implicit_causal=implicit_causal, device=call.q.device
        )

    def _implicit_causal(self, call: _Call, semantics: _Semantics) -> bool:
        """sdpa's is_causal with no mask (aligned to the upper left)."""
        return self.style != "eager" and bool(semantics.is_causal) and call.mask is None and call.q_len > 1

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
        """The weights the function returned, when they are the softmax's (not sdpa's None, not after dropout)."""
        observed = call.weights
        if (
            self.base != "sdpa"
            and semantics.dropout == 0.0
            and observed is not None
            and tuple(observed.shape) == (call.batch, call.heads, call.q_len, call.k_len)
        ):
            return observed
        return None

    def _tensors(self, call: _Call, semantics: _Semantics, mask_info, observed) -> tuple[dict, set, str]:
        """The record's scores / weights / output (recomputed lazily where not observed), what was identified,
        and where the weights come from."""
        site, wants = self.site, self.session.wants
        values: dict = {}
        if self.recomputable and (wants(site, "scores") or (wants(site, "weights") and observed is None)):
            values.update(self._recomputed(call, semantics, mask_info, observed))
        output = call.per_head_output()  # (batch, head, query, d_head)
        if self.recomputable and wants(site, "stats"):
            values["stats"] = self._statistics(call, semantics, output)
        if observed is not None:
            values["weights"] = self._observed_weights(observed, call)
            weights_source = "observed"
        else:  # recomputed, kept or not; none when the function's math is not attnprobe's to redo
            weights_source = "recomputed" if self.recomputable else "none"
        identified = {"q", "k", "v", "allowed"} | ({"scores"} if "scores" in values else set())
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

    def _statistics(self, call: _Call, semantics: _Semantics, output: torch.Tensor | None) -> AttentionCall:
        """The call for the blockwise statistics engine, with its own mask (no (query x key) tensor)."""
        heads, _ = selected_heads(self.site)
        mask = call.mask_tensor  # (batch or 1, 1 or head, query or 1, key or more)
        return AttentionCall.for_heads(
            call.q,
            call.k,
            call.v,
            heads=heads,
            kv_heads=self._kv_heads(call),
            mask=None if mask is None else mask[..., : call.k_len],
            causal=self._implicit_causal(call, semantics),
            bias=semantics.position_bias,
            softcap=semantics.softcap,
            sinks=semantics.sinks,
            output=output,
            scaling=semantics.scaling,
            additive=self._additive(call, semantics),
        )

    def _kv_heads(self, call: _Call) -> tuple[int, ...]:
        """The key/value head each selected head reads (grouped-query attention), derived once per head count."""
        if self._kv_of_heads is None:
            heads, _ = selected_heads(self.site)
            self._kv_of_heads = kv_of_heads(heads, call.heads, call.kv_heads)
        return self._kv_of_heads

    def _additive(self, call: _Call, semantics: _Semantics) -> bool:
        """Whether the backend adds its mask to the logits (``finfo.min`` where masked) rather than masking them
        with ``-inf`` (see ``hooks/hf/recompute.py``)."""
        mask = call.mask_tensor
        float_mask = mask is not None and mask.dtype.is_floating_point
        return self.style == "eager" or semantics.position_bias is not None or float_mask

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
            }  # a sliding-window cache dropped keys
        if state is not None:
            meta = state.generation_meta(meta)
        module_scaling = getattr(module, "scaling", semantics.scaling)
        if semantics.scaling != module_scaling:
            meta = {**meta, "module_scaling": float(module_scaling)}  # e.g. Whisper scales q before the call
        if dtype != call.q.dtype:
            meta = {**meta, "softmax_dtype": str(dtype).removeprefix("torch.")}
        return meta

    def _scores_trusted(self, rec: Recompute, observed, kwargs: dict) -> bool:
        """Whether attnprobe's formula is what the backend computed.

        sdpa's semantics are known (it ignores unknown keyword arguments). A model file's eager
        function may do its own math: the first call of each module with each function, set of
        argument names, mask dtype, weights dtype, head selection and set of plain attribute values
        (``_VERDICTS``) compares the recomputed weights of the selected heads with the ones the
        function returned (before the budget check, once per process: the verdict is kept for later
        captures). In training mode with dropout there is nothing to
        compare with, and the formula every transformers eager function uses is assumed.
        """
        if self.base == "sdpa":
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
            self._attach_interface(session, model, sites, interface, surroundings, stack)
        if old_style and "weights" not in session.selection.keep:
            # the fallback records weights only: asking the model for output_attentions would keep every layer's
            # weights alive until it returns, for nothing
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

    def _attach_interface(self, session, model, sites, selected, surroundings, stack) -> None:
        bases = {id(s): self._check_site(s) for s in selected}
        switch_configs(reachable_configs(model, [s.module for s in sites], session.walk), stack)
        masks = MaskMemo()
        stack.callback(masks.clear)
        for site in selected:
            recorder = _Recorder(session, site, bases[id(site)], surroundings, masks, stack)
            listen(site.module, "hf-call", recorder.receive, stack, shared=True)  # the one wrapper serves every capture

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
