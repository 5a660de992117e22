"""Reading a call's arguments by name, the way a hook sees them (positional and keyword mixed)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def bind_arguments(
    params: Sequence[str], defaults: Mapping, args: tuple, kwargs: Mapping, required: int
) -> dict | None:
    """``{name: value}`` for a call of a function with parameters ``params`` (the first ``required`` without
    defaults), or None when the call does not fit: the function will raise its own error."""
    if len(args) > len(params):
        return None
    bound = dict(zip(params, args))
    for name, value in kwargs.items():
        if name not in params or name in bound:
            return None
        bound[name] = value
    if any(p not in bound for p in params[:required]):
        return None
    for name, value in defaults.items():
        bound.setdefault(name, value)
    return bound
