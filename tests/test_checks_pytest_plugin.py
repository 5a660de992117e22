"""The pytest plugin (entry point pytest11): fixtures, a readable failure, the README's test example."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest_plugins = ["pytester"]


@pytest.fixture(autouse=True, scope="module")
def _adapters_loaded_before_pytester():
    """In-process pytester runs drop the modules imported during the run when they end. attnprobe loads
    its adapters on the first capture; if that happened inside a run, the next runs (and every later test
    file) would find adapter modules that no longer match the classes already imported. Capture once here."""
    import torch

    import attnprobe

    attn = attnprobe.MultiHeadAttention(8, num_heads=2)
    with attnprobe.capture(attn):
        attn(torch.randn(1, 2, 8))


README = Path(__file__).resolve().parents[1] / "README.md"


def readme_example() -> str:
    text = README.read_text()
    return re.search(r"```python\n(# tests/test_attention_masks\.py\n.*?)```", text, re.S).group(1)


def readme_failure_output() -> list[str]:
    text = README.read_text()
    block = re.search(r"<!-- readme:failure-output -->\n```text\n(.*?)```", text, re.S).group(1)
    return block.rstrip("\n").splitlines()


def without_numbers(lines) -> list[str]:
    return [re.sub(r"0x[0-9a-f]+|\d+\.\d+|[\d,]+ bytes", "#", line).rstrip() for line in lines]


FAILING = '''
import torch
import attnprobe


class LeakyDecoder(attnprobe.MultiHeadAttention):
    """Builds its causal mask one position too far: each query sees the next token."""

    def forward(self, x, attention_mask=None):
        B, T, _ = x.shape
        q = self.hook_q(self.q_proj(x).view(B, T, self.num_heads, self.d_head).transpose(1, 2))
        k = self.hook_k(self.k_proj(x).view(B, T, self.num_heads, self.d_head).transpose(1, 2))
        v = self.hook_v(self.v_proj(x).view(B, T, self.num_heads, self.d_head).transpose(1, 2))
        scores = self.hook_scores(q @ k.transpose(-2, -1) * self.scaling)
        allowed = self.hook_allowed(torch.ones(T, T, dtype=torch.bool).tril(1).expand(B, 1, T, T))
        weights = self.hook_weights(torch.softmax(scores.masked_fill(~allowed, float("-inf")), -1))
        out = self.hook_output((weights @ v).transpose(1, 2).reshape(B, T, -1))
        return self.out_proj(out)


def test_leaky_decoder_is_causal(attnprobe_capture, assert_attention):
    torch.manual_seed(0)
    model = LeakyDecoder(16, num_heads=4, causal=True).eval()
    with attnprobe_capture(model) as cap:
        model(torch.randn(2, 5, 16))
    assert_attention(cap, causal=True)
'''


def test_readme_example_runs_as_a_test_file(pytester):
    pytester.makepyfile(test_attention_masks=readme_example())
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)


def test_readme_failure_output_is_what_pytest_prints(pytester):
    code = readme_example().replace(
        '    with pytest.raises(attnprobe.InvariantError, match="padded key"):\n'
        "        assert_attention(cap, causal=True, attention_mask=attention_mask)",
        "    assert_attention(cap, causal=True, attention_mask=attention_mask)",
    )
    pytester.makepyfile(test_attention_masks=code)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1, failed=1)
    shown = readme_failure_output()
    out = result.outlines
    start = out.index(shown[0])
    assert without_numbers(out[start : start + len(shown)]) == without_numbers(shown)


def test_failure_names_check_layer_head_and_positions(pytester):
    pytester.makepyfile(test_leaky=FAILING)
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(
        [
            ">       assert_attention(cap, causal=True)",
            "E       attnprobe.InvariantError: 8 error(s), 0 other finding(s) in 1 record(s); *",
            "E         causal: 8 errors in layer(s) 0",
            "E       check * severity * where * queries * keys * count * worst * message",
            "E       causal * error * layer 0 head 0 batch 0 * 0,1,2,3 * 1,2,3,4 * 4 * weight on 4 key(s) after the "
            "query's position (max *; declared causal=True)*",
            "*- attnprobe captures -*",
            "<Capture of LeakyDecoder: 1 record(s), layers [[]0], * bytes>",
        ]
    )
    # the traceback stops at the test's own line: attnprobe's frames are hidden
    assert "probe/checks.py" not in result.stdout.str() and "pytest_plugin.py" not in result.stdout.str()


def test_assert_attention_without_captures_fails_clearly(pytester):
    pytester.makepyfile(
        test_usage="""
def test_without_the_capture_fixture(assert_attention):
    assert_attention()


def test_nothing_captured(attnprobe_capture, assert_attention):
    assert_attention()
"""
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=2)
    result.stdout.fnmatch_lines(
        [
            "*UsageError: assert_attention() without a capture checks the captures of the attnprobe_capture fixture*",
            "E       attnprobe.InvariantError: 0 error(s), 0 other finding(s) in 0 record(s); * NOTHING WAS VERIFIED",
            "*AttnprobeWarning: nothing to check*",
        ]
    )


def test_assert_attention_takes_the_capture_by_keyword(pytester):
    pytester.makepyfile(
        test_keyword=FAILING.replace("assert_attention(cap, causal=True)", "assert_attention(cap=cap, causal=True)")
    )
    result = pytester.runpytest("-p", "no:cacheprovider")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["E       attnprobe.InvariantError: 8 error(s), 0 other finding(s) in 1 record(s); *"])


def test_every_capture_of_the_test_is_checked(pytester):
    pytester.makepyfile(
        test_all=FAILING
        + """

def test_two_modules(attnprobe_capture, assert_attention):
    torch.manual_seed(0)
    good = attnprobe.MultiHeadAttention(16, num_heads=4, causal=True).eval()
    leaky = LeakyDecoder(16, num_heads=4, causal=True).eval()
    x = torch.randn(2, 5, 16)
    _, first = attnprobe_capture.run(good, x)
    assert attnprobe_capture.last is first and assert_attention().records == 1
    with attnprobe_capture(leaky):
        leaky(x)
    assert len(attnprobe_capture.records()) == 2
    assert_attention(causal=True)
"""
    )
    result = pytester.runpytest("-p", "no:cacheprovider", "-k", "two_modules")
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["E       attnprobe.InvariantError: 8 error(s), 0 other finding(s) in 2 record(s); *"])


def test_plugin_loads_from_the_entry_point_in_a_fresh_process(pytester):
    pytester.makepyfile(test_attention_masks=readme_example())
    result = pytester.runpytest_subprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=2)
    disabled = pytester.runpytest_subprocess("-p", "no:cacheprovider", "-p", "no:attnprobe")
    disabled.stdout.fnmatch_lines(["*fixture 'attnprobe_capture' not found*"])


def test_assert_attention_takes_the_declarations(attnprobe_capture, assert_attention):
    """issue 33: the fixture passes documents=, sliding_window=, ... on to the checks."""
    import torch

    import attnprobe

    attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
    with attnprobe_capture(attn):
        attn(torch.randn(1, 6, 8))
    assert assert_attention(sliding_window=6, prefix_length=1).ok
    with pytest.raises(attnprobe.InvariantError, match="declared documents="):
        assert_attention(documents=torch.tensor([[0, 0, 0, 1, 1, 1]]))
