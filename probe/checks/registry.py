"""The check registry: a check is one function, registered once by name with its severity and docs.

``check()`` runs every registered check, in registration order, over each block of query rows of each
record (``RowBlock``: a full record is checked as a few blocks; a statistics-only record is one block of
per-row statistics). Adding a check means adding one function here or in your own module::

    @register("my_check", severity="warning", doc="one line for docs and CLI help")
    def my_check(run, block):
        ...  # run.skip(...) / run.ran(...) / run.emit(...)
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .violations import SEVERITIES, Severity


@dataclass(frozen=True)
class CheckSpec:
    """One registered check."""

    name: str
    severity: Severity
    """Severity of what it finds unless a finding says otherwise (``"error"``, ``"warning"``, ``"info"``)."""
    doc: str
    """One line: what holds when the check passes."""
    run: Callable
    """``run(check_run, block)``: looks at one ``RowBlock`` and reports through the ``CheckRun``."""


#: Registered checks by name, in the order they run and are reported.
REGISTRY: dict[str, CheckSpec] = {}


def register(name: str, *, severity: Severity = "error", doc: str):
    """Decorator: register ``fn(run, block)`` as the check ``name``."""
    if severity not in SEVERITIES:
        raise ValueError(f"severity must be one of {SEVERITIES}, got {severity!r}")
    if not name or name == "lint" or name.startswith("lint_"):
        raise ValueError(f"check name {name!r} is reserved (lint findings are named lint_*)")

    def decorate(fn: Callable) -> Callable:
        if name in REGISTRY and REGISTRY[name].run is not fn:
            raise ValueError(f"a check named {name!r} is already registered ({REGISTRY[name].run.__qualname__})")
        REGISTRY[name] = CheckSpec(name=name, severity=severity, doc=doc, run=fn)
        return fn

    return decorate


def names() -> tuple[str, ...]:
    """Registered check names, in order."""
    return tuple(REGISTRY)
