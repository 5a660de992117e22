"""Which triton release the Triton statistics kernel (``probe/engine/triton_stats.py``) is proven on, read without
importing triton: ``capture(stats_engine="auto")`` never picks an older one and ``stats_engine="triton"`` refuses it
(torch 2.6 brings triton 3.2, whose interpreter stops on the kernel)."""

from __future__ import annotations

import importlib.metadata
import itertools

#: The oldest triton release the kernel is proven on (its tests pass under the interpreter): the lower bound of the
#: ``triton`` extra in pyproject.toml (``tests/test_stats_engines.py`` checks they agree).
TRITON_MIN = "3.9"


def triton_release_proven(version: str) -> bool:
    """Whether triton ``version`` (``triton.__version__``, e.g. ``"3.2.0"``, ``"3.9.0+git1a2b"``) is at least
    ``TRITON_MIN``."""
    return _release(version) >= _release(TRITON_MIN)


def _release(version: str) -> tuple[int, ...]:
    numbers = []
    for part in version.split("+")[0].split(".")[:3]:
        digits = "".join(itertools.takewhile(str.isdigit, part))
        numbers.append(int(digits or 0))
    return tuple(numbers)


def installed_triton() -> str | None:
    """The installed triton's version, read from its metadata without importing it; None when not installed."""
    try:
        return importlib.metadata.version("triton")
    except importlib.metadata.PackageNotFoundError:
        return None
