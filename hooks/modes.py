"""Leaving a torch function or dispatch mode wherever it sits on its stack.

``TorchFunctionMode.__exit__`` / ``TorchDispatchMode.__exit__`` pop the *top* mode. A capture's mode is not
always on top when it must go: captures closed out of order (generators suspended inside their ``with``), or
a mode the user entered meanwhile. Popping the top would remove theirs and leave ours active.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def exit_mode(mode, *, dispatch: bool) -> None:
    """Exit ``mode`` (if it is still on its stack); modes entered after it stay, in their order."""
    from torch import overrides
    from torch.utils import _python_dispatch

    current: Callable[[], list[Any]]
    pop: Callable[[], Any]  # the dispatch stack's pop takes an optional key, the function stack's none
    push: Callable[[Any], None]
    if dispatch:
        current = _python_dispatch._get_current_dispatch_mode_stack
        pop, push = _python_dispatch._pop_mode, _python_dispatch._push_mode
    else:
        current = overrides._get_current_function_mode_stack
        pop, push = overrides._pop_mode, overrides._push_mode
    stack = current()
    if not any(m is mode for m in stack):
        return
    above = []
    while stack[-1] is not mode:
        above.append(pop())
        stack.pop()
    try:
        mode.__exit__(None, None, None)
    finally:
        for m in reversed(above):
            push(m)
