"""Functional interception: direct ``F.scaled_dot_product_attention`` calls and hand-written softmax attention.

Both are read through one ``torch.overrides.TorchFunctionMode`` that is active only while a capture is
open (it sees every torch call whatever the import alias, and returns the real function's result
untouched).

**Direct sdpa calls.** Each call site is found at run time and becomes a layer of its own: a site is one
module plus the source lines from its ``forward`` down to the call, so a loop calling sdpa on one line gives
one layer with several calls, and two calls on different lines give two layers. New sites get the next
layer numbers after the attention modules found before the run, in the order of their first call. Calls
made while a module another adapter reads is running (Hugging Face attention, ``nn.MultiheadAttention``,
attnprobe's own modules) are skipped, so no attention is recorded twice. The record has q, k, v and the
output as the call received/returned them, the mask (``allowed``), the causal flag, the scale (explicit or
default) and the weights recomputed for the selected heads only (``weights_source="recomputed"``).
``dropout`` is ``dropout_p`` as passed, since sdpa applies it whatever ``module.training`` says; a
``dropout_p > 0`` in eval mode is flagged (``meta["dropout_in_eval"]``) and warned. Once the mode is in (for
direct calls the code reading of ``code_reaches_sdpa`` found, or for tracing), every direct call is read; a
module named in ``modules=`` that calls sdpa has its first call site as its own layer.

**Hand-written attention** (opt-in: ``capture(model, modules=[...])`` or ``modules="auto"``) is traced:
see ``hooks/trace/recorder.py``. Named modules are layers found before the run (in module order with the others);
with ``"auto"`` every module is traced and each softmax attention found becomes a layer at run time.
Single-head modules kept in an ``nn.ModuleList``/``nn.ModuleDict`` and called in one forward of the
module named (or, with ``"auto"``, of the module holding the list) are the heads of one layer, in call order.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import math
import sys
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from ..probe.checks.lint import LINT_SAME_KV, LINT_UNREAD_MASK_BUFFER, lint_violation
from ..probe.engine.attention_math import AttentionCall, attention_logits, mask_allows
from ..probe.engine.kernel_lse import sdpa_with_lse
from ..probe.errors import AttnprobeError, SelectionError, warn_user
from ..probe.intent import Intent, module_intent
from ..probe.threads import elsewhere
from ..probe.walk import walk_of
from .base import Adapter, Lazy, Site, selected_heads
from .calls import bind_arguments
from .masks import MASKED_AT, Recomputed, additive_bias, compress_heads, forbids_future
from .modes import exit_mode
from .trace.read import EXPECTED, Finding, analyze
from .trace.recorder import Scope, Tracer, format_location

_SDPA = F.scaled_dot_product_attention
_SDPA_PARAMS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_SDPA_DEFAULTS = {"attn_mask": None, "dropout_p": 0.0, "is_causal": False, "scale": None, "enable_gqa": False}
_HERE = __file__
_CONTAINERS = (nn.ModuleList, nn.ModuleDict)


class _CaptureMode(TorchFunctionMode):
    """Sees every torch call while a capture is open; returns each call's own result."""

    def __init__(self, on_sdpa, tracer: Tracer | None, *, kernel_lse: bool = False) -> None:
        super().__init__()
        self.on_sdpa = on_sdpa
        self.tracer = tracer
        #: answer sdpa calls with ``sdpa_with_lse`` (sdpa's own kernel, bit for bit) and hand the lse on: a capture
        #: that keeps statistics then needs no pass to find each row's normaliser
        self.kernel_lse = kernel_lse

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if kwargs is None:
            kwargs = {}
        tracer = self.tracer
        before = tracer.before_op(func, args, kwargs) if tracer is not None else None
        bound = _bind_sdpa(args, kwargs) if func is _SDPA and self.kernel_lse and self.on_sdpa is not None else None
        lse = None
        if bound is not None:
            out, lse = sdpa_with_lse(**bound)
        else:
            out = func(*args, **kwargs)
        if func is _SDPA:
            if self.on_sdpa is not None:
                self.on_sdpa(args, kwargs, out, lse)
        elif tracer is not None:
            tracer.on_op(func, args, kwargs, out, before)
        return out


def _to4(t: torch.Tensor) -> torch.Tensor:
    """``(..., L, E)`` as sdpa takes it -> ``(batch, head, L, E)``."""
    if t.dim() == 2:
        return t[None, None]
    if t.dim() == 3:
        return t[:, None]
    if t.dim() == 4:
        return t
    return t.flatten(0, t.dim() - 4)


def _bind_sdpa(args, kwargs) -> dict | None:
    return bind_arguments(_SDPA_PARAMS, _SDPA_DEFAULTS, args, kwargs, required=3)


def _is_builtin(module: nn.Module) -> bool:
    """torch's own layers (Linear, Dropout, Softmax, LayerNorm, ...): opaque to the tracer."""
    return type(module).__module__.startswith("torch.") and not isinstance(module, (nn.Sequential, *_CONTAINERS))


def _may_call_sdpa(module: nn.Module, claimed: set[int]) -> bool:
    """Whether code under ``module`` could call scaled_dot_product_attention itself.

    torch's own ``nn`` layers reach it only through ``nn.MultiheadAttention``, which another adapter reads;
    for any other module class the code is read (``code_reaches_sdpa``). Reading the code keeps the function
    mode, which costs every torch call, off models such as Hugging Face ones whose attention is read elsewhere.
    """
    if id(module) in claimed:
        return False
    if _class_may_call_sdpa(type(module)):
        return True
    return any(_may_call_sdpa(child, claimed) for child in module.children())


def _class_may_call_sdpa(cls: type) -> bool:
    return not cls.__module__.startswith("torch.nn.") and code_reaches_sdpa(cls)


def _model_may_call_sdpa(model: nn.Module, claimed: set[int], walk: list | None) -> bool:
    """``_may_call_sdpa(model, claimed)``, answered from the capture's walk of the model when no class in it may
    call sdpa (the common case: a look at a few classes instead of a recursion over every module)."""
    if walk is not None and not any(map(_class_may_call_sdpa, walk_of(model, walk).classes)):
        return False
    return _may_call_sdpa(model, claimed)


_SDPA_NAME = "scaled_dot_product_attention"
_READ_LIMIT = 20_000  # code objects and containers read per class; past it the class counts as reaching sdpa
_CONTAINER_LIMIT = 1_000  # larger dicts/lists/tuples are data, not tables of functions: not read
_CODE_LIKE = (staticmethod, classmethod, property, functools.partial, dict, list, tuple)


def _is_torch_code(func) -> bool:
    return (getattr(func, "__module__", None) or "").startswith("torch.")


def _queue(todo: list, values) -> None:
    """Queue the values that may lead to code: functions, methods, partials, containers, sdpa itself."""
    todo.extend(
        v for v in values if v is _SDPA or inspect.isfunction(v) or inspect.ismethod(v) or isinstance(v, _CODE_LIKE)
    )


@functools.cache
def code_reaches_sdpa(cls: type) -> bool:
    """Whether the code of ``cls`` may call ``scaled_dot_product_attention``, read without running it.

    Starting from the class attributes of ``cls`` and its bases (methods, static/class methods,
    properties, and plain attributes such as ``attn_fn = F.scaled_dot_product_attention``), it follows:
    the names a function's code uses, looked up in its globals (functions in any module, and
    ``helpers.attend`` / ``Helpers.attend`` attributes of imported modules and classes); closures and
    ``__wrapped__`` (decorators); ``functools.partial`` objects; dicts, lists and tuples of functions
    (``ATTENTION = {"sdpa": ...}``).
    It is True when it meets the function itself, its name among the names a code object uses (any
    ``F.`` / ``torch.nn.functional.`` spelling) or the string ``"scaled_dot_product_attention"`` as a
    constant (``getattr(F, "scaled_dot_product_attention")``).

    Not seen: a function that reaches the model only at run time (passed as an argument, set on an
    instance from outside the class's code, ``torch.ops.aten`` calls); ``capture(..., modules="auto")``
    installs the interception whatever the code reading says.
    """
    seen: set[int] = set()
    todo: list = []
    for klass in cls.__mro__:
        if klass.__module__.startswith(("torch.", "builtins")):
            continue
        _queue(todo, vars(klass).values())
    looked = 0
    while todo:
        value = todo.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        looked += 1
        if looked > _READ_LIMIT:
            return True  # too much code to read: better the interception than a missed call
        if value is _SDPA:
            return True
        if isinstance(value, (staticmethod, classmethod)) or inspect.ismethod(value):
            _queue(todo, (value.__func__,))
        elif isinstance(value, property):
            _queue(todo, (value.fget, value.fset))
        elif isinstance(value, functools.partial):
            _queue(todo, (value.func, *value.args, *value.keywords.values()))
        elif isinstance(value, dict) and dict.__len__(value) <= _CONTAINER_LIMIT:
            # the entries stored, not an overridden values(): transformers' lazy CONFIG_MAPPING imports every
            # model's config module when asked for its values (6 s, and ~800 modules, for EncoderDecoderModel)
            _queue(todo, dict.values(value))
        elif isinstance(value, (list, tuple)) and len(value) <= _CONTAINER_LIMIT:
            _queue(todo, value)
        elif inspect.isfunction(value) and not _is_torch_code(value) and _function_reaches(value, todo):
            return True
    return False


def _function_reaches(func, todo: list) -> bool:
    """Whether ``func``'s own code names sdpa; queues what it refers to (globals, closure, wrapped)."""
    cells = []
    for cell in func.__closure__ or ():
        with contextlib.suppress(ValueError):  # an empty cell has no contents
            cells.append(cell.cell_contents)
    _queue(
        todo,
        (getattr(func, "__wrapped__", None), *cells, *(func.__defaults__ or ()), *(func.__kwdefaults__ or {}).values()),
    )
    names: set[str] = set()
    codes = [func.__code__]
    while codes:
        code = codes.pop()
        for const in code.co_consts:
            if inspect.iscode(const):
                codes.append(const)
            elif const == _SDPA_NAME:  # getattr(F, "scaled_dot_product_attention")
                return True
        names.update(code.co_names)
    if _SDPA_NAME in names:
        return True
    scope = func.__globals__
    for name in names:
        target = scope.get(name)
        if target is None:
            continue
        if inspect.ismodule(target):  # helpers.attend(...): the module's attributes named in this code
            if target.__name__ == "torch" or target.__name__.startswith("torch."):
                continue
            _queue(todo, (vars(target).get(n) for n in names))
        elif inspect.isclass(target):  # Helpers.attend(...): the class's own attributes named in this code
            if not target.__module__.startswith(("torch.", "builtins")):
                _queue(todo, (vars(target).get(n) for n in names))
        else:
            _queue(todo, (target,))
    return False


def _tensor_ids(value, found: set[int] | None = None) -> set[int]:
    found = set() if found is None else found
    if isinstance(value, torch.Tensor):
        found.add(id(value))
    elif isinstance(value, (list, tuple)):
        for v in value:
            _tensor_ids(v, found)
    elif isinstance(value, dict):
        for v in value.values():
            _tensor_ids(v, found)
    return found


def _pick(t: torch.Tensor, index) -> torch.Tensor:
    return t if list(index) == list(range(t.shape[1])) else t[:, list(index)]


class FunctionalAdapter(Adapter):
    """Direct ``scaled_dot_product_attention`` calls (always) and hand-written softmax attention (opt-in).

    ``modules``: None (no hand-written tracing), ``"auto"`` (trace every module), or modules of the model /
    their names from ``model.named_modules()`` to trace. A ``ModuleList``/``ModuleDict`` stands for the
    module holding it.
    """

    name = "functional"
    dynamic = True

    def __init__(self, modules=None) -> None:
        self.modules = modules
        self.auto = False
        self._named_ids: frozenset[int] = frozenset()
        self._walk: list | None = None  # the capture's walk of the model, from find_named to may_find_more (only)

    def find_named(self, model: nn.Module, named: list, claimed: set[int]) -> list[Site]:
        self._walk = named
        return self.find(model, claimed)

    def find(self, model: nn.Module, claimed: set[int]) -> list[Site]:
        named = self._resolve(model)
        self._named_ids = frozenset(id(m) for _, m in named)
        return [
            Site(name, m, self, info={"strategy": "traced softmax (named)"})
            for name, m in named
            if id(m) not in claimed
        ]

    def may_find_more(self, model: nn.Module, claimed: set[int]) -> bool:
        """True with ``modules="auto"``, with modules named (one of them may hold several softmax attentions or
        call sdpa: each is a layer of its own), or when code of the model may call sdpa. ``claimed`` holds the
        ids of every site found, this adapter's named modules included: those are still read here."""
        walk, self._walk = self._walk, None  # not kept: the adapter outlives the capture, the model may not
        if self.auto or self._named_ids:
            return True
        return _model_may_call_sdpa(model, claimed, walk)

    def traced_ids(self, model: nn.Module) -> set[int]:
        """Ids of the modules named in ``modules=`` and of everything inside them: the user asked for their code
        to be traced, so an adapter reading less of them (the Hugging Face output_attentions fallback) leaves them."""
        return {id(m) for _, named in self._resolve(model) for m in named.modules()}

    def _resolve(self, model: nn.Module) -> list[tuple[str, nn.Module]]:
        spec = self.modules
        self.auto = isinstance(spec, str) and spec == "auto"
        if spec is None or self.auto:
            return []
        if isinstance(spec, (str, nn.Module)):
            spec = [spec]
        elif not isinstance(spec, (list, tuple, set)):
            raise SelectionError(
                f"modules= takes 'auto' or a list of modules of the model (or their names from "
                f"model.named_modules()), got {type(spec).__name__}"
            )
        by_name = dict(model.named_modules())
        name_of = {id(m): n for n, m in model.named_modules()}
        owner_of = {id(c): m for m in model.modules() for c in m.children()}
        found: dict[int, tuple[str, nn.Module]] = {}
        for item in spec:
            if isinstance(item, str):
                if item not in by_name:
                    near = [n for n in by_name if n and (item in n or n.endswith(item.split(".")[-1]))][:5]
                    problem = f"{item!r} is not a module of {type(model).__name__}"
                    hint = "names come from model.named_modules()" + (f", e.g. {near}" if near else "")
                    raise SelectionError(
                        f"modules=: {problem}; {hint}",
                        problem=problem,
                        hint=hint,
                        argument="modules",
                        value=item,
                        choices=near,
                    )
                module = by_name[item]
            elif isinstance(item, nn.Module):
                if id(item) not in name_of:
                    raise SelectionError(
                        f"modules=: the {type(item).__name__} given is not a submodule of {type(model).__name__} "
                        "(pass modules of the model being captured, or their names)"
                    )
                module = item
            else:
                raise SelectionError(f"modules= items must be modules of the model or their names, got {item!r}")
            if isinstance(module, _CONTAINERS):
                holder = owner_of.get(id(module))
                if holder is None:
                    problem = f"{item!r} is a {type(module).__name__} at the root"
                    hint = "name a module with a forward"
                    raise SelectionError(
                        f"modules=: {problem}; {hint}", problem=problem, hint=hint, argument="modules", value=item
                    )
                module = holder
            found.setdefault(id(module), (name_of[id(module)], module))
        return list(found.values())

    def attach(self, session, model: nn.Module, sites: list[Site], stack: ExitStack) -> None:
        self._walk = None  # in case may_find_more was not asked
        selection = session.selection
        if selection.idle:
            return
        n_static = len(session.sites)
        dynamic = selection.layers is None or any(layer >= n_static for layer in selection.layers)
        roots = [model] if (self.auto and dynamic) else [s.module for s in sites if s.selected or dynamic]
        claimed = {id(s.module) for s in session.sites if s.adapter is not self}
        sdpa = dynamic and (self.auto or _model_may_call_sdpa(model, claimed, session.walk))
        if (sdpa or roots) and session.compiled:
            _skip_compiled(session, model)
            return
        if sdpa or roots:  # otherwise nothing this adapter could record: stay out of the way (no function mode)
            # once the mode is in, every direct sdpa call is read (the code reading may have missed some)
            _Run(self, session, model, sites, claimed).start(stack, roots=roots)


def _skip_compiled(session, model: nn.Module) -> None:
    """Say, before the forward, that compiled code is not read here (and attach nothing): the torch function mode
    and the tracer run Python on every torch call, which a compiled graph cannot hold without breaking it."""
    where = ", ".join(session.compiled[:3])
    message = (
        f"{type(model).__name__} is compiled with torch.compile ({where}): direct scaled_dot_product_attention calls "
        "and hand-written softmax attention are read by a torch function mode and a tracer that cannot run inside "
        "a compiled graph. Capture the module before compilation (`compiled._orig_mod`, or the module before "
        "`.compile()`); attention modules attnprobe knows (Hugging Face, its own, nn.MultiheadAttention) are "
        "captured from compiled code"
    )
    warn_user(message + "; such calls are not recorded")


_TENSOR_FIELDS = ("q", "k", "v", "scores", "weights", "output", "allowed")


def _stacked_fields(site: Site, group: list[Finding]) -> dict[str, object]:
    """The tensor fields of single-head findings stacked as the heads of one record (the selected heads, made on
    first use); a field one of them lacks is None."""
    fields: dict[str, object] = {}
    heads, kv_heads = selected_heads(site)
    for name in _TENSOR_FIELDS[:-1]:
        parts = [getattr(f, name) for f in group]
        if any(p is None for p in parts):
            fields[name] = None
            continue
        chosen = [parts[h] for h in (kv_heads if name in ("k", "v") else heads)]
        fields[name] = Lazy(
            (chosen[0].shape[0], len(chosen), *chosen[0].shape[2:]), chosen[0].dtype, partial(torch.cat, chosen, dim=1)
        )
    masks = [f.allowed for f in group if f.allowed is not None]  # (batch, 1, query, key) each, one per head
    fields["allowed"] = compress_heads(torch.cat(masks, dim=1)) if len(masks) == len(group) else None
    return fields


# -- direct scaled_dot_product_attention calls: one call in the record layout ----------------------------------
@dataclass
class _SdpaCall:
    """One ``scaled_dot_product_attention`` call laid out as the record lays it out (sdpa's broadcasting applied)."""

    module: nn.Module  # the module whose forward made the call
    site_key: tuple  # (id(module), the source lines from its forward down to the call)
    bound: dict  # the call's arguments by name (``_SDPA_PARAMS``)
    q: torch.Tensor  # (batch, head, query, d_head)
    k: torch.Tensor  # (batch, kv_head, key, d_head)
    v: torch.Tensor  # (batch, kv_head, key, d_v)
    output: torch.Tensor | None  # (batch, head, query, d_v): what sdpa returned
    full: tuple[int, ...]  # (*lead, query, key): the shape sdpa broadcasts the mask to
    lse: torch.Tensor | None = None  # (batch, head, query): each row's logsumexp from sdpa's own kernel, if read

    @classmethod
    def of(cls, module: nn.Module, site_key: tuple, bound: dict, out) -> _SdpaCall:
        """From the arguments as sdpa took them: ``(..., L, E)`` of 2 to N axes each."""
        query, key = bound["query"], bound["key"]
        q = _to4(query)  # (batch, head, query, d_head)
        k, v = _to4(key), _to4(bound["value"])  # (batch or 1, kv_head, key, d_head)
        if k.shape[0] == 1 and q.shape[0] > 1:  # k, v broadcast over the batch
            k, v = k.expand(q.shape[0], *k.shape[1:]), v.expand(q.shape[0], *v.shape[1:])  # (batch, kv_head, key, d)
        q_lead, k_lead = list(query.shape[:-2]), list(key.shape[:-2])
        if q_lead and k_lead:
            k_lead[-1] = q_lead[-1]  # grouped-query attention: fewer key heads than query heads
        full = (*torch.broadcast_shapes(q_lead, k_lead), q.shape[2], k.shape[2])  # (*lead, query, key)
        output = _to4(out) if isinstance(out, torch.Tensor) else None  # (batch, head, query, d_v)
        return cls(module, site_key, bound, q, k, v, output, full)

    @property
    def shape(self) -> tuple[int, int, int, int]:
        """``(batch, head, query, key)``."""
        return (self.q.shape[0], self.q.shape[1], self.q.shape[2], self.k.shape[2])

    @property
    def kind(self) -> str:
        return "self" if self.q.shape[2] == self.k.shape[2] else "cross"

    @property
    def mask(self) -> torch.Tensor | None:
        """``attn_mask`` as passed: bool (True = attend) or float (added to the scores)."""
        return self.bound["attn_mask"]

    @property
    def causal(self) -> bool:
        return bool(self.bound["is_causal"])

    @property
    def scale(self) -> float:
        """The factor sdpa applied to ``q @ k^T``: ``scale`` as passed, else ``1 / sqrt(d_head)``."""
        scale = self.bound["scale"]
        return scale if scale is not None else 1.0 / math.sqrt(self.q.shape[-1])

    def kv_of(self, heads: tuple[int, ...]) -> tuple[int, ...]:
        """The key/value head each of ``heads`` reads (grouped-query attention)."""
        group = self.q.shape[1] // self.k.shape[1]
        return tuple(h // group for h in heads)

    def mask_4d(self) -> torch.Tensor | None:
        """The mask broadcast as sdpa broadcasts it, ``(batch, 1 or head, query, key)`` (a view)."""
        mask = self.mask
        return None if mask is None else _to4(mask.expand(torch.broadcast_shapes(mask.shape, self.full)))

    def passes_same_kv(self) -> bool:
        """Whether the same tensor was passed as key and value (lint_same_kv)."""
        k, v = self.k, self.v
        return self.bound["key"] is self.bound["value"] or (
            k.shape == v.shape and ((k.data_ptr() == v.data_ptr() and k.stride() == v.stride()) or torch.equal(k, v))
        )


def _sdpa_allowed(call: _SdpaCall) -> torch.Tensor:
    """``(batch, 1 or head, query, key)`` bool, True = may attend: the mask (a float one masks at or below
    ``MASKED_AT``) and ``is_causal`` combined; a view of the mask where it can be."""
    B, _, L, S = call.shape
    device, mask = call.q.device, call.mask
    if mask is not None:
        allowed = mask if mask.dtype == torch.bool else mask > MASKED_AT
        allowed = _to4(allowed.expand(torch.broadcast_shapes(allowed.shape, call.full)))  # (batch, 1 or head, L, S)
    else:
        allowed = torch.ones(1, 1, L, S, dtype=torch.bool, device=device).expand(B, 1, L, S)  # (batch, 1, L, S)
    if call.causal:
        allowed = allowed & torch.ones(L, S, dtype=torch.bool, device=device).tril()  # (batch, 1 or head, L, S)
    if allowed.shape[1] > 1 and allowed.stride(1) == 0:
        allowed = allowed[:, :1]  # every head has the same mask: (batch, 1, query, key)
    return allowed.expand(B, allowed.shape[1], L, S)  # (batch, 1 or head, query, key)


def _sdpa_scores(call: _SdpaCall, heads: tuple[int, ...]) -> torch.Tensor:
    """``(batch, head, query, key)`` for ``heads``, a new tensor: ``q @ k^T * scale`` (``attention_logits``), plus
    the non-masking part of a float mask (ALiBi)."""
    k = call.k[:, list(call.kv_of(heads))]  # (batch, head, key, d_head): the kv head each selected head reads
    s = attention_logits(_pick(call.q, heads), k, scaling=call.scale)  # (batch, head, query, key)
    mask = call.mask_4d()  # (batch, 1 or head, query, key)
    if mask is None or mask.dtype == torch.bool:
        return s
    bias = additive_bias(mask[:, :1] if mask.shape[1] == 1 or mask.stride(1) == 0 else _pick(mask, heads))
    # added here, out of place, with torch's type promotion: sdpa takes a float32 mask beside bfloat16 q, and
    # attention_logits(bias=) would round that mask to the logits' dtype first
    return s if bias is None else s + bias  # (batch, head, query, key) + (batch, 1 or head, query, key)


def _sdpa_stats(call: _SdpaCall, heads: tuple[int, ...]) -> AttentionCall:
    """The call for the blockwise statistics engine (no (query x key) tensor)."""
    return AttentionCall.for_heads(
        call.q,
        call.k,
        call.v,
        heads=heads,
        kv_heads=call.kv_of(heads),
        mask=call.mask_4d(),
        masked_at=MASKED_AT,
        causal=call.causal,
        scaling=float(call.scale),
        output=call.output,
        lse=call.lse if call.lse is not None and call.lse.shape == call.q.shape[:3] else None,
    )


class _Run:
    """One capture session's functional interception."""

    def __init__(
        self, adapter: FunctionalAdapter, session, model: nn.Module, sites: list[Site], claimed: set[int]
    ) -> None:
        self.adapter, self.session = adapter, session
        self.model: nn.Module | None = model  # until the capture closes: it must not keep the model alive
        self.owner = session.thread  # module hooks of other threads' forwards do nothing (the mode is per thread)
        self._names: dict[int, str] | None = None
        self.claimed = claimed
        self.named = {id(s.module): s for s in sites}
        self.ran: dict[int, int] = {}
        self.sdpa_sites: dict[tuple, Site] = {}
        self.traced_sites: dict[tuple, Site] = {}
        self.warned: set = set()
        self.tracer: Tracer | None = None
        self.owner_of: dict[int, nn.Module] = {}
        self.failed = False  # a traced forward raised (the session closes our stack without the exception)
        self.intents: dict[int, Intent | None] = {}  # id(module) -> what it declares (probe/intent.py)

    @property
    def names(self) -> dict[int, str]:
        """Module paths by module id (built on first need: most captures never need it)."""
        if self._names is None:
            self._names = {} if self.model is None else {id(m): n for n, m in self.model.named_modules()}
        return self._names

    # -- setup -----------------------------------------------------------------------------
    def start(self, stack: ExitStack, *, roots: list[nn.Module]) -> None:
        """Push the function mode (direct sdpa calls) and trace the module trees under ``roots``."""
        model = self.model
        if roots and model is not None:
            self.tracer = Tracer()
            self.owner_of = {id(c): m for m in model.modules() for c in m.children()}
            seen: set[int] = set()
            for root in roots:
                self._hook_tree(root, stack, seen)
        mode = _CaptureMode(self._on_sdpa, self.tracer, kernel_lse="stats" in self.session.selection.keep)
        mode.__enter__()
        stack.callback(exit_mode, mode, dispatch=False)  # ours, also when it is no longer on top of the stack
        stack.push(self._close)

    def _hook_tree(self, module: nn.Module, stack: ExitStack, seen: set[int]) -> None:
        if id(module) in seen:
            return
        seen.add(id(module))
        opaque = id(module) in self.claimed or _is_builtin(module)
        handles = (
            module.register_forward_pre_hook(partial(self._enter, traced=not opaque)),
            module.register_forward_hook(self._exit, with_kwargs=True, always_call=True),
        )
        for h in handles:
            stack.callback(h.remove)
        if not opaque:
            for child in module.children():
                self._hook_tree(child, stack, seen)

    def _close(self, exc_type, exc, tb) -> bool:
        try:
            if exc_type is None and not self.failed:
                for site in self.named.values():
                    produced = site.calls or any(key[0] == id(site.module) for key in self.traced_sites)
                    if self.ran.get(id(site.module)) and not produced:
                        warn_user(
                            f"modules=: {site.name!r} ({type(site.module).__name__}) ran but attnprobe found no "
                            "softmax attention in it; it reads softmax(q @ k^T ...) written with matmul/bmm/einsum and "
                            "F.softmax/torch.softmax/Tensor.softmax/nn.Softmax (direct scaled_dot_product_attention "
                            "calls are recorded on their own)"
                        )
        finally:
            self.model = self.session = self.tracer = None  # the capture must not keep the model alive
            self.named, self.owner_of, self._names = {}, {}, {}
        return False

    def _warn_once(self, key, message: str) -> None:
        if key not in self.warned:
            self.warned.add(key)
            warn_user(message)

    # -- direct scaled_dot_product_attention calls --------------------------------------------
    def _on_sdpa(self, args, kwargs, out, lse=None) -> None:
        try:
            with torch._C.DisableTorchFunction():
                self._record_sdpa(args, kwargs, out, lse)
        except AttnprobeError:
            raise
        except Exception as exc:  # never break the model's forward over a reading problem
            self._warn_once(
                ("sdpa-error", type(exc).__name__),
                f"attnprobe could not read a scaled_dot_product_attention call ({type(exc).__name__}: {exc}); "
                "the model ran unchanged, that call is not in the capture",
            )

    def _locate(self):
        """(module, site key) of the sdpa call being handled, or None (outside the model, or claimed)."""
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename == _HERE:
            frame = frame.f_back
        chain: list[tuple[str, int]] = []
        module = None
        while frame is not None:
            code = frame.f_code
            if module is None:
                chain.append((code.co_filename, frame.f_lineno))
            if code.co_argcount and code.co_varnames[0] == "self":
                obj = frame.f_locals.get("self")
                if isinstance(obj, nn.Module):
                    if id(obj) in self.claimed:
                        return None
                    if module is None and id(obj) in self.names:
                        module = obj
                    if obj is self.model:
                        break
            frame = frame.f_back
        if module is None:
            return None
        return module, (id(module), tuple(chain))

    def _record_sdpa(self, args, kwargs, out, lse=None) -> None:
        call = self._read_sdpa(args, kwargs, out)
        if call is None:
            return
        call.lse = lse
        site = self._sdpa_site(call)
        if site.selected:
            self._emit_sdpa(call, site)
        else:
            self.session.emit(site, kind=call.kind)

    def _read_sdpa(self, args, kwargs, out) -> _SdpaCall | None:
        """The call being handled, in the record layout; None when it is not the model's to record (outside the
        model, inside a module another adapter reads) or cannot be read (warned)."""
        where = self._locate()
        if where is None:
            return None
        module, site_key = where
        bound = _bind_sdpa(args, kwargs)
        if bound is None or not all(
            isinstance(t, torch.Tensor) and not t.is_nested and t.dim() >= 2
            for t in (bound["query"], bound["key"], bound["value"])
        ):
            self._warn_once(
                ("sdpa-args", site_key),
                f"a scaled_dot_product_attention call in {self.names[id(module)]!r} has "
                "arguments attnprobe cannot read (nested tensors?); it is not in the capture",
            )
            return None
        call = _SdpaCall.of(module, site_key, bound, out)
        heads, kv_heads = call.q.shape[1], call.k.shape[1]
        if heads % kv_heads:  # one query head broadcast against several key heads: a record has no such layout
            self._warn_once(
                ("sdpa-heads", site_key),
                f"a scaled_dot_product_attention call in {self.names[id(module)]!r} has {heads} query head(s) and "
                f"{kv_heads} key/value heads (q {tuple(call.q.shape)}, k {tuple(call.k.shape)}), which do not "
                "divide: attnprobe records each key/value head read by a whole group of query heads only; the model "
                "ran unchanged, these calls are not in the capture (give q as many heads as k, e.g. q.expand)",
            )
            return None
        return call

    def _sdpa_site(self, call: _SdpaCall) -> Site:
        """The layer of the call's site, made on its first call (or a module named in ``modules=``: its first call
        site is its layer), with its head counts."""
        _, heads, _, _ = call.shape
        kv_heads = call.k.shape[1]
        site = self.sdpa_sites.get(call.site_key)
        if site is None:
            at = format_location(call.site_key[1][0])
            static = self.named.get(id(call.module))
            if static is not None and not ({"softmax_at", "sdpa_at"} & static.info.keys()):
                site = static
                site.info["sdpa_at"] = at
            else:
                name = self.names[id(call.module)]
                info = {"strategy": "sdpa call", "sdpa_at": at}
                site = Site(name, call.module, self.adapter, heads, kv_heads, info=info)
                self.session.add_site(site)
            self.sdpa_sites[call.site_key] = site
        if site.num_heads is None:
            site.num_heads, site.num_kv_heads = heads, kv_heads
            self.session.select_site(site)
        return site

    def _emit_sdpa(self, call: _SdpaCall, site: Site) -> None:
        """The record of one call of a selected layer: q, k, v, the mask and the output as sdpa took and gave them,
        the scores and weights of the selected heads recomputed on first use."""
        session, (heads, _) = self.session, selected_heads(site)
        B, _, L, S = call.shape
        # a statistics capture never builds a (query, key) mask: the engine reads the call's own mask in blocks
        allowed = None if session.stats_only else _sdpa_allowed(call)  # (batch, 1 or head, query, key)

        def allowed_of_heads() -> torch.Tensor:
            mask = allowed if allowed is not None else _sdpa_allowed(call)  # (batch, 1 or head, query, key)
            return mask if mask.shape[1] == 1 else _pick(mask, heads)  # (batch, 1 or head, query, key)

        recomputed = Recomputed(
            partial(_sdpa_scores, call, heads), allowed_of_heads, keep_scores=session.wants(site, "scores")
        )
        mask = call.mask
        declared_causal = mask is not None and forbids_future(
            mask_allows(mask, MASKED_AT) if allowed is None else allowed
        )
        # sdpa applies dropout_p whatever module.training says: record it as applied, and flag it in eval mode
        dropout = float(call.bound["dropout_p"])
        dropout_in_eval = dropout > 0 and not call.module.training
        record = session.emit(
            site,
            kind=call.kind,
            q=call.q,
            k=call.k,
            v=call.v,
            scores=Lazy((B, len(heads), L, S), call.q.dtype, recomputed.scores),
            weights=Lazy((B, len(heads), L, S), call.q.dtype, recomputed.weights),
            output=call.output,
            allowed=allowed,
            causal=call.causal or declared_causal,
            scaling=float(call.scale),
            backend="sdpa",
            stats=_sdpa_stats(call, heads) if session.wants(site, "stats") else None,
            dtype=call.q.dtype,
            weights_source="recomputed",
            dropout=dropout,
            identified=frozenset({"q", "k", "v", "scores", "weights", "output", "allowed"}),
            meta=self._sdpa_meta(call, site, dropout_in_eval),
        )
        if record is not None:
            self._warn_lints(record.meta["lint"])
            if dropout_in_eval:
                self._warn_eval_dropout(
                    site,
                    f"scaled_dot_product_attention got dropout_p={dropout:g}",
                    "sdpa applies dropout_p whatever module.training says; pass dropout_p=p if self.training else 0.0",
                )

    @staticmethod
    def _sdpa_meta(call: _SdpaCall, site: Site, dropout_in_eval: bool) -> dict:
        message = "the same tensor is passed to scaled_dot_product_attention as key and value"
        lints = (
            (lint_violation(LINT_SAME_KV, name=site.name, layer=site.layer, call=site.calls, message=message),)
            if call.passes_same_kv()
            else ()
        )
        return {
            "module_class": type(call.module).__name__,
            "sdpa_at": site.info["sdpa_at"],
            "dropout_in_eval": dropout_in_eval,
            "scale": "explicit" if call.bound["scale"] is not None else "default",
            "enable_gqa": bool(call.bound["enable_gqa"]),
            "kind_from": "lengths",
            "lint": lints,
        }

    def _warn_eval_dropout(self, site: Site, what: str, why: str) -> None:
        self._warn_once(
            ("eval-dropout", site.layer),
            f"layer {site.layer} ({site.name!r}): {what} while {type(site.module).__name__} is in eval mode, "
            f"so the output is randomly dropped ({why}); the record's dropout says so, its weights are "
            "before dropout and record.meta['dropout_in_eval'] is True",
        )

    def _warn_missing(self, site: Site, missing: dict[str, str]) -> None:
        """One warning per layer whose record lacks fields a traced record normally has, saying where and why."""
        by_reason: dict[str, list[str]] = {}
        for name in EXPECTED:
            if name in missing:
                by_reason.setdefault(missing[name], []).append(name)
        if len(by_reason) == 1:
            why = next(iter(by_reason))
        else:
            why = "; ".join(f"{', '.join(names)}: {reason}" for reason, names in by_reason.items())
        fields = ", ".join(n for n in EXPECTED if n in missing)
        self._warn_once(
            ("missing", site.layer),
            f"layer {site.layer} ({site.name!r}): the record has no {fields}: {why}; check() skips what "
            "needs them and lists it in CheckResult.skipped (record.meta['missing'] says why per field)",
        )

    def _warn_lints(self, violations) -> None:
        for v in violations:
            self._warn_once(("lint", v.layer, v.check), f"{v.check} in layer {v.layer} ({v.name!r}): {v.message}")

    # -- hand-written attention: module scopes ---------------------------------------------------
    def _enter(self, module: nn.Module, args, *, traced: bool) -> None:
        if self.tracer is None or elsewhere(self.owner):
            return
        if id(module) in self.named:
            self.ran[id(module)] = self.ran.get(id(module), 0) + 1
        self.tracer.enter(module, traced)

    def _exit(self, module: nn.Module, args, kwargs, output):
        tracer = self.tracer
        if tracer is None or elsewhere(self.owner):
            return None
        scope = tracer.exit(module)
        if output is None:
            self.failed = True  # the forward raised: nothing to read
        if scope is None or output is None:
            return None
        try:
            with torch._C.DisableTorchFunction():
                if scope.traced and scope.softmaxes:
                    returned = _tensor_ids(output)
                    unread = self._unread_mask_buffers(scope)
                    for softmax in scope.softmaxes:
                        finding = analyze(scope, softmax, returned)
                        if finding is not None:
                            finding.lints.extend(unread)
                            self._route(finding, scope, tracer.stack)
                parent = tracer.current()
                if parent is not None and parent.traced:
                    parent.add_module_call(module, args, kwargs, output)
                if scope.findings:
                    self._emit_groups(module, scope.findings)
        except AttnprobeError:
            raise
        except Exception as exc:  # never break the model's forward over a reading problem
            self._warn_once(
                ("trace-error", id(module)),
                f"attnprobe could not read the attention in {self.names.get(id(module), '?')!r} "
                f"({type(exc).__name__}: {exc}); the model ran unchanged",
            )
        finally:
            scope.nodes.clear()
            scope.producer.clear()
        return None

    def _unread_mask_buffers(self, scope) -> list[tuple[str, str]]:
        """``lint_unread_mask_buffer`` findings: causal mask buffers of the scope's module that its forward never
        read (no torch call of the scope took them), unless the module says it is not causal."""
        module = scope.module
        if id(module) not in self.intents:
            self.intents[id(module)] = module_intent(module)
        intent = self.intents[id(module)]
        if intent is None or intent.causal is False or not intent.mask_buffers:
            return []
        read = {id(t) for node in scope.nodes for t in node.inputs}
        return [
            (
                LINT_UNREAD_MASK_BUFFER,
                f"{b.declaration()} holds a causal mask ({b.description}) but {type(module).__name__}.forward never "
                f"reads it: the mask is not applied (e.g. att = att.masked_fill(self.{b.name}[..., :T, :T] == 0, "
                "float('-inf')))",
            )
            for b in intent.mask_buffers
            if id(b.tensor) not in read
        ]

    def _route(self, finding: Finding, scope: Scope, stack: list[Scope]) -> None:
        """Hand a finding to the scope of the module its layer belongs to (``stack``: the tracer's open scopes)."""
        module = scope.module
        if self.adapter.auto:
            holder = self.owner_of.get(id(module))
            owner = module
            if finding.heads == 1 and isinstance(holder, _CONTAINERS):
                owner = self.owner_of.get(id(holder), module)
        else:
            owner = (
                module
                if id(module) in self.named
                else next((s.module for s in reversed(stack) if id(s.module) in self.named), module)
            )
        target = scope if owner is module else next((s for s in reversed(stack) if s.module is owner), scope)
        target.findings.append(finding)

    def _emit_groups(self, owner: nn.Module, findings: list[Finding]) -> None:
        groups: list[list[Finding]] = []
        latest: dict[tuple, list[Finding]] = {}
        for f in findings:
            group = latest.get(f.key)
            if group is not None and self._stacks_onto(group, f, owner):
                group.append(f)
            else:
                group = [f]
                groups.append(group)
                latest[f.key] = group
        for group in groups:
            self._emit_group(owner, group)

    @staticmethod
    def _stacks_onto(group: list[Finding], f: Finding, owner: nn.Module) -> bool:
        """Single-head attentions from distinct submodules, same shapes: heads of one layer."""
        first = group[0]
        return (
            f.heads == 1
            and first.heads == 1
            and f.module is not owner
            and all(g.module is not f.module for g in group)
            and f.weights.shape == first.weights.shape
            and f.kind == first.kind
        )

    def _site_for(self, owner: nn.Module, group: list[Finding], heads: int, kv_heads: int) -> Site:
        # one softmax line run by two submodules of a named module (a decoder block's self- and cross-attention
        # of one class) is two layers; single-head modules stacked as the heads of one layer are one
        key = (id(owner), group[0].key, id(group[0].module) if len(group) == 1 else None)
        site = self.traced_sites.get(key)
        if site is None:
            static = self.named.get(id(owner))
            at = group[0].meta.get("softmax_at", "?")
            if static is not None and not ({"softmax_at", "sdpa_at"} & static.info.keys()):
                site = static
                site.info["softmax_at"] = at
            else:
                site = Site(
                    self.names.get(id(owner), type(owner).__name__),
                    owner,
                    self.adapter,
                    heads,
                    kv_heads,
                    info={"strategy": "traced softmax", "softmax_at": at},
                )
                self.session.add_site(site)
            self.traced_sites[key] = site
        if site.num_heads is None:  # a named module: its head count is known from its first call
            site.num_heads, site.num_kv_heads = heads, kv_heads
            self.session.select_site(site)
        return site

    def _emit_group(self, owner: nn.Module, group: list[Finding]) -> None:
        """One record from the findings of one layer's call: one finding, or single-head findings stacked as heads."""
        first = group[0]
        stacked = len(group) > 1
        heads = len(group) if stacked else first.heads
        kv_heads = len(group) if stacked else first.kv_heads
        site = self._site_for(owner, group, heads, kv_heads)
        if not site.selected:
            self.session.emit(site, kind=first.kind)
            return
        if site.num_heads != heads:
            self._warn_once(
                ("heads", site.layer),
                f"layer {site.layer} ({site.name!r}) had {site.num_heads} head(s) "
                f"before and {heads} now; calls with another head count are not recorded",
            )
            site.calls += 1
            return
        fields = _stacked_fields(site, group) if stacked else {name: getattr(first, name) for name in _TENSOR_FIELDS}
        violations = tuple(
            lint_violation(
                check, name=site.name, layer=site.layer, call=site.calls, message=message, head=(h if stacked else None)
            )
            for h, f in enumerate(group)
            for check, message in f.lints
        )
        causals = [f.causal for f in group]
        identified = frozenset.intersection(*(f.identified for f in group))
        meta = self._group_meta(group, violations, identified)
        record = self.session.emit(
            site,
            kind=first.kind,
            **fields,
            causal=None if None in causals else all(causals),
            scaling=first.scaling,
            backend="hand-written",
            dtype=first.dtype,
            weights_source="observed",
            dropout=first.dropout,
            query_offset=first.query_offset,
            identified=identified,
            meta=meta,
        )
        if record is not None:
            self._warn_lints(violations)
            if "missing" in meta:
                self._warn_missing(site, meta["missing"])
            if meta["dropout_in_eval"]:
                self._warn_eval_dropout(
                    site,
                    f"F.dropout(p={first.dropout:g}) on the attention weights runs",
                    "F.dropout's training argument defaults to True; pass training=self.training or use nn.Dropout",
                )

    def _group_meta(self, group: list[Finding], violations: tuple, identified: frozenset[str]) -> dict:
        first = group[0]
        meta = {
            "module_class": type(first.module).__name__,
            "softmax_at": first.meta.get("softmax_at", "?"),
            "kind_from": first.meta.get("kind_from", "lengths"),
            "lint": violations,
            "dropout_in_eval": any(f.meta.get("dropout_in_eval", False) for f in group),
        }
        if len(group) > 1:
            meta["head_modules"] = tuple(self.names.get(id(f.module), "?") for f in group)
        for name in ("folded", "query_vector"):
            if name in first.meta:
                meta[name] = first.meta[name]
        missing = {name: reason for f in group for name, reason in f.missing.items() if name not in identified}
        if missing:
            meta["missing"] = missing
        return meta
