"""What every adapter provides and receives. The contract is the core's (``probe/interface.py``): an
``Adapter`` finds ``Site``s and attaches hooks for one capture session, which it uses through ``Session``;
``Lazy`` is a tensor an adapter produces on demand. Adapters import these names from here."""

from __future__ import annotations

from ..probe.interface import Adapter, Lazy, Session, Site

__all__ = ["Adapter", "Lazy", "Session", "Site"]
