"""The check registry: one function per check, registered by name with severity and docs; check() runs it."""

import pytest
import torch

import attnprobe
from attnprobe.probe.checks import CHECK_DESCRIPTIONS, CHECKS, REGISTRY, register


@pytest.fixture
def registered():
    """Registers a check for one test and removes it afterwards."""
    added = []

    def add(name, **kwargs):
        def decorate(fn):
            register(name, **kwargs)(fn)
            added.append(name)
            return fn

        return decorate

    yield add
    for name in added:
        REGISTRY.pop(name, None)


def _capture():
    attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
    with attnprobe.capture(attn) as cap:
        attn(torch.randn(2, 5, 8))
    return cap


def test_builtin_checks_are_the_registry_in_order_with_docs_and_severity():
    assert tuple(REGISTRY)[: len(CHECKS)] == CHECKS
    assert CHECKS[0] == "finite" and CHECKS[-1] == "empty_rows"
    assert {n: REGISTRY[n].doc for n in CHECKS} == CHECK_DESCRIPTIONS
    assert REGISTRY["empty_rows"].severity == "info" and REGISTRY["causal"].severity == "error"


def test_a_new_check_is_one_function_and_runs_over_row_blocks(registered, monkeypatch):
    from attnprobe.probe import checks

    blocks = []

    @registered("last_row_small", severity="warning", doc="the last query row puts < 0.9 on one key")
    def last_row_small(run, block):
        blocks.append((block.start, block.Tq))
        run.ran("last_row_small", block)
        bad = block.w.amax(-1) >= 0.9  # (B, H, rows)
        run.emit(block, "last_row_small", "peak", bad, lambda n, _: f"{n} row(s) put >= 0.9 on one key")

    cap = _capture()
    result = attnprobe.check(cap)
    assert "last_row_small" in result.checks and result.coverage["last_row_small"] == 1
    assert all(v.severity == "warning" for v in result.violations if v.check == "last_row_small")
    assert any(v.check == "last_row_small" and 0 in v.queries for v in result.violations)  # query 0 sees one key
    assert blocks == [(0, 5)]
    blocks.clear()
    monkeypatch.setattr(checks, "CHUNK_ELEMENTS", 2 * 2 * 5 * 2)  # two query rows per block
    chunked = attnprobe.check(cap)
    assert blocks == [(0, 2), (2, 2), (4, 1)]
    assert chunked == result
    assert attnprobe.check(cap, checks=["last_row_small"]).checks == ("last_row_small",)


def test_register_refuses_bad_names_severities_and_duplicates(registered):
    with pytest.raises(ValueError, match="severity"):
        register("x", severity="fatal", doc="")
    with pytest.raises(ValueError, match="reserved"):
        register("lint_x", doc="")
    with pytest.raises(ValueError, match="already registered"):
        register("causal", doc="another")(lambda run, block: None)
