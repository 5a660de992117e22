"""Shared helpers of the report tests: tiny models built from attnprobe's own modules, and a real browser.

The browser is Debian's Chromium (``/usr/bin/chromium``, or ``$ATTNPROBE_CHROMIUM``) driven by the
``playwright`` package; a browser download by the test tool is never used. When it is missing the
browser tests are reported as skipped with how to get it (never as passed), and they fail instead where
``ATTNPROBE_REQUIRE_BROWSER=1`` (CI sets it, so CI can never pass without having run them).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

import pytest
import torch
from torch import nn

import attnprobe
from attnprobe import CrossAttention, MultiHeadAttention

CHROMIUM = os.environ.get("ATTNPROBE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


class Stack(nn.Module):
    """``layers`` causal self-attention layers with residuals; key padding in the Hugging Face convention."""

    def __init__(self, layers: int = 3, d_model: int = 12, heads: int = 3, causal: bool = True):
        super().__init__()
        self.layers = nn.ModuleList(
            [MultiHeadAttention(d_model, num_heads=heads, causal=causal) for _ in range(layers)]
        )

    def forward(self, x, attention_mask=None):
        for layer in self.layers:
            x = x + layer(x, attention_mask=attention_mask)
        return x


class EncoderDecoder(nn.Module):
    """A self-attention encoder layer and a decoder with causal self-attention and cross-attention."""

    def __init__(self, d: int = 12, d_ctx: int = 8, heads: int = 2):
        super().__init__()
        self.enc = MultiHeadAttention(d_ctx, num_heads=2)
        self.dec_self = MultiHeadAttention(d, num_heads=heads, causal=True)
        self.dec_cross = CrossAttention(d, d_ctx, num_heads=heads)

    def forward(self, x, ctx, context_mask=None):
        ctx = self.enc(ctx, attention_mask=context_mask)
        x = self.dec_self(x)
        return self.dec_cross(x, ctx, attention_mask=context_mask)


def words(n: int, prefix: str = "w") -> list[str]:
    return [f"{prefix}{i}" for i in range(n)]


def stack_capture(assert_no_hooks, *, layers=3, heads=3, length=7, batch=2, padded=True, seed=0, model=None, **options):
    """Capture a ``Stack``; batch row 0 is left-padded by two positions when ``padded``."""
    torch.manual_seed(seed)
    model = model or Stack(layers, heads=heads).eval()
    x = torch.randn(batch, length, 12)
    mask = torch.ones(batch, length, dtype=torch.long)
    if padded:
        mask[0, :2] = 0
    _, cap = attnprobe.run(model, (x, mask), **options)
    assert_no_hooks(model)
    return cap


def cross_capture(assert_no_hooks, *, queries=5, keys=9):
    torch.manual_seed(1)
    model = EncoderDecoder().eval()
    ctx_mask = torch.ones(1, keys, dtype=torch.long)
    ctx_mask[0, -2:] = 0  # the context is right-padded
    _, cap = attnprobe.run(model, (torch.randn(1, queries, 12), torch.randn(1, keys, 8), ctx_mask))
    assert_no_hooks(model)
    return cap


def generation_capture(assert_no_hooks, *, length=8, prefill=4):
    """Records shaped as a KV-cached ``generate`` produces them: a prefill step, then one query per step."""
    cap = stack_capture(assert_no_hooks, layers=2, heads=2, length=length, batch=1, padded=False)
    steps = []
    cuts = [(0, prefill)] + [(t, t + 1) for t in range(prefill, length)]
    for step, (a, b) in enumerate(cuts):
        for rec in cap:
            steps.append(
                replace(
                    rec,
                    step=step,
                    call=step,
                    query_offset=a,
                    q=rec.q[:, :, a:b],
                    k=rec.k[:, :, :b],
                    v=rec.v[:, :, :b],
                    scores=rec.scores[:, :, a:b, :b],
                    weights=rec.weights[:, :, a:b, :b],
                    output=rec.output[:, :, a:b],
                    allowed=rec.allowed[:, :, a:b, :b],
                    query_padding=None if rec.query_padding is None else rec.query_padding[:, a:b],
                )
            )
    return attnprobe.Capture(steps, cap.info), cap


# ------------------------------------------------------------------------------------------ browser
@dataclass
class Opened:
    """A report open in a page, with everything it requested and every error it raised."""

    page: object
    url: str
    requests: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    dialogs: list[str] = field(default_factory=list)

    def foreign_requests(self) -> list[str]:
        """Requests other than the report itself and data:/blob: URLs."""
        return [u for u in self.requests if u != self.url and not u.startswith(("data:", "blob:"))]

    def assert_clean(self) -> None:
        api_errors = self.page.evaluate("window.attnprobe ? window.attnprobe.errors : ['no window.attnprobe']")
        assert not self.errors and not api_errors, f"JavaScript errors: {self.errors + api_errors}"
        assert not self.foreign_requests(), f"the report made requests: {self.foreign_requests()}"
        assert not self.dialogs, f"the page opened dialogs: {self.dialogs}"


# One Chromium for the whole session: every test module that imports the ``browser`` fixture gets its own
# session-scoped instance of it, and a second sync Playwright started while the first runs fails ("Sync API inside
# the asyncio loop"); the instances share this one, closed when the last of them is torn down.
_SHARED: dict = {"users": 0}


@pytest.fixture(scope="session")
def browser():
    """Debian's Chromium, headless, with a fresh profile. Skipped when it is missing (failed under
    ``ATTNPROBE_REQUIRE_BROWSER=1``)."""
    if not Path(CHROMIUM).exists():
        missing = pytest.fail if os.environ.get("ATTNPROBE_REQUIRE_BROWSER") == "1" else pytest.skip
        missing(
            f"Chromium not found at {CHROMIUM}: the HTML report is tested in a real browser. Install Debian's "
            "package (sudo apt-get install chromium; `make test` does it when it can) or point ATTNPROBE_CHROMIUM "
            "at a Chromium binary"
        )
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.fail("the browser tests need the playwright package: pip install -e '.[dev]'")
    if not _SHARED["users"]:
        profile = tempfile.TemporaryDirectory()
        playwright = sync_playwright().start()
        try:
            context = playwright.chromium.launch_persistent_context(
                profile.name,
                executable_path=CHROMIUM,
                headless=True,
                args=CHROMIUM_ARGS,
                offline=True,
                viewport={"width": 1280, "height": 900},
            )
        except BaseException:
            playwright.stop()
            profile.cleanup()
            raise
        _SHARED.update(profile=profile, playwright=playwright, context=context)
    _SHARED["users"] += 1
    try:
        yield _SHARED["context"]
    finally:
        _SHARED["users"] -= 1
        if not _SHARED["users"]:
            try:
                _SHARED["context"].close()
            finally:
                _SHARED["playwright"].stop()
                _SHARED["profile"].cleanup()


@pytest.fixture
def open_report(browser):
    """``open_report(path, hash="")`` loads a report from file:// and waits until its script is ready."""
    pages = []

    def open_(path: Path, fragment: str = "") -> Opened:
        page = browser.new_page()
        pages.append(page)
        url = Path(path).resolve().as_uri()
        opened = Opened(page, url)
        page.on("request", lambda r: opened.requests.append(r.url.split("#")[0]))
        page.on("pageerror", lambda e: opened.errors.append(f"pageerror: {e}"))
        page.on("console", lambda m: opened.errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
        page.on("dialog", lambda d: (opened.dialogs.append(d.message), d.dismiss()))
        page.goto(url + fragment)
        page.evaluate("window.attnprobe.ready")
        return opened

    yield open_
    for page in pages:
        page.close()


def canvas_colours(page, selector: str) -> int:
    """How many distinct colours the first canvas matching ``selector`` shows."""
    return page.evaluate(
        """(sel) => {
            const c = document.querySelector(sel);
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            const seen = new Set();
            for (let i = 0; i < d.length; i += 4)
                seen.add((d[i] << 16) | (d[i + 1] << 8) | d[i + 2] | (d[i + 3] << 24));
            return seen.size;
        }""",
        selector,
    )


def hover_cell(page, q: int, k: int, viewer: int = 0) -> dict[str, str]:
    """Point at cell (q, k) of the open head and return the readout's texts."""
    point = page.evaluate("([q, k, v]) => window.attnprobe.cellCenter(q, k, v)", [q, k, viewer])
    page.mouse.move(point["x"], point["y"])
    return page.evaluate(
        """() => {
            const r = document.getElementById('readout');
            const rows = Array.from(r.querySelectorAll('tr')).slice(1).map(tr => ({
                name: tr.cells[0].textContent, weight: tr.cells[1].textContent, score: tr.cells[2].textContent,
                notes: tr.cells[3].textContent}));
            const q = r.querySelector('.q-token'), k = r.querySelector('.k-token');
            return {text: r.textContent, rows, q: q && q.textContent, k: k && k.textContent};
        }"""
    )


def wait_until(page, predicate: str, timeout: float = 30.0, interval: float = 0.05) -> None:
    """Poll ``predicate`` (a JavaScript function, e.g. ``"() => window.attnprobe.ready"``) until it is true.

    Not ``page.wait_for_function``: its polling eval()s the predicate in older Playwright releases (1.45, the
    oldest the project declares), which the report's Content-Security-Policy forbids; ``evaluate`` calls the
    function without eval."""
    import time

    deadline = time.monotonic() + timeout
    while not page.evaluate(predicate):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout} s waiting for {predicate}")
        time.sleep(interval)
