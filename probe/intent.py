"""What a module says it means: causal attention, declared in its own code.

A hand-written attention module often states its intent even when its forward forgets it: nanoGPT
registers a lower-triangular ``bias`` buffer, many modules keep ``self.causal = True`` or
``self.is_causal = True``. ``module_intent`` reads those declarations (nothing is run) so that ``check``
can hold the record to them and say where the declaration came from, and so that a triangular mask
buffer the forward never reads can be reported (``lint_unread_mask_buffer``).

Only the user's own module classes are read (derived from ``nn.Module`` alone): torch's, transformers' and
attnprobe's modules, and their subclasses, say per call whether they are causal, and their adapters record
that (``record.causal``).

Example::

    >>> import torch
    >>> from torch import nn
    >>> class Attn(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.register_buffer("mask", torch.tril(torch.ones(4, 4)))
    >>> intent = module_intent(Attn())
    >>> intent.causal, intent.mask_buffers[0].name
    (True, 'mask')
"""

from __future__ import annotations

import inspect
import os
import re
from dataclasses import dataclass

import torch
from torch import nn

#: Boolean attributes that declare a module causal (True) or bidirectional (False), in the order read.
CAUSAL_ATTRIBUTES = ("is_causal", "causal")


@dataclass(frozen=True)
class MaskBuffer:
    """A registered buffer holding a causal (triangular) mask."""

    name: str
    description: str  # e.g. "lower-triangular 8x8 of ones"
    where: str  # "file.py:LINE" of the register_buffer call, or "" when the source cannot be read
    tensor: torch.Tensor  # the buffer itself (to tell whether the forward reads it)

    def declaration(self) -> str:
        """Where it comes from, e.g. "buffer 'bias' registered at model.py:15"."""
        return f"buffer {self.name!r}" + (f" registered at {self.where}" if self.where else "")


@dataclass(frozen=True)
class Intent:
    """What a module declares: ``causal`` True / False / None (nothing said), and by what (``source``)."""

    causal: bool | None
    source: str  # e.g. "CausalSelfAttention.is_causal = True" or a MaskBuffer.declaration()
    mask_buffers: tuple[MaskBuffer, ...] = ()


def library_code(obj) -> bool:
    """Whether a class or function comes from torch, transformers or attnprobe (not the user's code)."""
    return (getattr(obj, "__module__", "") or "").split(".")[0] in ("torch", "transformers", "attnprobe")


def _user_class(cls: type) -> bool:
    """A class of the user's own, derived from nothing of a library but ``nn.Module``: a subclass of attnprobe's,
    transformers' or torch's attention says per call whether it is causal, and its adapter records that."""
    return not any(library_code(k) for k in cls.__mro__ if k not in (nn.Module, object))


def _triangular(t: torch.Tensor) -> str | None:
    """A description when ``t`` (last two axes square, leading axes of size 1) is a causal mask: lower-triangular
    ones (True = may attend), an upper-triangular True (True = masked) or 0 on and below the diagonal with a
    large negative value above (additive). Reads a few rows, not the whole matrix."""
    if t.dim() < 2 or t.shape[-1] != t.shape[-2] or t.shape[-1] < 2 or t.is_meta or t.is_complex():
        return None
    if any(s != 1 for s in t.shape[:-2]):
        return None
    n = t.shape[-1]
    m = t.reshape(n, n)
    rows = range(n) if n <= 64 else sorted({0, 1, 2, n // 3, n // 2, (2 * n) // 3, n - 2, n - 1})
    kinds = {
        "lower-triangular ones": True,
        "upper-triangular True (True = masked)": True,
        "additive (-inf above the diagonal)": True,
    }
    with torch.no_grad():
        for i in rows:
            row = m[i].detach().to("cpu")
            past = torch.arange(n) <= i
            nonzero = row != 0
            kinds["lower-triangular ones"] &= bool(torch.equal(nonzero, past))
            kinds["upper-triangular True (True = masked)"] &= row.dtype == torch.bool and bool(
                torch.equal(nonzero, ~past)
            )
            kinds["additive (-inf above the diagonal)"] &= (
                row.is_floating_point() and bool(torch.equal(nonzero, ~past)) and bool((row[~past] <= -1e4).all())
            )
    found = next((k for k, ok in kinds.items() if ok), None)
    return None if found is None else f"{found}, {n}x{n}"


def _register_line(cls: type, name: str) -> str:
    """'file.py:LINE' where a class of ``cls``'s hierarchy registers buffer ``name``."""
    pattern = re.compile(r"register_buffer\(\s*[\"']" + re.escape(name) + r"[\"']")
    for klass in cls.__mro__:
        if library_code(klass) or klass is object:
            continue
        try:
            lines, start = inspect.getsourcelines(klass)
            filename = inspect.getsourcefile(klass) or "?"
        except (OSError, TypeError):
            continue
        for offset, line in enumerate(lines):
            if pattern.search(line):
                return f"{os.path.basename(filename)}:{start + offset}"
    return ""


def mask_buffers(module: nn.Module) -> tuple[MaskBuffer, ...]:
    """The module's own registered buffers that hold a causal mask (user classes only)."""
    if not _user_class(type(module)):
        return ()
    found = []
    for name, buffer in module.named_buffers(recurse=False):
        description = _triangular(buffer) if isinstance(buffer, torch.Tensor) else None
        if description is not None:
            found.append(MaskBuffer(name, description, _register_line(type(module), name), buffer))
    return tuple(found)


def module_intent(module: nn.Module) -> Intent | None:
    """What ``module`` declares about causality, or None when it declares nothing (or is a library class).

    An explicit boolean attribute (``is_causal``, ``causal``) wins over a mask buffer: a module that keeps a
    triangular buffer for when ``self.causal`` is set says it is bidirectional when ``causal = False``.
    """
    cls = type(module)
    if not _user_class(cls):
        return None
    buffers = mask_buffers(module)
    for attribute in CAUSAL_ATTRIBUTES:
        value = getattr(module, attribute, None)
        if isinstance(value, bool):
            return Intent(value, f"{cls.__name__}.{attribute} = {value}", buffers)
    if buffers:
        return Intent(True, buffers[0].declaration(), buffers)
    return None
