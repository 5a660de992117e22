"""How what a hook sees inside a forward reaches the capture session, also from a ``torch.compile``d model.

Code attnprobe runs inside a model's forward (forward hooks, the Hugging Face attention wrapper) does one thing:
it hands the tensors it sees, and a few numbers, to ``deliver(token, event, tensors, numbers)``. Everything else
(recording, budgets, copies, inference-mode handling, data-dependent checks) runs in plain Python in the
receiver that ``listen`` registered for ``token``, outside any compiled graph:

- in eager mode ``deliver`` calls the receivers directly;
- while Dynamo traces a forward it calls the custom op ``attnprobe::deliver`` instead, an *ordered effectful* op
  (never dropped as dead code, never reordered against other effects), so the compiled graph calls the receivers
  at run time with the real tensors, in the order the forward produced them. The traced code reads no capture
  state, so a graph compiled during one capture serves every later capture of the same model (tokens are
  module ids: stable while the module lives; a token with no receiver is a no-op).

``tensors`` holds tensors or None (other objects only in eager mode); ``numbers`` holds floats (None and bools
are encoded by ``number``/``flag``: ``nan`` = None, ``1.0``/``0.0`` = True/False).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from contextlib import ExitStack
from typing import List, Optional  # noqa: UP035 (see deliver_op)

import torch
from torch.overrides import TorchFunctionMode

_RECEIVERS: dict[int, list[Callable]] = {}  # token -> receivers of the captures open on it
_LOCK = threading.Lock()
#: token = channel << 60 | slot << 52 | id(module) (ids of live objects stay below 2**52), a positive int64: eight
#: channels at most
CHANNELS = ("hf-call", "hf-kind", "hf-stack", "attnprobe", "torch_mha", "flex-call", "hf-proj", "hf-old")
_CHANNEL_SHIFT, _SLOT_SHIFT = 60, 52
_OP = None
_IN_GRAPH = threading.local()  # .active: receivers are running inside a compiled graph (see `held`)


def number(value) -> float:
    """``value`` (a float, int, bool or None) as one float of ``numbers``."""
    return math.nan if value is None else float(value)


def value_of(x: float):
    """The inverse of ``number`` for floats: None for ``nan``."""
    return None if math.isnan(x) else x


def deliver(token: int, event: str, tensors: list, numbers: list) -> None:
    """Hand one event of a forward to the receivers of ``token`` (now, or at run time of the compiled graph)."""
    if torch.compiler.is_compiling():
        # one tensor more, always: inductor (torch 2.13) frees buffers too early around an effectful op that has
        # no tensor argument; the op drops it again
        torch.ops.attnprobe.deliver(token, event, [*tensors, torch.empty(0)], [float(n) for n in numbers])
    else:
        _receive(token, event, tensors, numbers)


def shared_token(key: object, channel: str) -> int:
    """The token ``listen(key, channel, ..., shared=True)`` returns, for code that delivers without having listened."""
    return (CHANNELS.index(channel) << _CHANNEL_SHIFT) | id(key)


def listening(token: int) -> bool:
    """Whether ``deliver(token, ...)`` may reach a receiver: a capture listens on ``token``, or Dynamo is tracing (a
    compiled graph must not depend on which captures are open: its op looks the receivers up at run time)."""
    return torch.compiler.is_compiling() or token in _RECEIVERS


def _receive(token: int, event: str, tensors, numbers) -> None:
    receivers = _RECEIVERS.get(token)
    if receivers:
        for receiver in tuple(receivers):
            receiver(event, list(tensors), list(numbers))


def held(t):
    """``t`` as a receiver may keep it past the event that delivered it.

    In eager mode that is ``t`` itself (as a hook holds it). Delivered by a compiled graph, ``t`` is one of its
    buffers, which the graph reuses for later results once the op has returned: a copy.
    """
    if isinstance(t, torch.Tensor) and getattr(_IN_GRAPH, "active", False):
        with torch.no_grad():
            return t.detach().clone()
    return t


def listen(key: object, channel: str, receiver: Callable, stack: ExitStack, *, shared: bool = False) -> int:
    """Call ``receiver(event, tensors, numbers)`` for the events delivered to the returned token until ``stack``
    closes.

    ``channel`` names what is delivered (one of ``CHANNELS``: a module may carry hooks of several kinds).
    The token is made of ``id(key)`` (a module) and the channel, for the first capture that listens; a nested capture
    that attaches hooks of its own gets the next free slot, so each session hears its own hooks once. ``shared``:
    every capture listens on ``id(key)`` itself (one hook, or one wrapper, serves all of them). Tokens do not depend
    on what a capture selects: a graph compiled for one capture serves the next.

    Also registers the op (once) before any forward runs: Dynamo must find it when it traces the hooks.
    """
    _register_op()
    base = (CHANNELS.index(channel) << _CHANNEL_SHIFT) | id(key)
    with _LOCK:
        slot = 0
        while not shared and ((slot << _SLOT_SHIFT) | base) in _RECEIVERS:
            slot += 1
        token = (slot << _SLOT_SHIFT) | base
        _RECEIVERS.setdefault(token, []).append(receiver)
    stack.callback(_forget, token, receiver)
    return token


def active_tokens() -> frozenset[int]:
    """The tokens some open capture listens on (empty once every capture has closed)."""
    with _LOCK:
        return frozenset(_RECEIVERS)


def _forget(token: int, receiver: Callable) -> None:
    with _LOCK:
        receivers = _RECEIVERS.get(token, [])
        if receiver in receivers:
            receivers.remove(receiver)
        if not receivers:
            _RECEIVERS.pop(token, None)


def _register_op() -> None:
    """Define ``attnprobe::deliver`` on first use (importing attnprobe registers nothing)."""
    global _OP
    with _LOCK:
        if _OP is not None:
            return

        @torch.library.custom_op("attnprobe::deliver", mutates_args=())
        # typing.List/Optional, not list[...] / X | None: torch 2.6's infer_schema (the oldest torch we declare) knows
        # only the typing spellings
        def deliver_op(
            token: int,
            event: str,
            tensors: List[Optional[torch.Tensor]],  # noqa: UP006, UP045
            numbers: List[float],  # noqa: UP006
        ) -> None:
            _IN_GRAPH.active = True
            try:
                _receive(token, event, tensors[:-1], numbers)  # without the tensor `deliver` added
            finally:
                _IN_GRAPH.active = False

        @deliver_op.register_fake
        def _(token, event, tensors, numbers) -> None:
            return None

        from torch._higher_order_ops import effects

        ordered = getattr(effects, "EffectType", None) or effects._EffectType  # public name from torch 2.8 on
        effects._register_effectful_op(torch.ops.attnprobe.deliver.default, ordered.ORDERED)
        # torch 2.6's FX dead-code elimination does not yet know effectful ops: without this, inductor drops
        # every `with_effects` node of an inference graph (the receivers would never run)
        torch.fx.node.has_side_effect(torch.ops.higher_order.with_effects)
        _OP = deliver_op


class _Recompile(TorchFunctionMode):
    """A torch function mode that changes nothing: every call runs as called and returns its own result.

    Dynamo guards on the function mode stack but not on forward hooks (``skip_nnmodule_hook_guards``): hooks added
    to a model compiled before the capture would never run in its graph. While this mode is on the stack, compiled
    code is traced again, once, with the capture's hooks (which only ``deliver``); later captures find that graph
    in Dynamo's cache, and after the capture the mode is gone and the graph compiled before runs again.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


_HOLDING: set[int] = set()  # ids of the sessions that hold a _Recompile mode


def hold_recompile(session, stack: ExitStack) -> None:
    """Make compiled code of ``session``'s model run its hooks for the length of the capture (see ``_Recompile``).

    Only for models with compiled parts (``session.compiled``): in eager code a function mode costs every torch call.
    Once per session, whatever number of adapters ask.
    """
    if not getattr(session, "compiled", None) or id(session) in _HOLDING:
        return
    from .modes import exit_mode

    _HOLDING.add(id(session))
    stack.callback(_HOLDING.discard, id(session))
    mode = _Recompile()
    mode.__enter__()
    stack.callback(exit_mode, mode, dispatch=False)
