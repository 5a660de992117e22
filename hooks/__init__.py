"""Adapters: one per kind of attention code. Each turns calls into the same ``AttentionRecord``."""

from __future__ import annotations

from .base import Adapter, Site


def default_adapters() -> list[Adapter]:
    """The adapters a capture tries, in order; a module claimed by one is not offered to the next."""
    from .hf import HuggingFaceAdapter
    from .own import OwnModuleAdapter

    return [OwnModuleAdapter(), HuggingFaceAdapter()]


__all__ = ["Adapter", "Site", "default_adapters"]
