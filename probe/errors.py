"""Errors and warnings raised by attnprobe. Every message says what was wrong and what to do."""

from __future__ import annotations

import sys
import warnings


class AttnprobeError(Exception):
    """Base class of every error attnprobe raises on purpose."""


class SelectionError(AttnprobeError, ValueError):
    """A layer, head or tensor selection that does not fit the model or the capture."""


class NotCapturedError(SelectionError, KeyError):
    """A head, layer or call the capture does not hold. A ``KeyError`` too (a failed lookup), but printed as
    the one-line message it is, not wrapped in quotes as ``KeyError`` prints its key."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class CaptureBudgetError(AttnprobeError, MemoryError):
    """Storing the next tensor would exceed ``max_bytes``; raised before the memory is spent."""


class UnsupportedModelError(AttnprobeError, TypeError):
    """The model (or one of its modules) has attention no adapter can read."""


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
    frame, level = sys._getframe(0), 1  # level 1 is this frame
    while frame is not None and frame.f_code.co_filename.startswith(library):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, category, stacklevel=level)
