"""Which statistics engine ``capture(stats_engine=)`` picks, without triton needed: the triton floor the kernel is
proven on (``triton_release.TRITON_MIN``) is the ``triton`` extra's lower bound, ``"auto"`` never picks an older
triton (torch 2.6 brings 3.2, whose interpreter stops on the kernel), and ``"triton"`` refuses one with a clear
error."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

import attnprobe
from attnprobe.probe.engine import engines, triton_release
from attnprobe.probe.selection import stats_engine_of

ROOT = Path(__file__).resolve().parents[1]


def test_the_triton_floor_is_the_extras_lower_bound():
    bound = re.search(r'triton = \["triton>=([0-9.]+)"\]', (ROOT / "pyproject.toml").read_text())
    assert bound is not None and bound.group(1) == triton_release.TRITON_MIN
    assert not triton_release.triton_release_proven("3.2.0")
    assert not triton_release.triton_release_proven("3.8.1")
    assert triton_release.triton_release_proven("3.9.0")
    assert triton_release.triton_release_proven("3.10.0+git1a2b3c")
    assert triton_release.triton_release_proven("4.0")


def test_an_unproven_triton_is_never_picked(monkeypatch):
    """With triton 3.2 installed (torch 2.6's), ``"auto"`` sees no kernel and ``"triton"`` is refused by name."""
    for module in (engines, triton_release):
        monkeypatch.setattr(module, "installed_triton", lambda: "3.2.0")
    engines.triton_available.cache_clear()
    try:
        assert not engines.triton_available()
    finally:
        engines.triton_available.cache_clear()
    if all(importlib.util.find_spec(name) is not None for name in ("triton", "numpy")):  # else: "not installed"
        with pytest.raises(attnprobe.SelectionError, match=r"triton>=3\.9.*triton 3\.2\.0 is installed") as info:
            stats_engine_of("triton")
        assert info.value.argument == "stats_engine"
    assert stats_engine_of("auto") == "auto"
