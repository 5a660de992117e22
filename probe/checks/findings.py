"""One run of ``check``: what the checks found, grouped per (record, check, batch row, head), and what they skipped."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import torch

from ..record import AttentionRecord
from .blocks import RowBlock
from .declarations import Declared
from .registry import REGISTRY
from .violations import MAX_POSITIONS, Severity, Violation

#: Above this many (head, batch) groups per check and record, violations are summed over the batch.
MAX_GROUPS = 64

_DROPOUT_SENSITIVE = frozenset({"range", "row_sum", "softmax_match", "output_match"})


@dataclass
class _Group:
    """What one (batch row, head) contributes to one finding, summed over row chunks."""

    count: int = 0
    worst: float | None = None
    rows: torch.Tensor | None = None
    """(query,) bool: offending query rows of the whole record."""
    keys: torch.Tensor | None = None
    """(key,) bool: offending keys (None for findings about rows)."""

    def add(
        self,
        count: int,
        worst: float | None,
        rows: torch.Tensor,
        keys: torch.Tensor | None,
        *,
        start: int = 0,
        queries: int | None = None,
    ) -> None:
        """Add offending ``rows`` (query rows ``start:start + len(rows)`` of a record of ``queries`` rows)
        and ``keys``; one allocation per group, then in-place unions (a long record has many chunks)."""
        self.count += count
        if worst is not None:
            self.worst = worst if self.worst is None else max(self.worst, worst)
        if self.rows is None:
            self.rows = torch.zeros(len(rows) if queries is None else queries, dtype=torch.bool, device=rows.device)
        self.rows[start : start + len(rows)] |= rows
        if keys is not None:
            if self.keys is None:
                self.keys = keys.clone()
            else:
                self.keys |= keys


def _listed(flags: torch.Tensor | None, positions: torch.Tensor) -> tuple[tuple[int, ...], int]:
    """(the first ``MAX_POSITIONS`` flagged positions, how many are flagged)."""
    if flags is None:
        return (), 0
    where = flags.nonzero().flatten()
    return tuple(positions[where[:MAX_POSITIONS]].tolist()), int(where.numel())


@dataclass
class _Finding:
    """One kind of violation of one check in one record, per (batch, head) group."""

    rec: AttentionRecord
    check: str
    severity: Severity
    message: Callable[[int, float | None], str]
    axis: int  # size of the head axis of the offending tensor (1 = a mask shared by the heads)
    qpos: torch.Tensor  # (query,) reported position of each query row of the record
    kpos: torch.Tensor  # (key,) reported position of each key
    groups: dict = field(default_factory=dict)


class CheckRun:
    def __init__(self, *, declared: Declared, checks, atol, rtol) -> None:
        self.declared = declared
        self.causal = declared.causal
        self.attention_mask = declared.attention_mask
        self.atol, self.rtol = atol, rtol
        self.selected, self.lint_names = select_checks(checks)
        self.findings: dict[tuple, _Finding] = {}
        self.lint: list[Violation] = []
        self.lint_seen: list[str] = []
        self.skips: dict[tuple[str, str], dict[int, int]] = {}
        self.ran_on: dict[str, set[int]] = {c: set() for c in self.selected}
        self.bidirectional: dict[int, list] = {}  # record index -> [record, later real keys, any attended]
        self.dropout_layers: dict[int, float] = {}
        self.declarations: dict[str, dict[int, str]] = {}  # what a module declared -> {layer: name} held to it
        self.mask_fitted = False
        self.extra: list[Violation] = []  # findings about a whole record (scale)

    def skip(self, check: str, reason: str, where) -> None:
        """Say that ``check`` could not run on the record of ``where`` (anything with ``index`` and ``rec``)."""
        if check in self.selected:
            self.skips.setdefault((check, reason), {})[where.index] = where.rec.layer

    def ran(self, check: str, p: RowBlock) -> None:
        self.ran_on[check].add(p.index)

    def emit(
        self,
        p: RowBlock,
        check: str,
        kind: str,
        bad: torch.Tensor,
        message: Callable[[int, float | None], str],
        *,
        values: torch.Tensor | None = None,
        severity: Severity | None = None,
        keys: torch.Tensor | None = None,
    ) -> None:
        """Add offending cells ``(B, 1 or H, Tq, Tk)`` or rows ``(B, 1 or H, Tq)`` of one kind of finding.

        ``values`` (broadcastable to ``bad``) gives the error size for ``worst``. Positions and counts
        are reduced on the tensor; Python only walks the (batch, head) groups that have any.
        """
        if not bool(bad.any()) and (keys is None or not bool(keys.any())):
            return
        severity = REGISTRY[check].severity if severity is None else severity
        rec = p.rec
        if check in _DROPOUT_SENSITIVE and rec.dropout > 0:
            self.dropout_layers[rec.layer] = rec.dropout
            if rec.meta.get("dropout_in_eval"):
                why = (
                    f"dropout p={rec.dropout:g} was applied although the module is in eval mode (the code passes "
                    "dropout_p to scaled_dot_product_attention whatever module.training is), so weights and "
                    "outputs after dropout cannot sum to one or match; pass dropout_p=0 when not training"
                )
            else:
                why = (
                    f"dropout p={rec.dropout:g} is active (train mode), so weights and outputs after dropout "
                    "cannot sum to one or match; call model.eval() before capturing"
                )
            self.skip(check, why, p)
            return
        per_key = bad.dim() == 4
        finding = self.findings.setdefault(
            (p.index, check, kind),
            _Finding(rec, check, severity, message, axis=bad.shape[1], qpos=p.all_qpos, kpos=p.kpos),
        )
        flat = bad.flatten(2)
        counts = flat.sum(-1)  # (B, 1 or H)
        worst = None
        if values is not None:
            worst = torch.where(bad, values, -math.inf).flatten(2).amax(-1).tolist()
        rows = bad.any(-1) if per_key else bad  # (B, 1 or H, Tq)
        if per_key:
            keys = bad.any(-2)  # (B, 1 or H, Tk)
        elif keys is not None:  # row findings that also know their keys (statistics: weight per key)
            keys = keys.expand(*bad.shape[:2], keys.shape[-1])
            counts = torch.where(counts > 0, counts, keys.sum(-1))
        for b, h in (counts > 0).nonzero().tolist():
            finding.groups.setdefault((b, h), _Group()).add(
                int(counts[b, h]),
                None if worst is None or math.isinf(worst[b][h]) else worst[b][h],
                rows[b, h],
                None if keys is None else keys[b, h],
                start=p.start,
                queries=len(p.all_qpos),
            )

    def violations(self) -> list[Violation]:
        out = []
        for finding in self.findings.values():
            rec, groups = finding.rec, finding.groups
            if len(groups) > MAX_GROUPS:  # too many batch rows to list one by one: sum them per head
                per_head: dict = {}
                for (_, h), g in groups.items():
                    per_head.setdefault((None, h), _Group()).add(g.count, g.worst, g.rows, g.keys)
                groups = per_head
            for (b, h), g in sorted(groups.items(), key=lambda kv: (-1 if kv[0][0] is None else kv[0][0], kv[0][1])):
                head = rec.heads[h] if finding.axis > 1 else (rec.heads[0] if len(rec.heads) == 1 else None)
                queries, query_count = _listed(g.rows, finding.qpos)
                keys, key_count = _listed(g.keys, finding.kpos)
                out.append(
                    Violation(
                        check=finding.check,
                        severity=finding.severity,
                        name=rec.name,
                        layer=rec.layer,
                        head=head,
                        batch=b,
                        call=rec.call,
                        step=rec.step,
                        queries=queries,
                        keys=keys,
                        count=g.count,
                        worst=g.worst,
                        message=finding.message(g.count, g.worst),
                        query_count=query_count,
                        key_count=key_count,
                    )
                )
        out.extend(self.extra)
        for rec, later, attended in self.bidirectional.values():
            if later and not attended:
                out.append(
                    Violation(
                        check="causal",
                        severity="error",
                        name=rec.name,
                        layer=rec.layer,
                        call=rec.call,
                        step=rec.step,
                        count=later,
                        message="declared causal=False, but no query attends any later key: the model applied a "
                        "causal mask (is_causal left on, or a decoder mask in an encoder)",
                    )
                )
        return out


def select_checks(checks) -> tuple[tuple[str, ...], str | frozenset[str] | None]:
    """(built-in checks to run, lint selection: "all", a set of lint names, or None)."""
    known = tuple(REGISTRY)
    if checks is None:
        return known, "all"
    if not isinstance(checks, (str, Iterable)):
        raise TypeError(f"checks must be a check name or a list of them, got {checks!r}; choose from {list(known)}")
    names = (checks,) if isinstance(checks, str) else tuple(checks)
    if not names:
        raise ValueError(
            f"checks={checks!r} selects nothing; leave it None for every check, or choose from {list(known)}"
        )
    bad = [n for n in names if not isinstance(n, str) or (n not in known and n != "lint" and not n.startswith("lint_"))]
    if bad:
        raise ValueError(
            f"unknown check name(s) {bad}; choose from {list(known)}, 'lint' (every lint_* finding) or a lint_* name"
        )
    builtin = tuple(c for c in known if c in names)
    if "lint" in names:
        return builtin, "all"
    return builtin, frozenset(n for n in names if n.startswith("lint_")) or None


def records_of(capture_or_record) -> tuple[list[AttentionRecord], tuple[str, ...] | None]:
    """The records to check, and the tensors the capture was asked to keep (None when unknown)."""
    if isinstance(capture_or_record, AttentionRecord):
        return [capture_or_record], None
    from ..capture import Capture

    if isinstance(capture_or_record, Capture):
        keep = capture_or_record.info.get("selection", {}).get("keep")
        return list(capture_or_record), (tuple(keep) if keep is not None else None)
    if isinstance(capture_or_record, Iterable) and not isinstance(capture_or_record, (str, bytes, torch.Tensor)):
        records = list(capture_or_record)
        if all(isinstance(r, AttentionRecord) for r in records):
            return records, None
    raise TypeError(
        f"check() takes a Capture, an AttentionRecord or a list of records, got {type(capture_or_record).__name__}; "
        "capture first: `with attnprobe.capture(model) as cap: model(...)`, then check(cap)"
    )
