"""Nothing runs that was not asked for: model-folder code needs --trust-remote-code, user modules never
shadow installed packages, and an import failing in the user's code is the user's error (exit 2)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from attnprobe.cli import main
from attnprobe.probe.commandline import loading

CONFIGURATION = """
from pathlib import Path
from transformers import PretrainedConfig
Path(MARKER).write_text("configuration code ran")

class EvilConfig(PretrainedConfig):
    model_type = "evilnet"
    def __init__(self, hidden_size=8, num_attention_heads=2, vocab_size=30, **kw):
        self.hidden_size, self.num_attention_heads, self.vocab_size = hidden_size, num_attention_heads, vocab_size
        super().__init__(**kw)
"""
MODELING = """
from pathlib import Path
import torch
from transformers import PreTrainedModel
import attnprobe
from .configuration_evil import EvilConfig
Path(MARKER).write_text("modeling code ran")

class EvilModel(PreTrainedModel):
    config_class = EvilConfig
    def __init__(self, config):
        super().__init__(config)
        self.emb = torch.nn.Embedding(config.vocab_size, config.hidden_size)
        self.attn = attnprobe.MultiHeadAttention(config.hidden_size, num_heads=config.num_attention_heads)
        self.post_init()
    def forward(self, input_ids, attention_mask=None):
        return self.attn(self.emb(input_ids))
"""


@pytest.fixture
def custom_folder(tmp_path):
    folder = tmp_path / "evil"
    folder.mkdir()
    marker = f"MARKER = {str(folder / 'RAN')!r}\n"  # transformers runs a copy of the file elsewhere
    (folder / "configuration_evil.py").write_text(marker + CONFIGURATION)
    (folder / "modeling_evil.py").write_text(marker + MODELING)
    (folder / "config.json").write_text(
        json.dumps(
            {
                "model_type": "evilnet",
                "hidden_size": 8,
                "num_attention_heads": 2,
                "vocab_size": 30,
                "auto_map": {"AutoConfig": "configuration_evil.EvilConfig", "AutoModel": "modeling_evil.EvilModel"},
            }
        )
    )
    return folder


def run_cli(args, cwd, stdin="y\ny\ny\n", extra_env=None):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", **(extra_env or {})}
    exe = Path(sys.executable).with_name("attnprobe")
    return subprocess.run(
        [str(exe), *map(str, args)], cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=300
    )


def test_folder_code_is_refused_without_asking(custom_folder, monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for command in (["info"], ["report", "--ids", "1 2 3"]):
        # "y" on stdin: transformers' own "[y/N]" prompt would take it; attnprobe never lets it ask
        result = CliRunner().invoke(main, [*command, str(custom_folder)], input="y\n", catch_exceptions=False)
        assert result.exit_code == 2, result.output
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1 and "[y/N]" not in result.output, result.output
        assert "ships its own model code (configuration_evil.py, modeling_evil.py" in lines[0]
        assert "--trust-remote-code" in lines[0]
        assert not (custom_folder / "RAN").exists()
    with pytest.raises(loading.InputError, match="trust_remote_code=True"):
        loading.load_model(str(custom_folder))
    assert not (custom_folder / "RAN").exists()


def test_folder_code_runs_with_trust_remote_code(custom_folder, tmp_path):
    done = run_cli(
        ["info", custom_folder, "--trust-remote-code"],
        tmp_path,
        extra_env={"HF_MODULES_CACHE": str(tmp_path / "modules")},
    )
    assert done.returncode == 0, done.stderr
    assert "class:    EvilModel" in done.stdout and "1 attention module(s)" in done.stdout
    assert (custom_folder / "RAN").exists()


def test_known_model_type_with_auto_map_loads_the_installed_code(tmp_path, monkeypatch):
    from transformers import BertConfig, BertModel

    folder = tmp_path / "bert"
    BertModel(
        BertConfig(hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=16, vocab_size=30)
    ).save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config["auto_map"] = {"AutoModel": "modeling_evil.EvilModel"}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "modeling_evil.py").write_text("raise SystemExit('folder code ran')\n")
    net, _, _ = loading.load_model(str(folder))
    assert type(net).__name__ == "BertModel"  # transformers' own class; the folder's file never imported


def test_info_builds_no_weights(tmp_path, monkeypatch):
    """A config describing ~200 G parameters: info answers from the meta device without allocating."""
    import resource

    from transformers import LlamaConfig

    folder = tmp_path / "huge"
    LlamaConfig(
        hidden_size=16384,
        intermediate_size=53248,
        num_hidden_layers=64,
        num_attention_heads=128,
        num_key_value_heads=8,
        vocab_size=128256,
    ).save_pretrained(folder)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["info", str(folder), "--format", "json"], catch_exceptions=False)
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["class"] == "LlamaModel" and len(data["attention_modules"]) == 64
    assert data["attention_modules"][0]["num_heads"] == 128 and data["attention_modules"][0]["num_kv_heads"] == 8
    grown_mb = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024  # Linux: KiB
    assert grown_mb < 500, grown_mb


# ------------------------------------------------------------------------------------------ factories
FACTORY = """
import torch, attnprobe
class Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.attn = torch.nn.Embedding(10, 8), attnprobe.MultiHeadAttention(8, num_heads=2)
    def forward(self, input_ids, attention_mask=None):
        return self.attn(self.emb(input_ids))
def make():
    torch.manual_seed(0)
    return Tiny()
"""


def test_a_pandas_py_in_the_folder_does_not_replace_pandas(tmp_path):
    (tmp_path / "pandas.py").write_text("raise RuntimeError('the pandas.py of the current folder was imported')\n")
    (tmp_path / "safety_factory.py").write_text(FACTORY)
    done = run_cli(["export", "safety_factory:make", "--ids", "1 2 3", "--out", "frame.csv"], tmp_path)
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "frame.csv").read_text().startswith("layer,name,")


@pytest.mark.parametrize(
    "body, expected",
    [
        ("def make(:\n    pass\n", "SyntaxError at {name}.py:1"),
        (
            "raise RuntimeError('no GPU here')\n",
            "importing '{name}' for factory '{name}:make' raised RuntimeError: no GPU here",
        ),
        ("import not_a_module_anywhere\n", "cannot import '{name}'"),
    ],
)
def test_factory_module_failing_on_import_is_exit_2(tmp_path, monkeypatch, body, expected):
    name = f"broken_factory_{abs(hash(body)) % 10**8}"  # a name of its own: imports are cached per process
    (tmp_path / f"{name}.py").write_text(textwrap.dedent(body))
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(main, ["info", f"{name}:make"], catch_exceptions=False)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "internal error" not in lines[0], lines
    assert expected.format(name=name) in lines[0]
