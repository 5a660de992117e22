"""What invariant checks return: ``Violation`` records collected in a ``CheckResult``.

Checks return data; raising is a separate, opt-in call (``CheckResult.raise_if_failed``,
``attnprobe.assert_invariants``) whose ``InvariantError`` message is the result's table.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

#: How many offending positions a Violation lists (``count`` has the total).
MAX_POSITIONS = 8

Severity = Literal["error", "warning", "info"]


@dataclass(frozen=True)
class Violation:
    """One broken invariant in one (record, head, batch row), or one finding about a record."""

    check: str
    """Stable check name, e.g. ``"causal"``, ``"row_sum"``, ``"output_match"``."""
    severity: Severity
    """``"error"`` fails a result; ``"warning"`` and ``"info"`` are reported only."""
    name: str
    """Module path of the record (``AttentionRecord.name``)."""
    layer: int | None
    head: int | None = None
    batch: int | None = None
    call: int = 0
    queries: tuple[int, ...] = ()
    """Offending query positions, at most ``MAX_POSITIONS`` of them."""
    keys: tuple[int, ...] = ()
    """Offending key positions, at most ``MAX_POSITIONS`` of them (empty when not per key)."""
    count: int = 0
    """Total number of offending entries (rows or cells, as the message says)."""
    worst: float | None = None
    """The worst error seen (e.g. the largest weight on a forbidden key)."""
    message: str = ""
    """One line saying what is wrong."""

    def where(self) -> str:
        parts = [f"layer {self.layer}" if self.layer is not None else self.name or "?"]
        if self.head is not None:
            parts.append(f"head {self.head}")
        if self.batch is not None:
            parts.append(f"batch {self.batch}")
        if self.call:
            parts.append(f"call {self.call}")
        return " ".join(parts)


class InvariantError(AssertionError):
    """Raised by ``assert_invariants``/``CheckResult.raise_if_failed``; the message is the violation table."""

    def __init__(self, result: "CheckResult") -> None:
        self.result = result
        super().__init__(result.table())


@dataclass(frozen=True)
class CheckResult:
    """Violations found by ``attnprobe.check``; ``ok`` when there is no error-severity violation."""

    violations: tuple[Violation, ...] = ()
    checks: tuple[str, ...] = ()
    """Names of the checks that ran."""
    records: int = 0
    """How many records were checked."""
    skipped: tuple[str, ...] = field(default=())
    """One line per check that could not run on some record, saying why (e.g. no scores captured)."""

    @property
    def ok(self) -> bool:
        return not any(v.severity == "error" for v in self.violations)

    @property
    def errors(self) -> tuple[Violation, ...]:
        return tuple(v for v in self.violations if v.severity == "error")

    def __bool__(self) -> bool:  # `assert attnprobe.check(cap)` reads naturally
        return self.ok

    def to_frame(self):
        """One row per violation (pandas)."""
        import pandas as pd

        cols = ["check", "severity", "name", "layer", "head", "batch", "call", "queries", "keys", "count", "worst", "message"]
        rows = [{c: getattr(v, c) for c in cols} for v in self.violations]
        frame = pd.DataFrame(rows, columns=cols)
        return frame.astype({"layer": "Int64", "head": "Int64", "batch": "Int64", "call": "int64", "count": "int64", "worst": "float64"})

    def table(self, max_rows: int = 50) -> str:
        """A readable text table of the violations."""
        head = f"{len(self.errors)} error(s), {len(self.violations) - len(self.errors)} other finding(s) in {self.records} record(s); checks: {', '.join(self.checks) or '-'}"
        if not self.violations:
            return head
        rows = [("check", "severity", "where", "queries", "keys", "worst", "message")]
        for v in self.violations[:max_rows]:
            more = f" (+{v.count - len(v.queries)})" if v.count > len(v.queries) and v.queries else ""
            rows.append((
                v.check,
                v.severity,
                v.where(),
                (",".join(map(str, v.queries)) + more) or "-",
                ",".join(map(str, v.keys)) or "-",
                "-" if v.worst is None else f"{v.worst:.3g}",
                v.message,
            ))
        widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
        lines = ["  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows]
        if len(self.violations) > max_rows:
            lines.append(f"... and {len(self.violations) - max_rows} more")
        return head + "\n" + "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def raise_if_failed(self) -> "CheckResult":
        """Raise ``InvariantError`` when there is an error-severity violation; return self otherwise."""
        if not self.ok:
            raise InvariantError(self)
        return self
