"""Lint warnings for hand-written attention: code patterns that are almost always bugs.

Each lint has its own name and is reported as a ``Violation`` with severity ``"warning"``:

===========================  ==========================================================================
``lint_unused_mask``         a mask was built from the scores and never applied (e.g. the result of
                             ``scores.masked_fill(mask, -inf)`` is not used; ``masked_fill_`` was meant)
``lint_same_kv``             the same tensor is used as keys and as values
``lint_head_merge``          heads are merged by a reshape that does not put the head axis right before
                             ``d_head`` (``(B, H, T, D).reshape(B, T, H * D)`` without ``transpose(1, 2)``);
                             followed through transposes, permutes and one-operand einsums
                             (``"bhqd->bqhd"``), also from an einsum ``weights @ V`` that writes
                             ``(B, T, D, H)``; a merge by einsum with the output weights is by name: fine
``lint_softmax_axis``        the softmax runs over an axis that is not the key axis
``lint_unread_mask_buffer``  a registered causal mask buffer (nanoGPT's ``self.bias``: lower-triangular)
                             that the forward never reads; the message names the line that registers it
===========================  ==========================================================================

A lint explains the failures it causes (``LINT_EXPLAINS``): ``check`` reports those under it, with
``Violation.caused_by`` naming the lint, so the cause comes first.

attnprobe finds these while it traces hand-written attention (``capture(..., modules=...)``), stores
them on the record (``record.meta["lint"]``, a tuple of ``Violation``) and warns once per layer and lint
with an ``AttnprobeWarning``. ``lints(capture)`` collects them. ``lint_same_kv`` is also checked on
direct ``F.scaled_dot_product_attention`` calls.

Example::

    >>> import torch, attnprobe
    >>> from torch import nn
    >>> class Head(nn.Module):                       # keys passed as values: a bug
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.q, self.k = nn.Linear(8, 8), nn.Linear(8, 8)
    ...     def forward(self, x):
    ...         q, k = self.q(x), self.k(x)
    ...         w = torch.softmax(q @ k.transpose(-2, -1) / 8 ** 0.5, dim=-1)
    ...         return w @ k
    >>> head = Head()
    >>> import warnings
    >>> with warnings.catch_warnings(record=True):
    ...     with attnprobe.capture(head, modules=[head]) as cap:
    ...         _ = head(torch.randn(1, 4, 8))
    >>> [v.check for v in attnprobe.probe.checks.lint.lints(cap)]
    ['lint_same_kv']
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import replace

from .violations import Violation

LINT_UNUSED_MASK = "lint_unused_mask"
LINT_SAME_KV = "lint_same_kv"
LINT_HEAD_MERGE = "lint_head_merge"
LINT_SOFTMAX_AXIS = "lint_softmax_axis"
LINT_UNREAD_MASK_BUFFER = "lint_unread_mask_buffer"

#: Every lint, in the order they are reported.
LINT_CHECKS: tuple[str, ...] = (
    LINT_UNUSED_MASK,
    LINT_SAME_KV,
    LINT_HEAD_MERGE,
    LINT_SOFTMAX_AXIS,
    LINT_UNREAD_MASK_BUFFER,
)

#: The failures each lint explains: a finding of these checks in the record (layer and call) of the lint is
#: reported under it, with ``caused_by`` naming it (see ``attribute_causes``). In the order causes are tried.
LINT_EXPLAINS: dict[str, frozenset[str]] = {
    LINT_SOFTMAX_AXIS: frozenset({"row_sum", "softmax_match", "range", "causal", "padding", "mask", "empty_rows"}),
    LINT_UNUSED_MASK: frozenset({"causal", "padding", "mask", "softmax_match"}),
    LINT_UNREAD_MASK_BUFFER: frozenset({"causal", "padding", "mask"}),
    LINT_HEAD_MERGE: frozenset({"output_match"}),
    LINT_SAME_KV: frozenset({"output_match"}),
}


def lint_violation(check: str, *, name: str, layer: int, call: int, message: str, head: int | None = None) -> Violation:
    """One lint finding as a warning-severity ``Violation``."""
    if check not in LINT_CHECKS:
        raise ValueError(f"unknown lint {check!r}; lints are {list(LINT_CHECKS)}")
    return Violation(
        check=check, severity="warning", name=name, layer=layer, head=head, call=call, count=1, message=message
    )


def attribute_causes(violations: Iterable[Violation]) -> list[Violation]:
    """``violations`` with ``caused_by`` set on each failure a lint of the same record (layer and call; the same
    head when the lint names one) explains (``LINT_EXPLAINS``), ordered by cause: each explaining lint followed
    by what it explains, then everything else, each part in the order given."""
    violations = list(violations)
    lints_of: dict[tuple, list[Violation]] = {}
    for v in violations:
        if v.check in LINT_EXPLAINS:
            lints_of.setdefault((v.layer, v.call), []).append(v)
    priority = list(LINT_EXPLAINS)
    explained: dict[int, list[Violation]] = {}
    rest = []
    for v in violations:
        if v.check in LINT_EXPLAINS:
            continue
        candidates = sorted(lints_of.get((v.layer, v.call), ()), key=lambda lint: priority.index(lint.check))
        cause = next(
            (
                lint
                for lint in candidates
                if v.check in LINT_EXPLAINS[lint.check] and (lint.head is None or v.head is None or lint.head == v.head)
            ),
            None,
        )
        if cause is None:
            rest.append(v)
        else:
            explained.setdefault(id(cause), []).append(replace(v, caused_by=cause.check))
    ordered = []
    for v in violations:
        if id(v) in explained:
            ordered += [v, *explained[id(v)]]
    unexplained = {id(v) for v in rest}
    return ordered + [
        v for v in violations if id(v) in unexplained or (v.check in LINT_EXPLAINS and id(v) not in explained)
    ]


def lints(records: Iterable) -> tuple[Violation, ...]:
    """Every lint finding stored on ``records`` (a ``Capture`` or any iterable of records), in record order."""
    found: list[Violation] = []
    for record in records:
        found.extend(record.meta.get("lint", ()))
    return tuple(found)


# ---------------------------------------------------------------------------------------------- reshapes
def reshape_groups(before: Sequence[int], after: Sequence[int]) -> list[tuple[list[int], list[int]]] | None:
    """How a reshape from ``before`` to ``after`` regroups axes: ``[(axes before, axes after), ...]``.

    Each group is a smallest run of consecutive axes with the same number of elements on both sides,
    e.g. ``(2, 4, 5, 8) -> (2, 5, 32)`` gives ``[([0], [0]), ([1, 2, 3], [1, 2])]``. Size-1 axes join
    the group on their left. None when the element counts differ or an axis has size 0.
    """
    if math.prod(before) != math.prod(after) or 0 in before or 0 in after:
        return None
    a = [i for i, s in enumerate(before) if s != 1]
    b = [j for j, s in enumerate(after) if s != 1]
    groups: list[tuple[list[int], list[int]]] = []
    i = j = 0
    while i < len(a) and j < len(b):
        gi, gj = [a[i]], [b[j]]
        pa, pb = before[a[i]], after[b[j]]
        i, j = i + 1, j + 1
        while pa != pb:
            if pa < pb:
                gi.append(a[i])
                pa *= before[a[i]]
                i += 1
            else:
                gj.append(b[j])
                pb *= after[b[j]]
                j += 1
        groups.append((gi, gj))
    if not groups:
        return [(list(range(len(before))), list(range(len(after))))]
    # size-1 axes: attach each to the group holding the axis on its left (or the first group)
    for side, dims in ((0, before), (1, after)):
        for axis, size in enumerate(dims):
            if size == 1:
                target = next((g for g in reversed(groups) if g[side][0] < axis), groups[0])
                target[side].append(axis)
                target[side].sort()
    return groups


def head_merge_problem(atoms: Sequence[tuple[str, int]], after: Sequence[int]) -> bool | None:
    """Whether reshaping a tensor whose axes, flattened in memory order, are ``atoms`` (label, size) into
    ``after`` merges the head axis ``"h"`` wrongly.

    True: ``h`` is merged with something other than the ``d`` that must follow it (the classic
    ``(B, H, T, D) -> (B, T, H * D)`` without moving ``H`` next to ``D``). False: ``h`` is merged as
    ``h, d`` (correct). None: this reshape does not merge ``h`` (keep following the tensor).
    """
    labels = [label for label, _ in atoms]
    if "h" not in labels:
        return None
    groups = reshape_groups([size for _, size in atoms], after)
    if groups is None:
        return None
    for atom_axes, _ in groups:
        if labels.index("h") not in atom_axes:
            continue
        members = [labels[i] for i in atom_axes if atoms[i][1] != 1 or labels[i] in ("h", "d")]
        if all(m in ("b", "h") for m in members):
            return None  # the head axis stays whole (alone, or folded into the batch for a bmm)
        at = members.index("h")
        return not (at + 1 < len(members) and members[at + 1] == "d")
    return None


def regroup_atoms(atoms: Sequence[tuple[str, int]], after: Sequence[int]) -> list[list[tuple[str, int]]] | None:
    """The atoms of each axis after a reshape that keeps the head axis whole (see ``head_merge_problem``)."""
    groups = reshape_groups([size for _, size in atoms], after)
    if groups is None:
        return None
    axes: list[list[tuple[str, int]]] = [[] for _ in after]
    for atom_axes, out_axes in groups:
        members = [atoms[i] for i in atom_axes]
        if len(out_axes) == 1:
            axes[out_axes[0]] = members
        elif len(members) == 1:  # one axis split in several: its parts are unnamed
            for j in out_axes:
                axes[j] = [(f"{members[0][0]}?", after[j])]
        else:
            for j in out_axes:
                axes[j] = [("?", after[j])]
    return axes
