"""Clear errors and warnings, and attention modules written by users on top of the interface."""

from __future__ import annotations

import pytest
import torch
import transformers
from hf_helpers import build, inputs, plain_and_captured
from torch import nn

import attnprobe
from attnprobe import SelectionError, UnsupportedModelError

SOURCE = '''
import torch
from torch import nn
from transformers.modeling_utils import AttentionInterface, ALL_ATTENTION_FUNCTIONS

def plain_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    weights = torch.softmax(query @ key.transpose(-1, -2) * scaling, dim=-1)
    return (weights @ value).transpose(1, 2), weights

eager_attention_forward = plain_attention

class UserAttention(nn.Module):
    """A user's own module that dispatches through transformers' attention interface."""

    def __init__(self, config, width=8, heads=2):
        super().__init__()
        self.config, self.num_heads, self.head_dim, self.is_causal = config, heads, width // heads, False
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, DEFAULT)
        out, _ = attention(self, q, k, v, None, scaling=self.head_dim ** -0.5)
        return out.reshape(b, t, -1)
'''


def _user_class(default: str, local_sdpa: bool = False):
    namespace: dict = {}
    exec(compile(SOURCE.replace("DEFAULT", default), f"<user_{default}>", "exec"), namespace)
    if local_sdpa:  # a file-local interface that overrides sdpa, as modeling_doge does
        local = namespace["AttentionInterface"]()
        local["sdpa"] = lambda module, q, k, v, mask, **kw: namespace["plain_attention"](module, q, k, v, mask, **kw)
        namespace["ALL_ATTENTION_FUNCTIONS"] = local
    return namespace["UserAttention"]


def _config(impl: str):
    config = transformers.PretrainedConfig()
    config._attn_implementation_internal = impl
    return config


def test_a_users_own_interface_module_is_captured(assert_no_hooks):
    attn = _user_class("plain_attention")(_config("sdpa")).eval()
    plain, out, cap = plain_and_captured(attn, torch.randn(2, 5, 8))
    assert torch.equal(plain, out) and len(cap) == 1
    r = cap[0]
    assert r.name == "" and r.backend == "sdpa" and r.weights.shape == (2, 2, 5, 5) and r.causal is False
    assert torch.allclose(r.weights.sum(-1), torch.ones(2, 2, 5))
    assert_no_hooks(attn)


def test_eager_default_must_be_findable():
    attn = _user_class("plain_attention")(_config("eager"))  # its default is not named *eager_attention_forward
    with pytest.raises(UnsupportedModelError, match=r"eager attention function of UserAttention.*'sdpa'"):
        with attnprobe.capture(attn):
            pass
    assert attn.config._attn_implementation == "eager"
    # the same module whose default is named like transformers' own eager functions is read
    attn = _user_class("eager_attention_forward")(_config("eager")).eval()
    plain, out, cap = plain_and_captured(attn, torch.randn(1, 4, 8))
    assert torch.equal(plain, out) and cap[0].weights_source == "observed" and cap[0].backend == "eager"


def test_overridden_sdpa_is_recorded_and_judged_by_its_output():
    # a file-local "sdpa" that is not transformers' own: the weights are what the arguments ask for
    # (recomputed), the output is what the function returned, and output_match compares the two
    attn = _user_class("plain_attention", local_sdpa=True)(_config("sdpa")).eval()
    plain, out, cap = plain_and_captured(attn, torch.randn(1, 4, 8))
    assert torch.equal(plain, out)
    r = cap[0]
    assert r.weights_source == "recomputed" and r.meta["base_function"] == "_user_class.<locals>.<lambda>"
    assert attnprobe.check(cap).ok


BRANCHING = """
class BranchingAttention(UserAttention):
    \"\"\"Model code that branches on the implementation's name, as Gemma 4 and glm_moe_dsa do: under "sdpa" it
    masks the last key, elsewhere it does not.\"\"\"

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.qkv(x).view(b, t, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        mask = None
        if self.config._attn_implementation == "sdpa":
            mask = torch.ones(t, t, dtype=torch.bool)
            mask[:, -1] = False
        attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, plain_attention)
        out, _ = attention(self, q, k, v, mask, scaling=self.head_dim ** -0.5)
        return out.reshape(b, t, -1)
"""


def test_model_code_that_branches_on_the_name_takes_its_own_path(assert_no_hooks):
    namespace: dict = {}
    exec(compile(SOURCE.replace("DEFAULT", "plain_attention") + BRANCHING, "<user_branching>", "exec"), namespace)
    attn = namespace["BranchingAttention"](_config("sdpa")).eval()
    seen = []
    with torch.no_grad():
        plain = attn(torch.ones(1, 4, 8))
        with attnprobe.capture(attn) as cap:
            seen.append(attn.config._attn_implementation)
            out = attn(torch.ones(1, 4, 8))
    assert seen == ["sdpa"] and attn.config._attn_implementation == "sdpa"
    assert torch.equal(plain, out)
    assert cap[0].allowed[0, 0, :, -1].tolist() == [False] * 4  # the "sdpa" branch's mask: the path taken
    assert cap[0].weights[..., -1].abs().max() == 0
    assert_no_hooks(attn)


def test_heads_out_of_range_fail_before_the_forward():
    model = build("llama")
    with pytest.raises(SelectionError, match=r"head\(s\) \[7\].*4 head\(s\)"):
        with attnprobe.capture(model, heads=[7]):
            pass


def test_old_style_local_attention_is_not_passed_off_as_query_key(recwarn):
    config = transformers.LongformerConfig(
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=50,
        attention_window=4,
        max_position_embeddings=40,
    )
    model = transformers.LongformerModel(config).eval()
    with pytest.raises(UnsupportedModelError, match=r"LongformerSelfAttention.*local window"):
        with attnprobe.capture(model):
            pass


def test_nothing_registers_at_import_and_plain_torch_models_load_no_transformers():
    import subprocess
    import sys

    code = (
        "import sys, torch, attnprobe\n"
        "m = torch.nn.TransformerEncoderLayer(8, 2)\n"
        "from attnprobe.hooks.hf.adapter import HuggingFaceAdapter\n"
        "assert HuggingFaceAdapter().find(m, set()) == []\n"
        "print('transformers' in sys.modules)\n"
    )  # registering needs transformers: none happened
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def test_training_mode_records_dropout_and_pre_dropout_weights():
    model = build("bert").train()
    batch = inputs("bert", "right")
    torch.manual_seed(3)
    plain = model(**batch).last_hidden_state
    torch.manual_seed(3)
    with attnprobe.capture(model, layers=[0]) as cap:
        out = model(**batch).last_hidden_state
    assert torch.equal(plain, out)  # recomputation draws no random numbers
    r = cap[0]
    assert r.dropout == pytest.approx(0.1) and not r.weights.requires_grad
    real = ~r.query_padding[:, None, :]
    assert torch.allclose(r.weights.sum(-1)[real.expand(-1, 4, -1)], torch.tensor(1.0))
    out.sum().backward()  # gradients still flow through the captured model
    assert model.embeddings.word_embeddings.weight.grad is not None


def test_module_subclass_of_nn_module_not_hf_is_left_to_others():
    layer = nn.MultiheadAttention(8, 2, batch_first=True)
    from attnprobe.hooks.hf.adapter import HuggingFaceAdapter

    assert HuggingFaceAdapter().find(layer, set()) == []


def test_query_heads_that_do_not_divide_the_key_heads_are_refused_by_name():
    from attnprobe.probe.selection import kv_of_heads

    assert kv_of_heads((0, 3, 5), 6, 2) == (0, 1, 1)  # grouped-query attention: three query heads per key head
    with pytest.raises(UnsupportedModelError, match="6 query heads and 4 key/value heads, which do not divide"):
        kv_of_heads((0, 5), 6, 4)  # no group size maps them: 6 // 4 would pair query head 5 with key head 5
