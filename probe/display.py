"""Inline display in notebooks (``_repr_html_``) without probe/ depending on reports/.

``Capture``, ``AttentionRecord`` and ``CheckResult`` ask ``repr_html(obj)`` for their notebook view. The renderer
lives in reports/ (the HTML report's own page, script and style); the package's ``__init__`` registers it here
with ``set_html_renderer`` when attnprobe is imported, as a function that imports reports only when first called.
Without a renderer ``repr_html`` returns None and notebooks show the text repr.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_renderer: Callable[[Any], str] | None = None


def set_html_renderer(renderer: Callable[[Any], str] | None) -> None:
    """Use ``renderer(obj) -> str`` for the notebook view of probe objects (None: text repr only)."""
    global _renderer
    _renderer = renderer


def repr_html(obj: Any) -> str | None:
    """The notebook HTML of ``obj``, or None when no renderer is registered."""
    return None if _renderer is None else _renderer(obj)
