"""What a Hugging Face modeling file's source says about how its attention computes, read once per
function or module (cached): the dtype its own softmax runs in, and the lines that branch on the attention
implementation's *name*. Used by the interface adapter (``hf``) and the old-style fallback (``hf_fallback``).
"""

from __future__ import annotations

import inspect
import re
import sys
from collections.abc import Callable
from functools import cache

import torch

_SOFTMAX_DTYPE = re.compile(r"softmax\([^\n]*dtype=torch\.(float32|float16|bfloat16)")
_SOFTMAX_FLOAT = re.compile(r"softmax\([^\n,]*\.float\(\)")


@cache
def softmax_dtype(fn: Callable) -> torch.dtype | None:
    """The dtype an attention function's own softmax runs in: ``softmax(..., dtype=torch.float32)``
    or ``softmax(x.float(), ...)``; None when its source does not say."""
    try:
        source = inspect.getsource(inspect.unwrap(fn))
    except (OSError, TypeError):
        return None
    m = _SOFTMAX_DTYPE.search(source)
    if m:
        return getattr(torch, m.group(1))
    return torch.float32 if _SOFTMAX_FLOAT.search(source) else None


def record_dtype(dtype: torch.dtype, softmax: torch.dtype | None) -> torch.dtype:
    """The dtype the attention ran in: the coarser of the inputs' and the softmax's."""
    if softmax is not None and dtype.is_floating_point and torch.finfo(softmax).eps > torch.finfo(dtype).eps:
        return softmax
    return dtype


_BRANCH = re.compile(r"""_attn_implementation\s*(?:==|!=|(?:not\s+)?in\b)(.*)""")
_BASE_LITERAL = re.compile(r"""["'](?:sdpa|eager)["']""")
_HANDLED = 'using_eager = self.config._attn_implementation == "eager"'  # GPT-2's path, see gpt2_eager
#: transformers 5.0 dispatches with ``if self.config._attn_implementation != "eager": attention_interface =
#: ALL_ATTENTION_FUNCTIONS[self.config._attn_implementation]`` (5.1 and later: ``get_interface``): the dispatch
#: itself, not a branch on the name
_DISPATCH = '_attn_implementation != "eager":'


@cache
def name_branches(module_name: str) -> tuple[str, ...]:
    """Lines of a modeling file that compare the implementation *name* with "sdpa" or "eager".

    The fallback for old-style models refuses such modules under sdpa: asked for ``output_attentions`` they may
    compute attention another way (Falcon). Interface-based models are captured without renaming anything, so their
    branches on the name take the path they take without attnprobe.
    """
    mod = sys.modules.get(module_name)
    try:
        source = inspect.getsource(mod) if mod is not None else ""
    except (OSError, TypeError):
        return ()
    found = []
    lines = source.splitlines()
    for i, line in enumerate(lines):
        m = _BRANCH.search(line)
        if m and _BASE_LITERAL.search(m.group(1)) and _HANDLED not in line and not line.lstrip().startswith("#"):
            if _DISPATCH in line and i + 1 < len(lines) and "ALL_ATTENTION_FUNCTIONS[" in lines[i + 1]:
                continue  # transformers 5.0's dispatch itself (see hf_compat, item 1): our name is looked up there
            found.append(line.strip())
    return tuple(found)


_FUNCTIONAL_DROPOUT = re.compile(r"(?:functional|\bF)\.dropout\(")
_TORCH_MHA = re.compile(r"multi_head_attention_forward\(")


def averages_heads(cls: type) -> bool:
    """Whether an attention class hands back torch's head-averaged weights as its per-head weights: it calls
    ``F.multi_head_attention_forward`` without ``average_attn_weights=False`` (WavLM broadcasts that mean to every
    head; pytorch#32590). False where the source cannot be read."""
    source = _class_source(cls)
    return bool(_TORCH_MHA.search(source)) and "average_attn_weights=False" not in source


def calls_functional_dropout(cls: type) -> bool:
    """Whether an attention class's code calls ``nn.functional.dropout`` (XLM's, MPT's and ProphetNet's decoder's
    weights; BART-style modules' copy of theirs). False where the source cannot be read."""
    return bool(_FUNCTIONAL_DROPOUT.search(_class_source(cls)))


@cache
def _class_source(cls: type) -> str:
    """An attention class's source, read once per class; empty where it cannot be read."""
    try:
        return inspect.getsource(cls)
    except (OSError, TypeError):
        return ""
