"""Dotted paths that moved when probe/ was split into rooms by role (attnprobe 0.1.x), kept working for one
release: importing an old path warns (``DeprecationWarning``) and gives the module at its new path, the very
same module object, so attributes, ``from ... import`` and monkeypatching all reach the real code.

Only the paths the documentation published have a stand-in file (``probe/stats.py`` and the like, five lines
each); they go in attnprobe 0.3.
"""

from __future__ import annotations

import importlib
import sys
from types import ModuleType

from .errors import warn_user

#: old dotted path -> new dotted path
MOVED = {
    "attnprobe.probe.stats": "attnprobe.probe.engine.stats",
    "attnprobe.probe.pooling": "attnprobe.probe.engine.pooling",
    "attnprobe.probe.sinks": "attnprobe.probe.engine.sinks",
    "attnprobe.probe.frames": "attnprobe.probe.outputs.frames",
    "attnprobe.probe.lint": "attnprobe.probe.checks.lint",
    "attnprobe.probe.loading": "attnprobe.probe.commandline.loading",
}


def alias(old: str) -> ModuleType:
    """Warn that ``old`` moved, and make ``old`` name the module at its new path (called by the stand-in)."""
    new = MOVED[old]
    warn_user(f"{old} moved to {new}; the old path works until attnprobe 0.3", DeprecationWarning)
    module = importlib.import_module(new)
    sys.modules[old] = module  # the import system hands back what sys.modules holds when the stand-in finishes
    return module
