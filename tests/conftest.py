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


#: The slow tests (marker ``slow``): seconds each on 2 CPU cores (measured 2026-11-27 with ``--durations``: 3-35 s),
#: mostly fresh processes (examples, torchrun/accelerate launches, SIGINT at random moments, the hostile inputs'
#: child) and peak-memory measurements. pyproject.toml's addopts leave them out of a plain ``pytest`` run;
#: ``make test`` runs them too (``-m "not distributed"``), and ``pytest -m slow`` runs them alone. Keyed by
#: ``file::function`` (every parametrization) or a whole file; tests/test_suite_marks.py holds each key to a test
#: that exists.
SLOW_FILES = {"test_examples.py", "test_safety_hostile.py", "test_gpu_smoke.py"}
SLOW = {
    "test_scan.py::test_two_processes_equal_one",
    "test_checks_declarations.py::test_each_declaration_catches_its_bug_with_the_same_verdicts_from_statistics",
    "test_disk.py::test_store_peak_memory_is_one_record_not_the_capture",
    "test_safety_cli.py::test_sigint_at_random_moments_leaves_old_or_new_never_partial",
    "test_safety_cli.py::test_sigint_while_writing_keeps_the_old_report_and_exits_130",
    "test_safety_cli.py::test_sigint_inside_a_finalizer_still_stops_the_command_with_130",
    "test_long_reports.py::test_pooled_overview_and_windows_equal_a_full_captures_weights",
    "test_long_reports.py::test_long_report_opens_in_chromium_and_its_size_grows_as_the_input",
    "test_stats.py::test_statistics_never_allocate_a_full_query_by_key_tensor",
    "test_stats.py::test_multihead_attention_statistics_never_allocate_a_full_query_by_key_tensor",
    "test_monitor.py::test_trainer_callback_monitors_a_model_the_trainer_compiles",
}


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        key = f"{item.path.name}::{getattr(item, 'originalname', item.name)}"
        if key in SLOW or item.path.name in SLOW_FILES:
            item.add_marker(pytest.mark.slow)
