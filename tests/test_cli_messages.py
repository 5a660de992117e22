"""The library's errors in command-line words, from the attributes they carry (probe/commandline/messages.py)."""

from __future__ import annotations

import pickle

import pytest
from test_cli import cli, one_line_error  # noqa: F401  (the fixture)
from torch import nn

from attnprobe.probe.commandline import messages
from attnprobe.probe.errors import (
    AttnprobeError,
    CaptureBudgetError,
    NoAttentionError,
    NotCapturedError,
    SelectionError,
    UnsupportedModelError,
)
from attnprobe.probe.files import OutputError

NANO = "cli_factories:nanogpt"


def test_errors_carry_their_data_and_keep_their_message():
    error = CaptureBudgetError("over. Select less", what="weights", needed=10, stored=5, limit=12, hint="Select less")
    assert (str(error), error.what, error.needed, error.stored, error.limit) == (
        "over. Select less",
        "weights",
        10,
        5,
        12,
    )
    assert isinstance(error, MemoryError) and isinstance(error, AttnprobeError)
    again = pickle.loads(pickle.dumps(error))  # a worker process's error reaches the parent with its data
    assert (again.needed, again.hint, str(again)) == (10, "Select less", "over. Select less")
    plain = SelectionError("no layer")
    assert (plain.argument, plain.value, plain.choices, plain.problem, plain.hint) == (None,) * 5
    assert str(NotCapturedError("layer 3 was not captured")) == "layer 3 was not captured"
    assert isinstance(NoAttentionError("none", model_class="M"), UnsupportedModelError)
    import errno

    disk = OutputError(errno.ENOSPC, "cannot write x: the disk is full")  # OSError's own arguments still parse
    assert (disk.errno, str(disk), disk.problem) == (errno.ENOSPC, "cannot write x: the disk is full", None)


def test_selection_errors_in_command_line_words():
    model = nn.Sequential(nn.Linear(2, 2))
    layers = SelectionError(
        "layer 7 is out of range: 2 layers; attnprobe.attention_modules(model) lists them",
        problem="layer 7 is out of range: 2 layers",
        hint="attnprobe.attention_modules(model) lists them",
        argument="layers",
        value=7,
    )
    assert messages.selection_message(layers, model) == "layer 7 is out of range: 2 layers; `attnprobe info` lists them"
    missing = SelectionError("modules=: ...", problem="'h.7' is not a module of M", argument="modules", choices=["h.0"])
    assert messages.selection_message(missing, model) == (
        "--modules: 'h.7' is not a module of M; names come from named_modules(), e.g. ['h.0']"
    )
    root = SelectionError("...", problem="'h' is a ModuleList at the root", hint="name a module", argument="modules")
    assert messages.selection_message(root, model) == "--modules: 'h' is a ModuleList at the root; name a module"
    # nothing to say it with: the library's message as it is, never rewritten from its text
    bare = SelectionError("layer 7 is out of range; attnprobe.attention_modules(model) lists them")
    assert messages.selection_message(bare, model) == str(bare)
    other = SelectionError("keep= got 'x'", problem="keep got 'x'", argument="keep")
    assert messages.selection_message(other, model) == "keep= got 'x'"


def test_budget_errors_in_command_line_words():
    error = CaptureBudgetError("...", what="weights of layer 0", needed=2048, stored=1024, limit=2500)
    line = messages.budget_message(error, "2500")
    assert line == (
        "capture budget exceeded: storing weights of layer 0 needs 2.0 KiB more, 1.0 KiB is already stored and "
        "--max-bytes is 2.4 KiB; select fewer layers (--layers) or heads (--heads), or raise --max-bytes"
    )
    assert messages.budget_message(CaptureBudgetError("..."), "1KB") == (
        "capture budget exceeded: the capture needs more than --max-bytes 1KB; select fewer layers (--layers) or "
        "heads (--heads), or raise --max-bytes"
    )


def test_a_budget_passed_while_the_model_runs_is_said_in_command_line_words(cli):
    # hand-written attention is found only while the model runs: the plan before the forward cannot refuse it
    line = one_line_error(cli("check", NANO, "--ids", "1 2 3 4", "--modules", "auto", "--max-bytes", "1KB", "-q"))
    assert line.startswith("attnprobe: error: capture budget exceeded: ")
    assert "select fewer layers (--layers) or heads (--heads), or raise --max-bytes" in line
    assert "=" not in line.split(": error: ", 1)[1], line


@pytest.mark.parametrize("spec", [NANO])
def test_no_attention_is_said_with_the_modules_to_pass(cli, spec):
    line = one_line_error(cli("report", spec, "--ids", "1 2 3 4", "-q"))
    assert "no attention found" in line and "--modules h.0,h.1 or --modules auto" in line
