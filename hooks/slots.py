"""Functions wrapped in place where the model's code finds them, for the length of a capture.

A *slot* is the place a call looks its function up when it runs: an entry of a dict (transformers' attention
registry, a module's globals, where ``eager_attention_forward`` or a direct ``flex_attention`` lives) or an attribute
of one object (GPT-2's upcast method). ``hold`` puts a wrapper there until the capture's stack closes; captures that
hold the same slot share it (nested captures, one model captured in two threads: the receivers tell their calls
apart) and the last one to close puts the function back, also when the forward raised. A slot that holds something
else by then (the user registered another function meanwhile) keeps it, and a warning says the calls it ran were not
recorded.

One wrapper per slot and function for the life of the process: a graph ``torch.compile`` traced with it finds the
same object in every later capture.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, MutableMapping
from contextlib import ExitStack
from dataclasses import dataclass

from ..probe.errors import warn_user

_LOCK = threading.Lock()


@dataclass(frozen=True, eq=False)
class Slot:
    """``mapping[key]``, or (with ``owner``) the attribute ``key`` of the object ``owner``."""

    mapping: MutableMapping | None
    key: str
    owner: object | None = None

    @property
    def ident(self) -> tuple[int, str]:
        return (id(self.mapping if self.owner is None else self.owner), self.key)

    def get(self):
        """What the slot holds now (for an attribute: the object's own, None when it uses its class's)."""
        if self.owner is not None:
            return vars(self.owner).get(self.key)
        assert self.mapping is not None
        return self.mapping.get(self.key)


@dataclass
class _Held:
    slot: Slot
    original: Callable
    wrapper: Callable
    count: int


_HELD: dict[tuple[int, str], _Held] = {}
#: (slot ident, id(original)) -> (original, wrapper): the one wrapper of each function at each slot
_WRAPPERS: dict[tuple[tuple[int, str], int], tuple[Callable, Callable]] = {}


def original(slot: Slot) -> Callable:
    """The function the slot holds when no capture wraps it."""
    with _LOCK:
        held = _HELD.get(slot.ident)
        return held.original if held is not None else _read(slot)


def _read(slot: Slot) -> Callable:
    if slot.owner is not None:
        return getattr(slot.owner, slot.key)  # a method: bound to the object
    assert slot.mapping is not None
    return slot.mapping[slot.key]


def hold(slot: Slot, stack: ExitStack, make: Callable[[Callable], Callable]) -> None:
    """Put ``make(function)`` (made once per slot and function) into ``slot`` until ``stack`` closes."""
    with _LOCK:
        held = _HELD.get(slot.ident)
        if held is None:
            fn = _read(slot)
            wrapper = _wrapper(slot, fn, make)
            held = _HELD[slot.ident] = _Held(slot, fn, wrapper, 0)
            _write(slot, wrapper)
        held.count += 1
    stack.callback(_release, slot.ident)


def _wrapper(slot: Slot, fn: Callable, make: Callable[[Callable], Callable]) -> Callable:
    key = (slot.ident, id(getattr(fn, "__func__", fn)))  # a bound method is made anew on each look-up: its function
    found = _WRAPPERS.get(key)
    if found is not None and getattr(found[0], "__func__", found[0]) is getattr(fn, "__func__", fn):
        return found[1]
    wrapper = make(fn)
    _WRAPPERS[key] = (fn, wrapper)
    return wrapper


def _release(ident: tuple[int, str]) -> None:
    with _LOCK:
        held = _HELD.get(ident)
        if held is None:
            return
        held.count -= 1
        if held.count:
            return
        del _HELD[ident]
        slot = held.slot
        now = slot.get()
        if now is held.wrapper:
            if slot.owner is not None:
                delattr(slot.owner, slot.key)  # the class's method again
            else:
                _write(slot, held.original)
            return
    warn_user(
        f"the attention function under {slot.key!r} was replaced while a capture was open (by "
        f"{getattr(now, '__qualname__', repr(now))}): the calls it ran were not recorded. Register attention "
        "functions before a capture opens"
    )


def _write(slot: Slot, fn: Callable) -> None:
    if slot.owner is not None:
        setattr(slot.owner, slot.key, fn)
    else:
        assert slot.mapping is not None
        slot.mapping[slot.key] = fn


def held_slots() -> int:
    """How many slots hold a wrapper now (0 once every capture has closed)."""
    with _LOCK:
        return len(_HELD)
