"""attnprobe: see inside attention layers and prove they behave.

    >>> import torch, attnprobe
    >>> attn = attnprobe.MultiHeadAttention(16, num_heads=4, causal=True)
    >>> with attnprobe.capture(attn) as cap:
    ...     _ = attn(torch.randn(2, 6, 16))
    >>> cap[0].weights.shape   # (batch, head, query, key)
    torch.Size([2, 4, 6, 6])

Importing attnprobe registers, patches and prints nothing, and loads nothing heavy: the public names
below resolve on first use (so the pytest plugin installed with attnprobe costs other projects' test
runs nothing); pandas and matplotlib load only when a frame or a report is asked for.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from .probe.version import __version__

# public name -> module (relative to this package) that defines it
_EXPORTS = {
    "AttentionModule": ".probe.capture",
    "Capture": ".probe.capture",
    "attention_modules": ".hooks.api",
    "capture": ".hooks.api",
    "run": ".hooks.api",
    "scan": ".hooks.scan_api",
    "ScanBatches": ".hooks.ray_scan",
    "monitor": ".hooks.api",
    "compare": ".hooks.compare_models",
    "Comparison": ".probe.analyses.compare",
    "stitch": ".probe.outputs.generation",
    "load": ".probe.capture",
    "AttnprobeError": ".probe.errors",
    "AttnprobeWarning": ".probe.errors",
    "CaptureBudgetError": ".probe.errors",
    "DeclarationError": ".probe.errors",
    "SelectionError": ".probe.errors",
    "UnsupportedModelError": ".probe.errors",
    "CrossAttention": ".probe.modules",
    "HookPoint": ".probe.modules",
    "MultiHeadAttention": ".probe.modules",
    "TENSOR_FIELDS": ".probe.record",
    "AttentionRecord": ".probe.record",
    "CheckResult": ".probe.checks.violations",
    "InvariantError": ".probe.checks.violations",
    "Violation": ".probe.checks.violations",
    "CHECKS": ".probe.checks",
    "assert_invariants": ".probe.checks",
    "check": ".probe.checks",
    "token_strings": ".hooks.hf.token_strings",
    "ImageGrid": ".probe.outputs.image_tokens",
    "ImageTokens": ".probe.outputs.image_tokens",
    "locate_image_tokens": ".probe.outputs.image_tokens",
    "image_attention": ".probe.analyses.image_attention",
    "image_mass": ".probe.analyses.image_attention",
    "rollout": ".probe.analyses.rollout",
    "value_norms": ".probe.analyses.value_norms",
    "eviction_profile": ".probe.analyses.eviction",
    "EvictionPlan": ".probe.engine.kept_mass",
}
_SUBPACKAGES = ("reports",)
#: public modules whose code lives in a room: attnprobe.heads is hooks/heads.py
_MODULES = {"heads": ".hooks.heads", "integrations": ".hooks.integrations", "spans": ".probe.analyses.spans"}

__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # pragma: no cover - for type checkers and IDEs only
    from .hooks.api import attention_modules, capture, monitor, run
    from .hooks.compare_models import compare
    from .hooks.hf.token_strings import token_strings
    from .hooks.ray_scan import ScanBatches
    from .hooks.scan_api import scan
    from .probe.analyses.compare import Comparison
    from .probe.analyses.eviction import eviction_profile
    from .probe.analyses.image_attention import image_attention, image_mass
    from .probe.analyses.rollout import rollout
    from .probe.analyses.value_norms import value_norms
    from .probe.capture import AttentionModule, Capture, load
    from .probe.checks import CHECKS, assert_invariants, check
    from .probe.checks.violations import CheckResult, InvariantError, Violation
    from .probe.engine.kept_mass import EvictionPlan
    from .probe.errors import (
        AttnprobeError,
        AttnprobeWarning,
        CaptureBudgetError,
        DeclarationError,
        SelectionError,
        UnsupportedModelError,
    )
    from .probe.modules import CrossAttention, HookPoint, MultiHeadAttention
    from .probe.outputs.generation import stitch
    from .probe.outputs.image_tokens import ImageGrid, ImageTokens, locate_image_tokens
    from .probe.record import TENSOR_FIELDS, AttentionRecord


def _inline_html(obj) -> str:
    from .reports.inline import repr_html  # reports (jinja2, numpy) load on the first notebook display only

    return repr_html(obj)


# probe/ does not import reports/: the notebook view (_repr_html_) of captures, records and check results is
# wired here, the one place that sees both (registering it imports nothing heavy)
importlib.import_module(".probe.display", __name__).set_html_renderer(_inline_html)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(_EXPORTS[name], __name__), name)
        globals()[name] = value  # resolve once
        return value
    if name in _MODULES:
        module = importlib.import_module(_MODULES[name], __name__)
        globals()[name] = module
        return module
    if name in _SUBPACKAGES:
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'attnprobe' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_SUBPACKAGES) | set(_MODULES))
