"""Factories whose model takes token ids positionally (nanoGPT's ``GPT.forward(idx, targets=None)``) on the command
line, and a forgotten causal mask found from it with ``--modules auto`` and the registered ``tril`` buffer.

The model file is written into the test's folder and named as ``module:factory``, as a user's own file would be.
Its bug is a shipped one (Mikyx-1/TinyLLM#18, "Fix causal mask being skipped during multi-token KV-cache
prefill"): the attention applied its causal mask only ``if cache is None``, so a prefill that filled the cache ran
unmasked and every prompt token attended to later ones. ``gpt_prefill_skips_mask`` is that code; ``gpt`` has the
fix (the mask always applied).
"""

from __future__ import annotations

import importlib
import json

import pandas as pd
import pytest
from test_cli import cli, one_line_error  # noqa: F401  (the fixture)

MODEL_FILE = """
import math

import torch
from torch import nn
from torch.nn import functional as F


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd, n_head, block_size, masks_only_without_cache):
        super().__init__()
        self.c_attn = nn.Linear(n_embd, 3 * n_embd)
        self.c_proj = nn.Linear(n_embd, n_embd)
        self.n_head, self.n_embd = n_head, n_embd
        self.masks_only_without_cache = masks_only_without_cache
        self.register_buffer("bias", torch.tril(torch.ones(block_size, block_size)).view(1, 1, block_size, block_size))

    def forward(self, x, cache=None):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        if cache is not None:
            cache["k"], cache["v"] = k, v  # what the decoding steps attend to
        att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))  # (B, nh, T, T)
        if cache is None or not self.masks_only_without_cache:
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
        att = F.softmax(att, dim=-1)
        y = att @ v  # (B, nh, T, T) x (B, nh, T, hs) -> (B, nh, T, hs)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    def __init__(self, n_embd, n_head, block_size, masks_only_without_cache):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(n_embd), nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, block_size, masks_only_without_cache)
        self.mlp = nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))

    def forward(self, x, cache=None):
        x = x + self.attn(self.ln_1(x), cache)
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, vocab_size=50, block_size=16, n_layer=2, n_head=2, n_embd=16, masks_only_without_cache=False):
        super().__init__()
        self.wte, self.wpe = nn.Embedding(vocab_size, n_embd), nn.Embedding(block_size, n_embd)
        self.h = nn.ModuleList(
            [Block(n_embd, n_head, block_size, masks_only_without_cache) for _ in range(n_layer)]
        )
        self.ln_f = nn.LayerNorm(n_embd)
        self.lm_head = nn.Linear(n_embd, vocab_size, bias=False)

    def forward(self, idx, targets=None):
        b, t = idx.size()
        x = self.wte(idx) + self.wpe(torch.arange(0, t, dtype=torch.long, device=idx.device))
        caches = [{} for _ in self.h]  # a prefill: it fills the KV cache the generation then decodes against
        for block, cache in zip(self.h, caches):
            x = block(x, cache)
        logits = self.lm_head(self.ln_f(x))
        loss = None if targets is None else F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1))
        return logits, loss


def gpt():
    torch.manual_seed(0)
    return GPT()


def gpt_prefill_skips_mask():
    torch.manual_seed(0)
    return GPT(masks_only_without_cache=True)


def gpt_and_tokenizer():
    # a word-level tokenizer built here (no download): ids 0 to 9 of the model's 50
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[PAD]", "[UNK]", "the", "cat", "sat", "on", "a", "mat", "dog", "ran"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return gpt(), PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]")
"""

IDS = ["--ids", "1 2 3 4 5 6"]


@pytest.fixture
def gpt_file(tmp_path):
    (tmp_path / "nano_gpt_positional.py").write_text(MODEL_FILE)
    return "nano_gpt_positional"


def test_positional_ids_reach_the_model_from_every_command(cli, gpt_file, tmp_path):
    result = cli("info", f"{gpt_file}:gpt")
    assert result.exit_code == 0, result.output
    assert "read them with --modules h.0.attn,h.1.attn (or --modules auto)" in result.output
    result = cli("check", f"{gpt_file}:gpt", *IDS, "--modules", "auto", "-q", "--format", "json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.output)
    assert data["records"] == 2 and data["verified"] and data["ok"]
    result = cli("export", f"{gpt_file}:gpt", *IDS, "--modules", "h.0.attn,h.1.attn", "--out", "f.csv", "-q")
    assert result.exit_code == 0, result.output
    frame = pd.read_csv(tmp_path / "f.csv")
    assert sorted(frame.layer.unique()) == [0, 1] and len(frame) == 2 * 2 * 6 * 6  # layers x heads x query x key
    result = cli("report", f"{gpt_file}:gpt", *IDS, "--modules", "auto", "--out", "r.html", "-q")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "r.html").stat().st_size > 0


def test_without_modules_the_command_says_which_to_pass(cli, gpt_file):
    line = one_line_error(cli("check", f"{gpt_file}:gpt", *IDS, "-q"))
    assert "no attention found" in line and "--modules h.0.attn,h.1.attn or --modules auto" in line


def test_the_registered_tril_buffer_finds_a_forgotten_causal_mask(cli, gpt_file):
    # no --causal: the tril buffer each attention registers declares it causal, and the skipped mask breaks that
    result = cli("check", f"{gpt_file}:gpt_prefill_skips_mask", *IDS, "--modules", "auto", "-q", "--format", "json")
    assert result.exit_code == 1, result.output
    data = json.loads(result.output)
    causal = [v for v in data["violations"] if v["check"] == "causal"]
    assert {v["layer"] for v in causal} == {0, 1}, data["violations"]
    assert any("bias" in d for d in data["declarations"]), data["declarations"]  # where the causality was declared
    fixed = cli("check", f"{gpt_file}:gpt", *IDS, "--modules", "auto", "-q", "--format", "json")
    assert fixed.exit_code == 0 and json.loads(fixed.output)["ok"], fixed.output


def test_a_forward_that_takes_no_ids_is_refused_in_one_line(cli, tmp_path):
    (tmp_path / "takes_nothing.py").write_text(
        "import torch\n"
        "class M(torch.nn.Module):\n"
        "    def forward(self, *, embeddings=None):\n"
        "        return embeddings\n"
        "def make():\n"
        "    return M()\n"
    )
    line = one_line_error(cli("check", "takes_nothing:make", *IDS, "-q"))
    assert "M.forward takes no token ids" in line and "forward(idx, targets=None)" in line


SCAN_TEXTS = ["the cat sat on a mat", "a dog ran", "the dog sat on the cat", "a cat"]  # 6, 3, 6, 2 tokens


def test_scan_feeds_positional_ids_and_reads_the_modules_given(cli, gpt_file, tmp_path):
    (tmp_path / "d.txt").write_text("\n".join(SCAN_TEXTS) + "\n")
    factory = f"{gpt_file}:gpt_and_tokenizer"
    result = cli("scan", factory, "--data", "d.txt", "--modules", "auto", "--batch-size", "2", "--out", "all", "-q")
    assert result.exit_code == 0, result.output
    frame = pd.read_parquet(tmp_path / "all")
    assert len(frame) == 4 * 2 * 2  # input x layer x head
    assert sorted(frame.layer.unique()) == [0, 1] and set(frame.module) == {"h.0.attn", "h.1.attn"}
    tokens = frame.groupby("input").tokens.first().tolist()
    assert tokens == [6, 3, 6, 2] and (frame.rows == frame.tokens).all()  # no padding row counted or fed
    # the forward takes no attention_mask: a padded batch runs input by input, as batches of one do
    result = cli("scan", factory, "--data", "d.txt", "--modules", "h.1.attn", "--batch-size", "1", "--out", "one")
    assert result.exit_code == 0, result.output
    one = pd.read_parquet(tmp_path / "one")
    assert set(one.module) == {"h.1.attn"} and len(one) == 4 * 2  # one layer: the one module named (layer 0)
    both = frame[frame.module == "h.1.attn"].sort_values(["input", "head"]).reset_index(drop=True)
    one = one.sort_values(["input", "head"]).reset_index(drop=True)
    pd.testing.assert_series_equal(both.entropy, one.entropy)
    # causal attention: the first query row attends to itself alone, so its entropy is 0
    assert (frame.entropy_min.abs() < 1e-6).all()


def test_scan_says_what_a_factory_without_a_tokenizer_or_modules_needs(cli, gpt_file, tmp_path):
    (tmp_path / "d.txt").write_text("\n".join(SCAN_TEXTS) + "\n")
    line = one_line_error(cli("scan", f"{gpt_file}:gpt", "--data", "d.txt", "--out", "s", "-q"))
    assert "has no tokenizer" in line and "return (model, tokenizer)" in line
    line = one_line_error(cli("scan", f"{gpt_file}:gpt_and_tokenizer", "--data", "d.txt", "--out", "s", "-q"))
    assert "no attention found" in line and "--modules h.0.attn,h.1.attn or --modules auto" in line
    assert not (tmp_path / "s").exists()  # the failed scan leaves no folder to be "another scan" for the advised one
    result = cli("scan", f"{gpt_file}:gpt_and_tokenizer", "--data", "d.txt", "--out", "s", "--modules", "auto", "-q")
    assert result.exit_code == 0, result.output


def test_python_scan_reads_the_modules_given_and_ray_refuses_module_objects(gpt_file, tmp_path, monkeypatch):
    import attnprobe
    from attnprobe.probe.analyses.scan import ScanError

    monkeypatch.syspath_prepend(str(tmp_path))
    model, tokenizer = importlib.import_module(gpt_file).gpt_and_tokenizer()
    result = attnprobe.scan(model, SCAN_TEXTS[:2], tmp_path / "s", tokenizer=tokenizer, modules=[model.h[0].attn])
    frame = result.to_frame()
    assert set(frame.module) == {"h.0.attn"} and len(frame) == 2 * 2  # input x head of the one module
    assert json.loads((tmp_path / "s" / "_scan.json").read_text())["modules"] == ["h.0.attn"]  # what resumes it
    with pytest.raises(ScanError, match="names from named_modules"):
        attnprobe.scan(model, SCAN_TEXTS, tmp_path / "r", tokenizer=tokenizer, modules=[model.h[0].attn], engine="ray")
