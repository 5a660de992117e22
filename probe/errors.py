"""Errors and warnings raised by attnprobe. Every message says what was wrong and what to do."""

from __future__ import annotations


class AttnprobeError(Exception):
    """Base class of every error attnprobe raises on purpose."""


class SelectionError(AttnprobeError, ValueError):
    """A layer, head or tensor selection that does not fit the model or the capture."""


class CaptureBudgetError(AttnprobeError, MemoryError):
    """Storing the next tensor would exceed ``max_bytes``; raised before the memory is spent."""


class UnsupportedModelError(AttnprobeError, TypeError):
    """The model (or one of its modules) has attention no adapter can read."""


class AttnprobeWarning(UserWarning):
    """A capture or check result that may not mean what it seems (missing fields, dropout, ...)."""
