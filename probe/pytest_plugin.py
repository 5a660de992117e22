"""pytest plugin, installed with attnprobe (entry point ``pytest11``): capture inside a test, assert
attention invariants, and read a failure as a table naming check, layer, head and positions.

Fixtures:

- ``attnprobe_capture``: ``with attnprobe_capture(model, **capture_options) as cap:`` works like
  ``attnprobe.capture`` and remembers every capture of the test (``attnprobe_capture.captures``);
  ``attnprobe_capture.run(model, inputs, **options)`` is ``attnprobe.run``.
- ``assert_attention``: ``assert_attention(cap, causal=True, attention_mask=mask)`` is
  ``attnprobe.assert_invariants`` with the traceback trimmed to the test's own line; without a capture
  it checks every capture taken with ``attnprobe_capture`` in this test.

A failing test shows the violation table as the assertion message and, in a section
``attnprobe captures``, what each capture of the test holds. Disable the plugin with
``pytest -p no:attnprobe``.

Example::

    def test_decoder_is_causal(attnprobe_capture, assert_attention):
        attn = attnprobe.MultiHeadAttention(16, num_heads=4, causal=True)
        with attnprobe_capture(attn) as cap:
            attn(torch.randn(2, 6, 16))
        assert_attention(cap, causal=True)
"""

from __future__ import annotations

import pytest


class _Tracked:
    """``attnprobe.capture`` that hands its Capture to the fixture on entry."""

    def __init__(self, ctx, captures: list) -> None:
        self._ctx = ctx
        self._captures = captures

    def __enter__(self):
        cap = self._ctx.__enter__()
        self._captures.append(cap)
        return cap

    def __exit__(self, exc_type, exc, tb):
        return self._ctx.__exit__(exc_type, exc, tb)


class CaptureFixture:
    """What the ``attnprobe_capture`` fixture gives a test."""

    def __init__(self) -> None:
        self.captures: list = []

    def __call__(self, model, **options) -> _Tracked:
        """``with attnprobe_capture(model, layers=..., heads=..., keep=...) as cap:`` (see ``attnprobe.capture``)."""
        import attnprobe

        return _Tracked(attnprobe.capture(model, **options), self.captures)

    def run(self, model, inputs, **options):
        """``attnprobe.run``: run ``model`` once under capture; returns ``(output, capture)``."""
        import attnprobe

        output, cap = attnprobe.run(model, inputs, **options)
        self.captures.append(cap)
        return output, cap

    @property
    def last(self):
        """The most recent capture of this test."""
        if not self.captures:
            raise LookupError("no capture yet: use `with attnprobe_capture(model) as cap:` first")
        return self.captures[-1]

    def records(self) -> list:
        """Every record of every capture of this test, in order."""
        return [r for cap in self.captures for r in cap]


@pytest.fixture
def attnprobe_capture() -> CaptureFixture:
    """Capture attention inside a test: ``with attnprobe_capture(model) as cap: model(x)``."""
    return CaptureFixture()


@pytest.fixture
def assert_attention(request):
    """``assert_attention(cap=None, *, causal=None, attention_mask=None, checks=None, atol=None, rtol=None)``, and
    the declarations of ``attnprobe.check`` (``documents=``, ``prefix_length=``, ``bidirectional=``,
    ``sliding_window=``, ``chunk_size=``, ``mask_fn=``, ``scale=``): fail the test with the violation table when an
    attention invariant is broken (or nothing could be verified). Without ``cap``, checks every capture taken with
    ``attnprobe_capture`` in this test."""

    def assert_attention_(cap=None, **options):
        __tracebackhide__ = True
        import attnprobe

        capture_or_record = cap
        if capture_or_record is None:
            if "attnprobe_capture" not in request.fixturenames:
                raise pytest.UsageError(
                    "assert_attention() without a capture checks the captures of the attnprobe_capture fixture; "
                    "request that fixture too, or pass the capture: assert_attention(cap)"
                )
            capture_or_record = request.getfixturevalue("attnprobe_capture").records()
        return attnprobe.assert_invariants(capture_or_record, **options)

    return assert_attention_


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item, call):
    report = yield
    if report.when == "call" and report.failed:
        fixture = getattr(item, "funcargs", {}).get("attnprobe_capture")
        if isinstance(fixture, CaptureFixture) and fixture.captures:
            report.sections.append(("attnprobe captures", "\n".join(repr(c) for c in fixture.captures)))
    return report
