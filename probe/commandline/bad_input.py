"""The command line's input error, apart so that every module that reads inputs can raise it (``loading`` names it
too: ``loading.InputError``)."""

from __future__ import annotations

from ..errors import AttnprobeError


class InputError(AttnprobeError, ValueError):
    """A model spec, input or option the command line cannot use; the message says what to do."""
