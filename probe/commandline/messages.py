"""The library's errors in command-line words, from the data they carry (never from their text).

A library error ends with advice in the words of the Python API (``layers=[...]``, ``max_bytes``,
``attnprobe.attention_modules(model)``); it carries what was wrong as attributes (``problem``, ``hint``, the
selection's ``argument``, ``value`` and ``choices``, the budget's figures; see ``probe.errors``). These functions
say the same with the options a command-line user has. An error whose raising site gave no attributes is said as
the library wrote it.
"""

from __future__ import annotations

from torch import nn

from ..errors import CaptureBudgetError, SelectionError
from ..selection import format_bytes
from .candidates import softmax_modules

#: The command line's advice for a selection error, by the ``capture()`` argument it concerns.
SELECTION_HINTS = {"layers": "`attnprobe info` lists them"}
#: The command line's advice for a capture past its budget.
BUDGET_HINT = "select fewer layers (--layers) or heads (--heads), or raise --max-bytes"


def softmax_candidates(model: nn.Module, limit: int = 8) -> str:
    """``"h.0,h.1"``: the first ``limit`` modules whose code calls softmax, for --modules ("" when none)."""
    found = [c.name or "<root>" for c in softmax_modules(model)]
    return ",".join(found[:limit]) + (" ..." if len(found) > limit else "")


def selection_message(exc: SelectionError, model: nn.Module) -> str:
    """A ``SelectionError`` in command-line words: --modules for ``modules=`` (a name that is not in the model
    lists the modules whose code calls softmax), the command line's advice for a layer or head out of range."""
    if exc.problem is None:
        return str(exc)
    if exc.argument == "modules":
        text = f"--modules: {exc.problem}"
        if exc.choices is not None:  # a name not in the model: where names come from, and what looks alike
            text += "; names come from named_modules()" + (f", e.g. {list(exc.choices)}" if exc.choices else "")
            candidates = softmax_candidates(model)
            if candidates:
                text += f"; modules whose code calls softmax: {candidates}"
        elif exc.hint is not None:
            text += f"; {exc.hint}"
        return text
    hint = SELECTION_HINTS.get(exc.argument or "")
    return f"{exc.problem}; {hint}" if hint is not None else str(exc)


def budget_message(exc: CaptureBudgetError, max_bytes_text: str | None) -> str:
    """A ``CaptureBudgetError`` with the budget's figures and the command line's advice."""
    if exc.needed is None or exc.stored is None or exc.limit is None:
        return f"capture budget exceeded: the capture needs more than --max-bytes {max_bytes_text}; {BUDGET_HINT}"
    return (
        f"capture budget exceeded: storing {exc.what or 'the next tensor'} needs {format_bytes(exc.needed)} more, "
        f"{format_bytes(exc.stored)} is already stored and --max-bytes is {format_bytes(exc.limit)}; {BUDGET_HINT}"
    )


def no_attention_advice(model: nn.Module, source: str) -> str:
    """One line for a model with no attention attnprobe reads by itself: the --modules to pass, with candidates."""
    found = softmax_modules(model)
    head = (
        f"no attention found in {source} ({type(model).__name__}) that attnprobe reads by itself "
        "(its own modules, Hugging Face attention, torch.nn.MultiheadAttention, visible sdpa calls)"
    )
    if not found:
        return (
            head + "; no module's code calls softmax either: name the modules that compute attention with "
            "--modules NAME[,NAME...], or trace every module with --modules auto"
        )
    names = ",".join(c.name or "<root>" for c in found[:8])
    return (
        head
        + f"; hand-written softmax attention is read when named: --modules {names}"
        + (f" (and {len(found) - 8} more: `attnprobe info` lists them)" if len(found) > 8 else "")
        + " or --modules auto"
    )
