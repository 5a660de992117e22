"""Errors and warnings raised by attnprobe. Every message says what was wrong and what to do."""

from __future__ import annotations

import sys
import warnings
from collections.abc import Iterable
from types import FrameType


class AttnprobeError(Exception):
    """Base class of every error attnprobe raises on purpose.

    The message is for people; what a program needs travels as attributes, None where the raising site does
    not say (a caller falls back to the message as it is, and never reads it for them):

    - ``problem``: what was wrong, the message without its advice;
    - ``hint``: the advice that ends the message, in the words of the Python API (``keep=``, ``layers=[...]``);
      a caller with words of its own, the command line, says ``problem`` and its own advice.
    """

    problem: str | None = None
    hint: str | None = None

    def __init__(self, *args: object, problem: str | None = None, hint: str | None = None) -> None:
        super().__init__(*args)
        self.problem = problem
        self.hint = hint


class SelectionError(AttnprobeError, ValueError):
    """A layer, head or tensor selection that does not fit the model or the capture.

    Beside ``problem`` and ``hint``: ``argument``, the argument of ``capture()`` the selection concerns
    (``"layers"``, ``"heads"``, ``"modules"``, ``"keep"``, ...); ``value``, the item it could not use (a layer
    number, a module name); ``choices``, what would have been accepted where the list is short (e.g. the module
    names that look alike). Each is None where the raising site does not say.
    """

    argument: str | None = None
    value: object = None
    choices: tuple | None = None

    def __init__(
        self,
        *args: object,
        problem: str | None = None,
        hint: str | None = None,
        argument: str | None = None,
        value: object = None,
        choices: Iterable[object] | None = None,
    ) -> None:
        super().__init__(*args, problem=problem, hint=hint)
        self.argument = argument
        self.value = value
        self.choices = None if choices is None else tuple(choices)


class NotCapturedError(SelectionError, KeyError):
    """A head, layer or call the capture does not hold. A ``KeyError`` too (a failed lookup), but printed as
    the one-line message it is, not wrapped in quotes as ``KeyError`` prints its key."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CaptureBudgetError(AttnprobeError, MemoryError):
    """Storing the next tensor would exceed ``max_bytes``; raised before the memory is spent.

    The budget's figures, each None where the raising site does not say: ``what``, the tensor (or record) that
    did not fit, in words; ``needed``, the bytes it needs; ``stored``, the bytes already stored; ``limit``,
    ``max_bytes``.
    """

    what: str | None = None
    needed: int | None = None
    stored: int | None = None
    limit: int | None = None

    def __init__(
        self,
        *args: object,
        problem: str | None = None,
        hint: str | None = None,
        what: str | None = None,
        needed: int | None = None,
        stored: int | None = None,
        limit: int | None = None,
    ) -> None:
        super().__init__(*args, problem=problem, hint=hint)
        self.what = what
        self.needed = needed
        self.stored = stored
        self.limit = limit


class UnsupportedModelError(AttnprobeError, TypeError):
    """The model (or one of its modules) has attention no adapter can read.

    ``model_class``: the name of the model's class, where the raising site says it.
    """

    model_class: str | None = None

    def __init__(
        self, *args: object, problem: str | None = None, hint: str | None = None, model_class: str | None = None
    ) -> None:
        super().__init__(*args, problem=problem, hint=hint)
        self.model_class = model_class


class NoAttentionError(UnsupportedModelError):
    """No attention module was found in the model, and none can appear while it runs: nothing to capture.
    ``hint`` names the arguments that would find some (``modules=``)."""


class DeclarationError(AttnprobeError, TypeError, ValueError):
    """A declaration given to ``check`` (``documents=``, ``sliding_window=``, ``mask_fn=``, ...) of the wrong type,
    shape or range, refused before any check runs. A ``TypeError`` and a ``ValueError`` alike.

    ``declaration``: the argument's name (``"documents"``); ``expected``: what it takes, in words; ``layer``: the
    layer of a ``{layer: value}`` declaration, None for one given for every layer.
    """

    declaration: str | None = None
    expected: str | None = None
    layer: int | None = None

    def __init__(
        self,
        *args: object,
        declaration: str | None = None,
        expected: str | None = None,
        layer: int | None = None,
        problem: str | None = None,
        hint: str | None = None,
    ) -> None:
        super().__init__(*args, problem=problem, hint=hint)
        self.declaration, self.expected, self.layer = declaration, expected, layer


class AttnprobeWarning(UserWarning):
    """A capture or check result that may not mean what it seems (missing fields, dropout, ...)."""


def _library_paths() -> tuple[str, ...]:
    """Folders and files whose frames are not the user's: attnprobe's package, torch, transformers, contextlib."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # the package is the repository root
    paths = [os.path.join(root, d) + os.sep for d in ("hooks", "probe", "reports")]
    paths += [os.path.join(root, "__init__.py"), os.path.join(root, "cli.py"), "<frozen "]
    for name in ("torch", "transformers", "contextlib"):
        file = getattr(sys.modules.get(name), "__file__", None)
        if file:
            paths.append(file if name == "contextlib" else os.path.dirname(file) + os.sep)
    return tuple(paths)


def warn_user(message: str, category: type[Warning] = AttnprobeWarning) -> None:
    """``warnings.warn(message, category)`` attributed to the user's line: the innermost frame outside
    attnprobe, torch and transformers (a test, a script, the user's model code), never attnprobe's own."""
    library = _library_paths()
    frame: FrameType | None = sys._getframe(0)
    level = 1  # level 1 is this frame
    while frame is not None and frame.f_code.co_filename.startswith(library):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
