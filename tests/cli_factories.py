"""Factories the CLI tests load with ``package.module:factory`` (tests/ is on sys.path)."""

from __future__ import annotations

import torch
from torch import nn

import attnprobe


class TinyDecoder(nn.Module):
    """Token ids in, two causal attnprobe attention layers; forward(input_ids, attention_mask=None)."""

    def __init__(
        self, vocab: int = 50, d: int = 16, heads: int = 4, layers: int = 2, bug: str | None = None, causal: bool = True
    ):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        if bug is None:
            self.layers = nn.ModuleList(
                [attnprobe.MultiHeadAttention(d, num_heads=heads, causal=causal) for _ in range(layers)]
            )
        else:
            from checks_helpers import BuggyAttention

            self.layers = nn.ModuleList(
                [BuggyAttention(d, num_heads=heads, causal=True, bug=bug) for _ in range(layers)]
            )

    def forward(self, input_ids, attention_mask=None):
        x = self.emb(input_ids)
        for layer in self.layers:
            x = x + layer(x, attention_mask=attention_mask)
        return x


def tiny():
    torch.manual_seed(0)
    return TinyDecoder()


def interrupted_in_a_finalizer():
    """The tiny decoder, made after a Ctrl-C landed in a finalizer: a generator closed while it runs its ``finally``
    (Python cannot raise it there; it prints "Exception ignored in ..." and goes on)."""

    def closing():
        try:
            yield
        finally:
            raise KeyboardInterrupt

    dropped = closing()
    next(dropped)
    del dropped
    return tiny()


def leaky():
    """A decoder whose causal mask is built and never applied."""
    torch.manual_seed(0)
    return TinyDecoder(bug="mask_not_applied")


def broken():
    raise RuntimeError("the checkpoint is missing")


class Crashes(TinyDecoder):
    """A model whose forward fails on every input (a shape bug in the user's code)."""

    def forward(self, input_ids, attention_mask=None):
        x = super().forward(input_ids, attention_mask)
        return x @ torch.ones(3, 3)


def crashes():
    torch.manual_seed(0)
    return Crashes()


def not_a_model():
    return "hello"


NOT_CALLABLE = 3


class IgnoresPadding(TinyDecoder):
    """A bidirectional encoder that takes the attention mask and drops it: padded keys get weight,
    which only the declared input mask can reveal."""

    def forward(self, input_ids, attention_mask=None):
        return super().forward(input_ids)


def ignores_padding():
    torch.manual_seed(0)
    return IgnoresPadding(causal=False)


class NanoGPT(nn.Module):
    """Token ids in, two nanoGPT-style hand-written causal attention blocks (a registered tril buffer)."""

    def __init__(self, vocab: int = 50, bug=None):
        super().__init__()
        from wild_models import CausalSelfAttention

        self.emb = nn.Embedding(vocab, 16)
        self.h = nn.ModuleList([CausalSelfAttention(block_size=8, bug=bug) for _ in range(2)])

    def forward(self, input_ids):
        x = self.emb(input_ids)
        for block in self.h:
            x = x + block(x)
        return x


def nanogpt():
    torch.manual_seed(0)
    return NanoGPT()


def nanogpt_masks_the_past():
    torch.manual_seed(0)
    return NanoGPT(bug="mask_eq_1")


class SoftmaxAxisGPT(nn.Module):
    """Token ids in, one layer of single-head hand-written attention whose softmax runs over the query axis."""

    def __init__(self, vocab: int = 50):
        super().__init__()
        from torch_helpers import HeadList

        self.emb = nn.Embedding(vocab, 16)
        self.h = nn.ModuleList([HeadList(bug="softmax_axis")])

    def forward(self, input_ids):
        x = self.emb(input_ids)
        for block in self.h:
            x = x + block(x)
        return x


def softmax_axis_gpt():
    torch.manual_seed(0)
    return SoftmaxAxisGPT().eval()
