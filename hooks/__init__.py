"""Adapters: one per kind of attention code. Each turns calls into the same ``AttentionRecord``."""

from __future__ import annotations

from .base import Adapter, Site


def default_adapters(*, modules=None) -> list[Adapter]:
    """The adapters a capture tries, in order; a module claimed by one is not offered to the next.

    ``modules``: hand-written attention to trace (``capture(..., modules=)``), passed to the functional adapter.
    """
    from .flex import FlexAdapter
    from .functional import FunctionalAdapter
    from .hf.adapter import HuggingFaceAdapter
    from .own import OwnModuleAdapter
    from .torch_mha import TorchMHAAdapter

    functional = FunctionalAdapter(modules=modules)
    return [OwnModuleAdapter(), HuggingFaceAdapter(traced=functional), TorchMHAAdapter(), FlexAdapter(), functional]


__all__ = ["Adapter", "Site", "default_adapters"]
