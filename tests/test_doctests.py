"""The examples in the core's docstrings run as written (STYLE: a docstring has one example that runs)."""

from __future__ import annotations

import doctest
import importlib

import pytest

# module -> whether it has examples (a module listed without them is still searched, in case some appear)
CORE_MODULES = {
    "attnprobe": True,
    "attnprobe.hooks.api": True,
    "attnprobe.probe.capture": True,
    "attnprobe.probe.interface": False,
    "attnprobe.probe.record": True,
    "attnprobe.probe.modules": True,
    "attnprobe.probe.selection": True,
    "attnprobe.probe.outputs.frames": True,
    "attnprobe.probe.engine.attention_math": True,
    "attnprobe.probe.outputs.generation": False,  # its example needs a generating model: shown as comments
    "attnprobe.probe.outputs.disk": True,
    "attnprobe.probe.outputs.interop": True,
    "attnprobe.probe.engine.stats": True,
    "attnprobe.probe.analyses.scan": False,
    "attnprobe.probe.analyses.monitor": False,
    "attnprobe.probe.analyses.head_classes": False,
    "attnprobe.probe.analyses.rollout": True,
    "attnprobe.probe.analyses.value_norms": True,
    "attnprobe.probe.analyses.eviction": True,
    "attnprobe.probe.analyses.spans": True,
    "attnprobe.probe.rows": True,
    "attnprobe.probe.commandline.span_options": True,
    "attnprobe.reports.analysis_plots": True,
    "attnprobe.hooks.heads": True,
    "attnprobe.reports.monitor_views": True,
    "attnprobe.hooks.own": False,
    "attnprobe.hooks.base": False,
    "attnprobe.probe.outputs.image_tokens": True,
    "attnprobe.probe.analyses.image_attention": True,
    "attnprobe.reports.overlay": True,
}


@pytest.mark.parametrize("name", CORE_MODULES)
def test_docstring_examples_run(name):
    module = importlib.import_module(name)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in doctest.DocTestFinder(exclude_empty=True).find(module, name):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} docstring example(s) of {name} failed (output above)"
    assert (result.attempted > 0) == CORE_MODULES[name], f"{name}: {result.attempted} example(s) ran"
