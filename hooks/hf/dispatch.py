"""The attention function a Hugging Face module calls, wrapped in place under its own name while a capture is open.

Interface-based attention modules ask ``ALL_ATTENTION_FUNCTIONS.get_interface(config._attn_implementation,
eager_attention_forward)`` for their function. A capture changes neither the name nor the config: it puts a wrapper
where the dispatch finds the function (a *slot*) and takes it out again when the last capture holding the slot
closes, also when the forward raised:

- a registered name (``"sdpa"``, ``"flex_attention"``, ``"flash_attention_2"``, a hub kernel, a user's function):
  the entry of the registry the module's class reads (``AttentionInterface._global_mapping``, or the file-local
  interface's ``_local_mapping`` where the modeling file overrides the name);
- the eager default ("eager" is in no registry): the name ``*eager_attention_forward`` in the globals of the
  modeling file, which the dispatch reads at call time (so transformers 5.0's ``if ... != "eager"`` dispatch
  finds the wrapper too);
- GPT-2's reordered, upcast eager path (``_upcast_and_reordered_attn``, which its forward calls instead of the
  interface when the flag is set): an attribute of the selected module instance.

Model code that branches on ``config._attn_implementation`` (Gemma 4, glm_moe_dsa) takes the same path with a
capture as without. The wrapper calls the function it replaced with the very arguments and returns its result
untouched; it hands what the call received to ``deliver`` for the module's token, which in eager code is a dict
look-up when no capture listens to the module (another model, a module not selected, another thread's capture is
told apart by the receiver). The slots themselves are ``hooks/slots.py``'s.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial

import torch
from torch import nn

from ...probe.errors import UnsupportedModelError
from .. import slots
from ..deliver import deliver, listening, number
from ..sdpa_lse import call_with_lse, wants_lse
from ..slots import Slot
from . import compat as hf_compat


# --------------------------------------------------------------------------------------------- classes
@dataclass(frozen=True)
class ClassInfo:
    """How one attention class dispatches (read once per class from its forward's code)."""

    uses_interface: bool
    interface: Mapping[str, Callable] | None = None  # the ALL_ATTENTION_FUNCTIONS the forward reads (maybe file-local)
    globals: dict | None = None  # the forward's module globals, where the eager default is looked up
    eager_name: str | None = None  # the global naming the model file's own eager function (the dispatch default)

    @property
    def eager(self) -> Callable | None:
        """The model file's eager function as the file holds it now (a capture may have wrapped it)."""
        if self.globals is None or self.eager_name is None:
            return None
        return self.globals.get(self.eager_name)


def _code_names(code) -> set[str]:
    names = set(code.co_names)
    for const in code.co_consts:
        if inspect.iscode(const):
            names |= _code_names(const)
    return names


_CLASS_INFO: dict[type, ClassInfo] = {}


def class_info(cls: type) -> ClassInfo:
    """Whether ``cls.forward`` dispatches through the attention interface, and where (read once per class)."""
    info = _CLASS_INFO.get(cls)
    if info is None:
        info = _CLASS_INFO[cls] = _read_class_info(cls)
    return info


def _read_class_info(cls: type) -> ClassInfo:
    forward = inspect.unwrap(getattr(cls, "forward", None) or (lambda: None))
    code = getattr(forward, "__code__", None)
    if code is None:
        return ClassInfo(False)
    names = _code_names(code)
    if "ALL_ATTENTION_FUNCTIONS" not in names:
        return ClassInfo(False)
    g = forward.__globals__
    eager = [n for n in sorted(names) if "eager" in n and n.endswith("attention_forward") and callable(g.get(n))]
    return ClassInfo(True, g.get("ALL_ATTENTION_FUNCTIONS"), g, eager[0] if len(eager) == 1 else None)


# --------------------------------------------------------------------------------------------- dispatch
#: what attnprobe knows of the function's math: the model file's eager function, transformers' sdpa, flex and flash
#: functions, or somebody else's function ("custom": the user's, a hub kernel with its own entry point)
KERNELS = ("eager", "sdpa", "flex", "flash", "custom")


@dataclass(frozen=True)
class Dispatch:
    """What one module's attention call goes to: the implementation's name, the kind of function, and its slot."""

    name: str  # config._attn_implementation ("eager" for None)
    kernel: str  # one of KERNELS
    slot: Slot
    function: Callable  # the function the model calls (the one the slot holds when no capture wraps it)


def resolve(module: nn.Module, where: str) -> Dispatch:
    """The dispatch of ``module``'s next call, or a clear error naming ``where`` when attnprobe cannot read it."""
    cls = type(module)
    config = getattr(module, "config", None)
    if config is None or not hasattr(config, "_attn_implementation"):
        raise UnsupportedModelError(
            f"{where} has no `config` with an `_attn_implementation`, so attnprobe cannot tell which attention "
            "function it calls; exclude it with layers=[...]"
        )
    name = config._attn_implementation
    info = class_info(cls)
    if name is not None and name.startswith("paged|") and name != "paged|eager":
        name = name.removeprefix("paged|")  # what get_interface does (transformers 5.16 and later)
    if name is None or (name == "eager" and "eager" not in (info.interface or {})):
        return _eager_dispatch(module, info, where)
    if name.startswith("paged|"):
        raise UnsupportedModelError(
            f"{where} runs attn_implementation={name!r}: paged attention reads its keys from a continuous-batching "
            "cache, which attnprobe does not read. Capture the model with generate() and attn_implementation='sdpa'"
        )
    interface = info.interface
    if interface is None:
        raise UnsupportedModelError(
            f"{cls.__name__}.forward dispatches through an ALL_ATTENTION_FUNCTIONS that is not a global of its "
            f"module ({cls.__module__}), so attnprobe cannot tell which function it calls for {name!r}; exclude the "
            "module with layers=[...]"
        )
    local = getattr(interface, "_local_mapping", None)
    mapping = local if isinstance(local, dict) and name in local else getattr(interface, "_global_mapping", None)
    if not isinstance(mapping, dict) or name not in mapping:
        raise UnsupportedModelError(
            f"{where} runs attn_implementation={name!r}, which is not registered with AttentionInterface; "
            "register the function (AttentionInterface.register) or load the model with attn_implementation='sdpa'"
        )
    slot = Slot(mapping, name)
    function = original(slot)
    return Dispatch(name, kernel_of(name, function), slot, function)


def _eager_dispatch(module: nn.Module, info: ClassInfo, where: str) -> Dispatch:
    cls = type(module)
    if info.eager is None:
        raise UnsupportedModelError(
            f"cannot find the eager attention function of {cls.__qualname__} (module {cls.__module__}): its forward "
            "names no single `*eager_attention_forward` function; load the model with attn_implementation='sdpa'"
        )
    assert info.globals is not None and info.eager_name is not None
    slot = Slot(info.globals, info.eager_name)
    return Dispatch("eager", "eager", slot, original(slot))


def upcast_slot(module: nn.Module) -> Slot | None:
    """GPT-2's reordered, upcast eager path, when this module takes it (its forward then bypasses the interface)."""
    if getattr(module, "reorder_and_upcast_attn", False) and callable(
        getattr(module, "_upcast_and_reordered_attn", None)
    ):
        return Slot(None, "_upcast_and_reordered_attn", owner=module)
    return None


def kernel_of(name: str, function: Callable) -> str:
    """Which math ``function`` (registered as ``name``) computes, as far as attnprobe can tell."""
    if name == "sdpa":
        return "sdpa"  # also a file-local override of "sdpa": its calls get sdpa's masks (meta names the function)
    known = hf_compat.kernel_functions()
    return known.get(_unpartial(function), "custom")


def _unpartial(function: Callable) -> Callable:
    while hasattr(function, "func") and hasattr(function, "keywords"):  # functools.partial, as hub kernels bind it
        function = function.func
    return function


# --------------------------------------------------------------------------------------------- wrapping
def original(slot: Slot) -> Callable:
    """The function the slot holds when no capture wraps it."""
    return slots.original(slot)


def hold(slot: Slot, stack: ExitStack) -> None:
    """Put the wrapper of the slot's function into ``slot`` until ``stack`` closes (``hooks/slots.py``)."""
    slots.hold(slot, stack, _interface_wrapper if slot.owner is None else partial(_upcast_wrapper, slot.owner))


def _interface_wrapper(fn: Callable) -> Callable:
    def attnprobe_wrapper(module, query, key, value, attention_mask, *args, **kwargs):
        lse = None  # the lse of sdpa's own kernel, where a capture asked for it (``want_lse``; eager forwards only)
        if wants_lse(module) and fn is hf_compat.sdpa_forward():
            result, lse = call_with_lse(fn, module, query, key, value, attention_mask, *args, **kwargs)
        else:
            result = fn(module, query, key, value, attention_mask, *args, **kwargs)
        token = id(module)  # the token of `listen(module, "hf-call", ..., shared=True)`: channel 0, slot 0
        if listening(token):
            deliver(token, "call", *call_payload(fn, query, key, value, attention_mask, args, kwargs, result, lse))
        return result

    attnprobe_wrapper.__qualname__ = attnprobe_wrapper.__name__ = f"attnprobe_over_{getattr(fn, '__name__', 'fn')}"
    attnprobe_wrapper.__wrapped__ = fn  # type: ignore[attr-defined]
    return attnprobe_wrapper


def _upcast_wrapper(module, method: Callable) -> Callable:
    def attnprobe_upcast(query, key, value, attention_mask=None):
        result = method(query, key, value, attention_mask)
        token = id(module)
        if listening(token):
            # GPT-2's upcast path scales by module.scaling and applies its attn_dropout module
            dropout = module.attn_dropout.p if module.training else 0.0
            kwargs = {"scaling": module.scaling, "dropout": dropout}
            deliver(token, "call", *call_payload(method, query, key, value, attention_mask, (), kwargs, result))
        return result

    return attnprobe_upcast


# --------------------------------------------------------------------------------------------- the payload
#: keyword arguments of attention calls the record reads (numbers, then tensors), in the order ``deliver`` sends them
NUMBER_ARGS = ("scaling", "is_causal", "dropout", "softcap", "sliding_window")
TENSOR_ARGS = ("position_bias", "s_aux", "position_ids", "cu_seq_lens_q", "cu_seq_lens_k")
_PARAMS: dict[Callable, tuple[str, ...]] = {}  # attention function -> names of its parameters after the mask


def call_payload(fn, q, k, v, mask, args: tuple, kwargs: dict, result, lse=None) -> tuple[list, list]:
    """What one attention call hands to its recorders: traceable (no inspection, no branch on tensor values).

    tensors: q, k, v, the mask, the output and second result the function returned, then ``TENSOR_ARGS``, then the
    lse of sdpa's own kernel (``hooks/sdpa_lse.py``; None where not read);
    numbers: the values of ``NUMBER_ARGS`` (nan: not given), a bit per argument name that was given, and whether
    the mask was an object a compiled graph cannot hand over (a flex ``BlockMask``: None is sent instead).
    """
    if args:  # positional extras after the mask, named by the function's signature (read outside any graph)
        names = _PARAMS.get(fn)
        if names is None and not torch.compiler.is_compiling():
            names = _PARAMS[fn] = tuple(list(inspect.signature(fn).parameters)[5:])
        kwargs = {**dict(zip(names or (), args)), **kwargs}
    out = result[0] if isinstance(result, tuple) and result else result
    second = result[1] if isinstance(result, tuple) and len(result) > 1 else None
    given = sum(1 << i for i, name in enumerate(NUMBER_ARGS + TENSOR_ARGS) if kwargs.get(name) is not None)
    hidden = mask is not None and not isinstance(mask, torch.Tensor) and torch.compiler.is_compiling()
    tensors = [
        q,
        k,
        v,
        None if hidden else mask,
        out if isinstance(out, torch.Tensor) else None,
        second if isinstance(second, torch.Tensor) else None,
        *(kwargs.get(n) if isinstance(kwargs.get(n), torch.Tensor) else None for n in TENSOR_ARGS),
        lse,
    ]
    return tensors, [*(number(kwargs.get(n)) for n in NUMBER_ARGS), float(given), number(hidden)]
