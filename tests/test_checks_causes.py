"""Findings ordered by cause (``caused_by``), and what a module declares about causality, checked without
being told (``probe/intent.py``, ``lint_unread_mask_buffer``)."""

from __future__ import annotations

import inspect
import json
import math
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from click.testing import CliRunner
from torch import nn
from torch_helpers import Head
from wild_models import CausalSelfAttention

import attnprobe
from attnprobe.cli import main
from attnprobe.probe.checks.lint import attribute_causes
from attnprobe.probe.intent import mask_buffers, module_intent
from attnprobe.reports import to_html

X = torch.randn(2, 6, 16, generator=torch.Generator().manual_seed(0))


class ForgetsMask(nn.Module):
    """nanoGPT attention that registers its causal mask and never applies it."""

    def __init__(self, n_embd=16, n_head=4, block_size=8):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.n_head, self.n_embd = n_head, n_embd
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))  # (B, nh, T, hs)
        att = F.softmax((q @ k.transpose(-2, -1)) / math.sqrt(k.size(-1)), dim=-1)  # the mask is never applied
        return (att @ v).transpose(1, 2).reshape(B, T, C)


class SaysCausal(ForgetsMask):
    """No mask buffer read either, but ``self.is_causal = True``."""

    def __init__(self):
        super().__init__()
        del self.bias
        self.is_causal = True


class OptionalMask(ForgetsMask):
    """Keeps the triangular buffer for when ``causal`` is set; bidirectional here."""

    def __init__(self):
        super().__init__()
        self.causal = False


def captured(module, x=X):
    with warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        with attnprobe.capture(module, modules=[module]) as cap:
            module(x)
    return cap


BUFFER_LINE = next(
    i
    for i, line in enumerate(inspect.getsourcelines(ForgetsMask)[0], inspect.getsourcelines(ForgetsMask)[1])
    if "register_buffer" in line
)
WHERE = f"test_checks_causes.py:{BUFFER_LINE}"


# ----------------------------------------------------------------------------------------- causes first
def test_softmax_axis_lint_comes_first_with_the_failures_it_explains():
    head = Head(bug="softmax_axis").eval()
    result = attnprobe.check(captured(head))
    first, *rest = result.violations
    assert first.check == "lint_softmax_axis" and first.caused_by is None
    explained = [v for v in rest if v.caused_by == "lint_softmax_axis"]
    assert {v.check for v in explained} >= {"row_sum", "softmax_match"}
    assert rest[: len(explained)] == explained  # grouped right under their cause
    text = result.table()
    lines = text.splitlines()
    assert lines[1].startswith("  lint_softmax_axis: 1 warning in layer(s) 0") and "the cause of" in lines[1]
    assert "caused by lint_softmax_axis" in lines[2]
    table = lines[lines.index(next(x for x in lines if x.startswith("check "))) + 1 :]
    assert table[0].startswith("lint_softmax_axis  warning") and "use dim=-1" in table[0]
    assert all(row.startswith("  ") for row in table[1 : 1 + len(explained)])  # indented under it
    with pytest.raises(attnprobe.InvariantError) as info:  # the pytest failure text: the same order
        attnprobe.assert_invariants(captured(head))
    message = str(info.value)
    assert message.index("lint_softmax_axis  warning") < message.index("row_sum  ")
    frame = result.to_frame()
    assert (
        frame.caused_by.iloc[0] is pd_na()
        and (frame.caused_by.iloc[1 : 1 + len(explained)] == "lint_softmax_axis").all()
    )


def pd_na():
    import pandas as pd

    return pd.NA


def test_attribute_causes_matches_the_record_and_head():
    V = attnprobe.Violation
    lint = V("lint_softmax_axis", "warning", "a", 0, head=1)
    same = V("row_sum", "error", "a", 0, head=1)
    other_head = V("row_sum", "error", "a", 0, head=2)
    other_layer = V("row_sum", "error", "b", 1, head=1)
    unrelated = V("output_match", "error", "a", 0, head=1)
    ordered = attribute_causes([other_layer, same, other_head, unrelated, lint])
    assert [(v.check, v.layer, v.head, v.caused_by) for v in ordered] == [
        ("lint_softmax_axis", 0, 1, None),
        ("row_sum", 0, 1, "lint_softmax_axis"),
        ("row_sum", 1, 1, None),
        ("row_sum", 0, 2, None),
        ("output_match", 0, 1, None),
    ]
    lonely = V("lint_same_kv", "warning", "a", 3)
    assert attribute_causes([lonely]) == [lonely]  # a lint that explains nothing stays where it was


def test_html_report_groups_failures_under_their_cause():
    head = Head(bug="softmax_axis").eval()
    cap = captured(head)
    document = to_html(cap, checks=attnprobe.check(cap))
    body = document.split('<table class="sortable violations">')[1].split("</table>")[0]
    rows = body.split("<tr class=")[1:]
    assert rows[0].startswith('"sev-warning"') and "lint_softmax_axis" in rows[0]
    assert rows[1].startswith('"sev-error caused"') and "(caused by lint_softmax_axis, above)" in rows[1]


@pytest.mark.filterwarnings("ignore::attnprobe.AttnprobeWarning")  # the lint also warns; the output is what counts
def test_cli_json_and_text_put_the_cause_first(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    args = ["check", "cli_factories:softmax_axis_gpt", "--ids", "1 2 3 4", "--modules", "auto", "-q"]
    result = CliRunner().invoke(main, [*args, "--format", "json"])
    assert result.exit_code == 1, result.output
    violations = json.loads(result.output)["violations"]
    assert violations[0]["check"] == "lint_softmax_axis" and violations[0]["caused_by"] is None
    assert violations[1]["caused_by"] == "lint_softmax_axis"
    lines = CliRunner().invoke(main, args).output.splitlines()
    cause = next(i for i, line in enumerate(lines) if line.startswith("lint_softmax_axis  warning"))
    assert re.match(r"  row_sum +error", lines[cause + 1]), lines[cause : cause + 2]


# ----------------------------------------------------------------------------------------- declared intent
def test_forgotten_causal_mask_fails_without_declaring_causal():
    result = attnprobe.check(captured(ForgetsMask().eval()))  # no causal=True
    assert not result.ok
    lint, *rest = result.violations
    assert lint.check == "lint_unread_mask_buffer" and WHERE in lint.message and "never reads it" in lint.message
    causal = [v for v in rest if v.check == "causal"]
    assert causal and all(v.caused_by == "lint_unread_mask_buffer" for v in causal)
    assert f"causal as declared by buffer 'bias' registered at {WHERE}" in causal[0].message
    assert result.declarations == (f"causal (declared by buffer 'bias' registered at {WHERE}) in layer(s) 0 (<root>)",)
    assert f"the model declares: causal (declared by buffer 'bias' registered at {WHERE})" in result.table()


def test_correct_nanogpt_is_verified_causal_from_its_buffer():
    result = attnprobe.check(captured(CausalSelfAttention().eval()))
    assert result.ok and result.coverage["causal"] == 1
    assert len(result.declarations) == 1 and "buffer 'bias' registered at wild_models.py:" in result.declarations[0]
    assert not [v for v in result.violations if v.check == "lint_unread_mask_buffer"]


def test_is_causal_attribute_declares_and_false_overrides_the_buffer():
    result = attnprobe.check(captured(SaysCausal().eval()))
    causal = [v for v in result.violations if v.check == "causal"]
    assert causal and "causal as declared by SaysCausal.is_causal = True" in causal[0].message
    assert not [v for v in result.violations if v.check.startswith("lint_")]
    quiet = attnprobe.check(captured(OptionalMask().eval()))  # causal = False wins over the buffer
    assert quiet.ok and not quiet.violations and not quiet.declarations
    declared = attnprobe.check(captured(OptionalMask().eval()), causal=True)  # the user's word wins over both
    assert any("declared causal=True" in v.message for v in declared.violations if v.check == "causal")


def test_library_modules_declare_nothing_here():
    assert module_intent(attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)) is None  # its record says
    assert module_intent(nn.MultiheadAttention(8, 2)) is None
    from checks_helpers import BuggyAttention

    assert module_intent(BuggyAttention(8, num_heads=2, causal=True)) is None  # a subclass: its calls say
    own = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
    with attnprobe.capture(own) as cap:
        own(torch.randn(1, 4, 8))
    assert "declared_causal" not in cap[0].meta and attnprobe.check(cap).declarations == ()


@pytest.mark.parametrize(
    "tensor, kind",
    [
        (torch.tril(torch.ones(6, 6)), "lower-triangular ones, 6x6"),
        (torch.tril(torch.ones(6, 6, dtype=torch.bool)), "lower-triangular ones, 6x6"),
        (torch.triu(torch.ones(6, 6, dtype=torch.bool), diagonal=1), "upper-triangular True (True = masked), 6x6"),
        (torch.triu(torch.full((6, 6), float("-inf")), diagonal=1), "additive (-inf above the diagonal), 6x6"),
        (torch.tril(torch.ones(1, 1, 300, 300)), "lower-triangular ones, 300x300"),
        (torch.ones(6, 6), None),
        (torch.randn(6, 6), None),
        (torch.tril(torch.ones(6, 6), diagonal=-1), None),  # shifted by one: not a causal mask
        (torch.tril(torch.ones(2, 6, 6)), None),  # a leading axis that is not 1
    ],
)
def test_mask_buffer_detection(tensor, kind):
    found = mask_buffers(_user_module(tensor))
    assert (found[0].description if found else None) == kind


def _user_module(tensor):
    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("mask", tensor)

    return Attn()
