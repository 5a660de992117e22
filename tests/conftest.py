"""Shared test helpers. Tests are tiny, offline and deterministic."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn

# Triton reads TRITON_INTERPRET when a kernel is defined (@triton.jit), and any test may import the kernel module
# first (probe/engine/engines.py does when it asks whether triton is usable): without CUDA the kernel can only run
# under the interpreter, so it is set for the whole session, in every pytest-xdist worker, before any test runs
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def hooks_on(model: nn.Module) -> list[str]:
    """Names of modules that still carry a hook of any kind, plus global module hooks."""
    left = []
    for name, m in model.named_modules():
        for attr in (
            "_forward_hooks",
            "_forward_pre_hooks",
            "_backward_hooks",
            "_backward_pre_hooks",
            "_forward_hooks_with_kwargs",
            "_forward_pre_hooks_with_kwargs",
            "_forward_hooks_always_called",
        ):
            if getattr(m, attr, None):
                left.append(f"{name or '<root>'}.{attr}")
    from torch.nn.modules import module as module_mod

    for attr in ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks"):
        if getattr(module_mod, attr, None):
            left.append(f"global {attr}")
    return left


@pytest.fixture
def assert_no_hooks():
    """``assert_no_hooks(model)`` fails naming every hook still attached."""

    def check(model: nn.Module) -> None:
        left = hooks_on(model)
        assert not left, f"hooks left behind: {left}"

    return check


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
