"""Wrong arguments get one-line errors naming what was expected; every AttnprobeWarning points at the
user's line (this file), never at attnprobe's, torch's or transformers' code."""

from __future__ import annotations

import ast
import contextlib
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import attnprobe
from attnprobe import AttnprobeError, AttnprobeWarning, reports

PACKAGE = Path(attnprobe.__file__).resolve().parent


@pytest.fixture(scope="module")
def cap():
    attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
    _, cap = attnprobe.run(attn, torch.randn(1, 4, 8))
    return cap


# ------------------------------------------------------------------------------------------ wrong arguments
WRONG = {
    "save_heatmap(capture)": (
        lambda cap, tmp: reports.save_heatmap(cap, tmp / "x.png", head=0),
        TypeError,
        "save_heatmap() draws one AttentionRecord, got a Capture",
    ),
    "heatmap(capture)": (lambda cap, tmp: reports.heatmap(cap, head=0), TypeError, "cap.record(0)"),
    "heatmap(tensor)": (
        lambda cap, tmp: reports.heatmap(torch.zeros(2), head=0),
        TypeError,
        "draws one AttentionRecord (e.g. cap[0] or cap.record(layer)), got Tensor",
    ),
    "heatmap(absent head)": (
        lambda cap, tmp: reports.heatmap(cap[0], head=5),
        KeyError,
        "head 5 of '<root>' was not captured (layer 0; stored heads: [0, 1])",
    ),
    "save_grid(record)": (
        lambda cap, tmp: reports.save_grid(cap[0], tmp / "g.png"),
        TypeError,
        "save_grid() takes a Capture, got one AttentionRecord",
    ),
    "head_grid(string)": (lambda cap, tmp: reports.head_grid("cap"), TypeError, "takes an attnprobe.Capture"),
    "save_summary(record)": (
        lambda cap, tmp: reports.save_summary(cap[0], tmp / "s.png"),
        TypeError,
        "pass the Capture it came from",
    ),
    "to_html(record)": (lambda cap, tmp: reports.to_html(cap[0]), TypeError, "expected an attnprobe.Capture"),
    "check(tensor)": (
        lambda cap, tmp: attnprobe.check(torch.zeros(3)),
        TypeError,
        "takes a Capture, an AttentionRecord",
    ),
    "record(absent layer)": (
        lambda cap, tmp: cap.record(3),
        KeyError,
        "no record for layer 3, call 0; captured layers: [0]",
    ),
    "select(absent head)": (lambda cap, tmp: cap.select(heads=[9]), KeyError, "stored heads: [0, 1]"),
    "Capture([int])": (
        lambda cap, tmp: attnprobe.Capture([cap[0], 1]),
        TypeError,
        "Capture() takes AttentionRecords (e.g. records of another capture), got int at position 1",
    ),
    "to_frame(tokens=int)": (
        lambda cap, tmp: cap.to_frame(tokens=3),
        TypeError,
        "tokens must be a list of token strings",
    ),
    "to_csv(int path)": (lambda cap, tmp: cap.to_csv(3), TypeError, "path must be a file path"),
    "capture(string)": (lambda cap, tmp: attnprobe.capture("gpt2"), AttnprobeError, "needs a torch.nn.Module, got str"),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_wrong_argument_is_a_one_line_error_naming_what_was_expected(case, cap, tmp_path):
    call, kind, text = WRONG[case]
    with pytest.raises(kind) as info:
        call(cap, tmp_path)
    message = str(info.value)
    assert text in message and "\n" not in message
    assert not message.startswith(("'", '"'))  # a KeyError's message, not its repr
    assert not list(tmp_path.iterdir())  # nothing written


# ------------------------------------------------------------------------------------------ warnings
class ScriptedInside(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = attnprobe.MultiHeadAttention(8, num_heads=2)
        self.scripted = torch.jit.script(nn.Linear(8, 8))

    def forward(self, x):
        return self.attn(self.scripted(x))


class OwnMHA(nn.MultiheadAttention):
    def forward(self, *args, **kwargs):
        return super().forward(*args, **kwargs)


class SameKV(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        q, k = self.q(x), self.k(x)
        return torch.softmax(q @ k.transpose(-2, -1) / 8**0.5, dim=-1) @ k  # keys as values: lint_same_kv


def _captured(model, *args, **options):
    with attnprobe.capture(model, **options) as cap:
        model(*args)
    return cap


def warn_empty_capture(cap):
    attn = attnprobe.MultiHeadAttention(8, num_heads=2)
    with attnprobe.capture(attn):
        pass  # never called


def warn_scripted(cap):
    _captured(ScriptedInside(), torch.randn(1, 3, 8))


def warn_mha_subclass(cap):
    model = nn.Sequential(attnprobe.MultiHeadAttention(8, num_heads=2))
    model.add_module("own", OwnMHA(8, 2))
    with attnprobe.capture(model):
        model[0](torch.randn(1, 3, 8))


def warn_lint(cap):
    head = SameKV()
    _captured(head, torch.randn(1, 4, 8), modules=[head])


def warn_check_empty(cap):
    attnprobe.check(attnprobe.Capture())


def warn_assert_invariants_empty(cap):
    attnprobe.assert_invariants(attnprobe.Capture())


def warn_dropout(cap):
    attn = attnprobe.MultiHeadAttention(8, num_heads=2, dropout=0.5).train()
    attnprobe.check(_captured(attn, torch.randn(1, 4, 8)))


def warn_declared_layer_absent(cap):
    attnprobe.check(cap, causal={7: True})


def warn_frame_left_out(cap):
    attn = attnprobe.MultiHeadAttention(8, num_heads=2)
    _captured(attn, torch.randn(1, 3, 8), keep=["q"]).to_frame()


def warn_summary_left_out(cap):
    attn = attnprobe.MultiHeadAttention(8, num_heads=2)
    _captured(attn, torch.randn(1, 3, 8), keep=["q"]).summary()


def warn_hf_old_style(cap):
    transformers = pytest.importorskip("transformers")
    config = transformers.GPTNeoConfig(
        hidden_size=16,
        num_layers=1,
        num_heads=4,
        vocab_size=50,
        attention_types=[[["global"], 1]],
        max_position_embeddings=16,
    )
    model = transformers.GPTNeoModel(config).eval()
    with torch.no_grad():
        _captured(model, torch.tensor([[1, 2, 3]]))


WARNS = [
    warn_empty_capture,
    warn_scripted,
    warn_mha_subclass,
    warn_lint,
    warn_check_empty,
    warn_assert_invariants_empty,
    warn_dropout,
    warn_declared_layer_absent,
    warn_frame_left_out,
    warn_summary_left_out,
    warn_hf_old_style,
]


@pytest.mark.parametrize("scenario", WARNS, ids=lambda f: f.__name__)
def test_every_attnprobe_warning_points_at_the_users_line(scenario, cap):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        # assert_invariants on an empty capture also fails: only its warning is looked at here
        with contextlib.suppress(AssertionError):
            scenario(cap)
    ours = [w for w in caught if issubclass(w.category, AttnprobeWarning)]
    assert ours, f"{scenario.__name__} did not warn"
    assert [(Path(w.filename).name, w.lineno > 0) for w in ours] == [(Path(__file__).name, True)] * len(ours), [
        (w.filename, w.lineno, str(w.message)[:80]) for w in ours
    ]


def test_every_attnprobe_warning_goes_through_warn_user():
    """No warnings.warn() of the package's own names a stacklevel by hand: they all go through warn_user."""
    found = []
    files = [p for d in ("hooks", "probe", "reports") for p in (PACKAGE / d).rglob("*.py")]
    for path in files + [PACKAGE / "__init__.py", PACKAGE / "cli.py"]:
        relative = path.relative_to(PACKAGE)
        if relative.as_posix() == "probe/errors.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr == "warn"
                and isinstance(node.func.value, ast.Name)
                and node.func.value.id == "warnings"
            ):
                found.append(f"{relative}:{node.lineno}")
    assert found == []
