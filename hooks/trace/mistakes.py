"""Mistakes in hand-written attention seen on the traced calls: a mask whose result is dropped, heads merged by a
reshape that mixes queries. Each returns ``(check name, message)`` pairs (``probe/checks/lint.py`` names the checks)."""

from __future__ import annotations

import torch

from ...probe.checks import lint as lint_rules
from .chain import chain_step
from .recorder import Node, Scope, format_location

#: Calls that keep the values of the attention output and only lay them out anew, on the way to the head merge.
_LAYOUT_OPS = frozenset({"permute", "pass", "reshape"})


def head_merge_lint(out_node: Node, out: torch.Tensor, axes: list[list[tuple[str, int]]]) -> tuple[str, str] | None:
    """Follow the attention output to the reshape that merges the heads and judge it.

    ``axes``: for each axis of ``out``, its atoms (label, size) in memory order, e.g. ``[[("b", 2), ("h", 4)],
    [("q", 5)], [("d", 8)]]`` for a bmm output ``(B*H, T, D)``.
    """
    node, t = out_node, out
    for _ in range(8):
        nxt = next(
            (c for c in node.consumers if c.input is t and isinstance(c.out, torch.Tensor) and c.op in _LAYOUT_OPS),
            None,
        )
        if nxt is None:
            return None
        if nxt.op == "permute":
            axes = [axes[d] for d in nxt.params["dims"]]
        elif nxt.op == "reshape":
            atoms = [atom for axis in axes for atom in axis]
            verdict = lint_rules.head_merge_problem(atoms, tuple(nxt.out.shape))
            if verdict:
                order = ", ".join(label for label, _ in atoms)
                return (
                    lint_rules.LINT_HEAD_MERGE,
                    f"heads merged by a reshape {tuple(t.shape)} -> {tuple(nxt.out.shape)} at "
                    f"{format_location(nxt.where)} while the axes are ({order}) (b=batch, h=head, q=query, "
                    "d=d_head): the head axis is not next to d_head, so values of different queries are mixed; "
                    "move it first, e.g. out.transpose(1, 2).reshape(B, T, H * D)",
                )
            if verdict is False:
                return None
            regrouped = lint_rules.regroup_atoms(atoms, tuple(nxt.out.shape))
            if regrouped is None:
                return None
            axes = regrouped
        node, t = nxt, nxt.out
    return None


def unused_masks(scope: Scope, chain: set[int], returned: set[int]) -> list[tuple[str, str]]:
    """Masks computed from the scores (ids in ``chain``) whose result nothing uses, nor the module returns."""
    found = []
    for n in scope.nodes:
        if n.op not in ("masked_fill", "where", "add", "sub") or id(n) in chain or n.consumers or n.inplace:
            continue
        if not isinstance(n.out, torch.Tensor) or id(n.out) in returned:
            continue
        step = chain_step(n, n.out)
        if step is None or step.kind != "mask" or step.parent is None or id(step.parent) not in chain:
            continue
        name = n.name
        found.append(
            (
                lint_rules.LINT_UNUSED_MASK,
                f"the result of {name}(...) at {format_location(n.where)} is never used, so its mask is not applied to "
                f"the scores; assign it (scores = scores.{name}(...))"
                + (" or use masked_fill_" if n.op == "masked_fill" else ""),
            )
        )
    return found
