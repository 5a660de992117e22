"""What every adapter provides and receives. The contract is the core's (``probe/interface.py``): an
``Adapter`` finds ``Site``s and attaches hooks for one capture session, which it uses through ``Session``;
``Lazy`` is a tensor an adapter produces on demand. Adapters import these names from here."""

from __future__ import annotations

from ..probe.interface import Adapter, Lazy, Session, Site

__all__ = ["Adapter", "Lazy", "Session", "Site", "selected_heads"]


def selected_heads(site: Site) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(heads, kv_heads)`` of a selected site: the session sets both with its head count (``select_site``), so an
    adapter recording a call of a selected site always has them."""
    if site.heads is None or site.kv_heads is None:
        raise RuntimeError(f"layer {site.layer} ({site.name!r}) is selected but its heads are not known yet")
    return site.heads, site.kv_heads
