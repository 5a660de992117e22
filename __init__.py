"""attnprobe: see inside attention layers and prove they behave.

    >>> import torch, attnprobe
    >>> attn = attnprobe.MultiHeadAttention(16, num_heads=4, causal=True)
    >>> with attnprobe.capture(attn) as cap:
    ...     _ = attn(torch.randn(2, 6, 16))
    >>> cap[0].weights.shape   # (batch, head, query, key)
    torch.Size([2, 4, 6, 6])

Importing attnprobe registers, patches and prints nothing; pandas and matplotlib load only when a
frame or a report is asked for.
"""

from __future__ import annotations

import importlib

from .hooks.hf_tokens import token_strings
from .probe.capture import Capture, capture, run
from .probe.generation import stitch
from .probe.errors import (
    AttnprobeError,
    AttnprobeWarning,
    CaptureBudgetError,
    SelectionError,
    UnsupportedModelError,
)
from .probe.modules import CrossAttention, HookPoint, MultiHeadAttention
from .probe.record import TENSOR_FIELDS, AttentionRecord
from .probe.violations import CheckResult, InvariantError, Violation

__version__ = "0.1.0"

__all__ = [
    "AttentionRecord",
    "AttnprobeError",
    "AttnprobeWarning",
    "Capture",
    "CaptureBudgetError",
    "CheckResult",
    "CrossAttention",
    "HookPoint",
    "InvariantError",
    "MultiHeadAttention",
    "SelectionError",
    "TENSOR_FIELDS",
    "UnsupportedModelError",
    "Violation",
    "capture",
    "run",
    "stitch",
    "token_strings",
]


def __getattr__(name: str):
    # subpackages that pull heavy libraries load on first use: attnprobe.reports
    if name in ("reports",):
        return importlib.import_module(f".{name}", __name__)
    raise AttributeError(f"module 'attnprobe' has no attribute {name!r}")
