"""One capture per model per thread: captures opened in different threads on the same modules are refused,
and hooks let calls from other threads pass through untouched.

A capture changes shared state while it is open (hooks on the model's modules, a config's attention
implementation, torch's MultiheadAttention fast path), so two threads cannot each capture the same model:
the second capture is refused with an error naming the thread that holds it. Hooks check ``elsewhere(owner)``
first, so a forward running in another thread meanwhile (without capture) runs as if attnprobe were absent
and never lands in the capture.

    >>> owner = current()
    >>> elsewhere(owner)
    False
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

import torch

from .errors import SelectionError

_LOCK = threading.Lock()
_HELD: dict[int, tuple[int, str, str]] = {}  # id(module) -> (thread id, thread name, model class) while captured


def current() -> int:
    """The running thread's identifier."""
    return threading.get_ident()


def elsewhere(owner: int) -> bool:
    """True when the running code is in another thread than ``owner`` (its calls are not ours to record).
    False while torch.compile traces (a compiled graph runs in the thread that called it)."""
    return not torch.compiler.is_compiling() and threading.get_ident() != owner


def in_backward() -> bool:
    """True while autograd runs a backward pass in this thread. A forward call made there is activation
    checkpointing's recomputation of a call the forward made (and recorded) already; on CUDA the backward runs in
    autograd's device threads, which ``elsewhere`` leaves out already."""
    if torch.compiler.is_compiling():  # traced code records nothing itself (its hooks deliver); no graph break here
        return False
    task = getattr(torch._C, "_current_graph_task_id", None)
    return task is not None and task() != -1


def claim(modules: Iterable[torch.nn.Module], model_class: str) -> list[int]:
    """Mark ``modules`` as captured by the running thread, or raise naming the other thread that captures one
    of them. Returns the keys to ``release``; a module this thread already holds (a nested capture) is shared."""
    me, name = threading.get_ident(), threading.current_thread().name
    keys = [id(m) for m in modules]
    with _LOCK:
        for key in keys:
            held = _HELD.get(key)
            if held is not None and held[0] != me:
                raise SelectionError(
                    f"{model_class} is already being captured in thread {held[1]!r} (id {held[0]}); this is thread "
                    f"{name!r}. A capture changes the model while it is open, so one thread at a time captures a "
                    "model: capture in that thread, wait until its capture ends, or give this thread its own copy "
                    "of the model (copy.deepcopy(model))"
                )
        new = [key for key in dict.fromkeys(keys) if key not in _HELD]
        for key in new:
            _HELD[key] = (me, name, model_class)
    return new


def release(keys: Iterable[int]) -> None:
    """Undo ``claim``."""
    with _LOCK:
        for key in keys:
            _HELD.pop(key, None)
