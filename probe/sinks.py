"""Moved to ``attnprobe.probe.engine.sinks``: this stand-in keeps the old path working, with a DeprecationWarning,
until attnprobe 0.3."""

from .moved import alias

alias(__name__)
