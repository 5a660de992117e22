"""Leaving a torch function or dispatch mode wherever it sits on its stack.

``TorchFunctionMode.__exit__`` / ``TorchDispatchMode.__exit__`` pop the *top* mode. A capture's mode is not
always on top when it must go: captures closed out of order (generators suspended inside their ``with``), or
a mode the user entered meanwhile. Popping the top would remove theirs and leave ours active.
"""

from __future__ import annotations


def exit_mode(mode, *, dispatch: bool) -> None:
    """Exit ``mode`` (if it is still on its stack); modes entered after it stay, in their order."""
    if dispatch:
        from torch.utils._python_dispatch import _get_current_dispatch_mode_stack as current
        from torch.utils._python_dispatch import _pop_mode as pop
        from torch.utils._python_dispatch import _push_mode as push
    else:
        from torch.overrides import _get_current_function_mode_stack as current
        from torch.overrides import _pop_mode as pop
        from torch.overrides import _push_mode as push
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
