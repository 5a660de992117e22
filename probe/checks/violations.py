"""What invariant checks return: ``Violation`` records collected in a ``CheckResult``.

Checks return data; raising is a separate, opt-in call (``CheckResult.raise_if_failed``,
``attnprobe.assert_invariants``) whose ``InvariantError`` message is the result's table.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from types import MappingProxyType
from typing import Literal

#: How many offending positions a Violation lists (``count`` has the total).
MAX_POSITIONS = 8

Severity = Literal["error", "warning", "info"]
SEVERITIES: tuple[str, ...] = ("error", "warning", "info")

#: Columns of ``CheckResult.to_frame()``, in order.
FRAME_COLUMNS: tuple[str, ...] = (
    "check",
    "severity",
    "name",
    "layer",
    "head",
    "batch",
    "call",
    "step",
    "queries",
    "keys",
    "query_count",
    "key_count",
    "count",
    "worst",
    "message",
    "caused_by",
)


@dataclass(frozen=True)
class Violation:
    """One broken invariant in one (record, head, batch row), or one finding about a record.

    ``head`` is None when the finding concerns every head (a mask shared by the heads), ``batch``
    is None when it was summed over the batch rows.
    """

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
    """Offending query positions (``query_pos``, the KV-cache offset included), at most ``MAX_POSITIONS``."""
    keys: tuple[int, ...] = ()
    """Offending key positions, at most ``MAX_POSITIONS`` of them (empty when not per key)."""
    count: int = 0
    """Total number of offending entries (rows or cells, as the message says)."""
    worst: float | None = None
    """The worst error seen (e.g. the largest weight on a forbidden key)."""
    message: str = ""
    """One line saying what is wrong."""
    step: int | None = None
    """Generation step of the record (None outside ``generate``)."""
    query_count: int = 0
    """How many distinct query positions offend (``queries`` lists the first ``MAX_POSITIONS``);
    0 when no position is known."""
    key_count: int = 0
    """How many distinct key positions offend (``keys`` lists the first ``MAX_POSITIONS``)."""
    caused_by: str | None = None
    """The lint of the same record (layer and call) that explains this failure, e.g. ``"lint_softmax_axis"``
    (see ``attnprobe.probe.checks.lint.LINT_EXPLAINS``); None when no lint does."""

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity must be one of {SEVERITIES}, got {self.severity!r}")

    def where(self) -> str:
        parts = [f"layer {self.layer}" if self.layer is not None else self.name or "?"]
        if self.head is not None:
            parts.append(f"head {self.head}")
        if self.batch is not None:
            parts.append(f"batch {self.batch}")
        if self.call:
            parts.append(f"call {self.call}")
        if self.step is not None:
            parts.append(f"step {self.step}")
        return " ".join(parts)

    def __str__(self) -> str:
        return f"{self.check} [{self.severity}] {self.where()}: {self.message}"


def cause_groups(violations) -> tuple[list[tuple[Violation, list[Violation]]], list[Violation]]:
    """([(cause, the violations it explains), ...], the rest), in order. A cause is a violation that some
    other violation of the same record (layer, call) names in ``caused_by``."""
    violations = list(violations)
    explained: dict[tuple, list[Violation]] = {}
    for v in violations:
        if v.caused_by is not None:
            explained.setdefault((v.caused_by, v.layer, v.call), []).append(v)
    groups, rest, placed = [], [], set()
    for v in violations:
        key = (v.check, v.layer, v.call)
        if v.caused_by is None and key in explained and key not in placed:
            placed.add(key)
            groups.append((v, explained[key]))
    causes = {id(c) for c, _ in groups}
    for v in violations:
        if id(v) in causes or (v.caused_by is not None and (v.caused_by, v.layer, v.call) in placed):
            continue
        rest.append(v)
    return groups, rest


class InvariantError(AssertionError):
    """Raised by ``assert_invariants``/``CheckResult.raise_if_failed``; the message is the violation table."""

    def __init__(self, result: CheckResult) -> None:
        self.result = result
        super().__init__(result.table())

    def __reduce__(self):  # pickles with its result (multiprocessing, test runners)
        return (type(self), (self.result,))


InvariantError.__module__ = "attnprobe"  # tracebacks and pytest show attnprobe.InvariantError


def _positions(values: tuple[int, ...], total: int) -> str:
    """``0,1,2`` or, when the list was capped at ``MAX_POSITIONS``, ``0,1,...,7,... of 20``."""
    if not values:
        return "-"
    shown = ",".join(map(str, values))
    return f"{shown},... of {total}" if total > len(values) else shown


def _plural(n: int, severity: str) -> str:
    return f"{n} {severity}" if n == 1 or severity == "info" else f"{n} {severity}s"


def _layers(found: Iterable[Violation], shown: int = 6) -> str:
    """``0 (model.layers.0.self_attn), 1 (...)``: each layer with its module path, the first ``shown``."""
    names: dict[int, str] = {}
    for v in found:
        if v.layer is not None:
            names.setdefault(v.layer, v.name)
    if not names:
        return "-"
    layers = sorted(names)
    text = ", ".join(f"{layer} ({names[layer]})" if names[layer] else str(layer) for layer in layers[:shown])
    return text + (f", ... ({len(layers)} layers)" if len(layers) > shown else "")


@dataclass(frozen=True)
class CheckResult:
    """Violations found by ``attnprobe.check``; ``ok`` when there is no error-severity violation.

    ``skipped`` says, per check, where it could not run and why (a missing field is never a pass);
    ``coverage`` says on how many records each check did run.
    """

    violations: tuple[Violation, ...] = ()
    checks: tuple[str, ...] = ()
    """Names of the checks that were asked for, built-in checks first, then lint findings seen."""
    records: int = 0
    """How many records were checked."""
    skipped: tuple[str, ...] = field(default=())
    """One line per check that could not run on some record, saying why (e.g. no scores captured)."""
    coverage: Mapping[str, int] = field(default_factory=dict)
    """Check name -> number of records it ran on (0 = it never ran)."""
    declarations: tuple[str, ...] = ()
    """What the model declared and ``check`` held it to without being told, one line per declaration with its
    source and the layers it concerned: causality from a registered triangular mask buffer (with the line that
    registers it), a config's sliding windows and layer types, image blocks from the inputs' token_type_ids, packed
    documents from restarting position_ids, ... (a user's declaration of the same name replaces it)."""

    def __post_init__(self) -> None:
        if not isinstance(self.coverage, MappingProxyType):
            object.__setattr__(self, "coverage", MappingProxyType(dict(self.coverage)))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "coverage": dict(self.coverage)}

    def __setstate__(self, state: dict) -> None:
        for name, value in state.items():
            object.__setattr__(self, name, value)
        self.__post_init__()

    @property
    def ok(self) -> bool:
        return not any(v.severity == "error" for v in self.violations)

    @property
    def errors(self) -> tuple[Violation, ...]:
        return tuple(v for v in self.violations if v.severity == "error")

    @property
    def verified(self) -> bool:
        """True when at least one check ran on at least one record (an empty capture verifies nothing)."""
        return any(n > 0 for n in self.coverage.values())

    def __bool__(self) -> bool:
        """``assert attnprobe.check(cap)`` reads naturally: true when no error was found *and* something
        was verified (a check of an empty capture, or of checks that could not run, is not a pass;
        ``ok`` alone says only that no error was found)."""
        return self.ok and self.verified

    def __len__(self) -> int:
        return len(self.violations)

    def __iter__(self):
        return iter(self.violations)

    def filter(self, *, checks=None, severity=None, layers=None, heads=None) -> CheckResult:
        """The same result restricted to some checks, severities, layers or heads.

        ``checks``: names (``"lint"`` stands for every ``lint_*`` check); ``severity``: ``"error"``,
        ``"warning"``, ``"info"`` or a list of them. Findings that concern every head (``head`` None)
        are kept when ``heads`` is given.
        """
        check_set = None if checks is None else ({checks} if isinstance(checks, str) else set(checks))
        sev_set = None if severity is None else ({severity} if isinstance(severity, str) else set(severity))
        layer_set = None if layers is None else ({layers} if isinstance(layers, int) else set(layers))
        head_set = None if heads is None else ({heads} if isinstance(heads, int) else set(heads))
        if sev_set is not None and not sev_set <= set(SEVERITIES):
            raise ValueError(f"severity must be among {SEVERITIES}, got {sorted(sev_set)}")

        def wanted_check(name: str) -> bool:
            return check_set is None or name in check_set or ("lint" in check_set and name.startswith("lint_"))

        kept = tuple(
            v
            for v in self.violations
            if wanted_check(v.check)
            and (sev_set is None or v.severity in sev_set)
            and (layer_set is None or v.layer in layer_set)
            and (head_set is None or v.head is None or v.head in head_set)
        )
        return replace(
            self,
            violations=kept,
            checks=tuple(c for c in self.checks if wanted_check(c)),
            skipped=tuple(s for s in self.skipped if wanted_check(s.split(":", 1)[0])),
            coverage={c: n for c, n in self.coverage.items() if wanted_check(c)},
        )

    def counts(self) -> dict[str, int]:
        """Check name -> number of violations (all severities), in the order of ``checks``."""
        out = dict.fromkeys(self.checks, 0)
        for v in self.violations:
            out[v.check] = out.get(v.check, 0) + 1
        return out

    def to_frame(self):
        """One row per violation (pandas), columns ``FRAME_COLUMNS``."""
        import pandas as pd

        cols = list(FRAME_COLUMNS)
        rows = [{c: getattr(v, c) for c in cols} for v in self.violations]
        frame = pd.DataFrame(rows, columns=cols)
        return frame.astype(
            {
                "check": "string",
                "severity": "string",
                "name": "string",
                "message": "string",
                "layer": "Int64",
                "head": "Int64",
                "batch": "Int64",
                "step": "Int64",
                "call": "int64",
                "count": "int64",
                "query_count": "int64",
                "key_count": "int64",
                "worst": "float64",
                "caused_by": "string",
            }
        )

    def headline(self) -> str:
        errors = len(self.errors)
        others = len(self.violations) - errors
        text = (
            f"{errors} error(s), {others} other finding(s) in {self.records} record(s); "
            f"checks: {', '.join(self.checks) or '-'}"
        )
        if not self.verified:
            text += " -- NOTHING WAS VERIFIED"
        return text

    def table(self, max_rows: int = 50) -> str:
        """A readable text table: a headline, one line per check that found something, the
        violations (errors first, at most ``max_rows``) and what was skipped."""
        lines = [self.headline()]
        groups, rest = cause_groups(self.violations)
        by_check: dict[str, list[Violation]] = {}
        for v in [v for cause, explained in groups for v in (cause, *explained)] + rest:  # causes first
            by_check.setdefault(v.check, []).append(v)
        for check, found in by_check.items():
            severities = ", ".join(
                _plural(sum(v.severity == s for v in found), s)
                for s in SEVERITIES
                if any(v.severity == s for v in found)
            )
            causes = sorted({v.caused_by for v in found if v.caused_by})
            effects = [e for cause, explained in groups if cause.check == check for e in explained]
            lines.append(
                f"  {check}: {severities} in layer(s) {_layers(found)}"
                + (f", the cause of {len(effects)} finding(s) listed under it" if effects else "")
                + (f", caused by {' / '.join(causes)}" if causes else "")
            )
        for note in self.declarations:
            lines.append(f"  the model declares: {note}")
        if self.violations:
            order = {s: i for i, s in enumerate(SEVERITIES)}
            # each cause, then the failures it explains (indented); then the rest, errors first
            shown = [(v, v is not cause) for cause, explained in groups for v in (cause, *explained)]
            shown += [(v, False) for v in sorted(rest, key=lambda v: order[v.severity])]
            shown = shown[:max_rows]
            rows = [("check", "severity", "where", "queries", "keys", "count", "worst", "message")]
            for v, under in shown:
                rows.append(
                    (
                        ("  " if under else "") + v.check,
                        v.severity,
                        v.where(),
                        _positions(v.queries, v.query_count),
                        _positions(v.keys, v.key_count),
                        str(v.count),
                        "-" if v.worst is None else f"{v.worst:.3g}",
                        v.message,
                    )
                )
            widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
            lines.extend("  ".join(c.ljust(w) for c, w in zip(r[:-1], widths)) + "  " + r[-1] for r in rows)
            if len(self.violations) > max_rows:
                lines.append(f"... and {len(self.violations) - max_rows} more (CheckResult.to_frame() has them all)")
        if self.skipped:
            lines.append("skipped (not verified):")
            lines.extend(f"  {s}" for s in self.skipped)
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.table()

    def __repr__(self) -> str:
        return f"<CheckResult {self.headline()}>"

    def _repr_html_(self) -> str | None:
        """Notebook view: the HTML report's checks table (see ``attnprobe.reports.inline``)."""
        from ..display import repr_html

        return repr_html(self)

    def raise_if_failed(self) -> CheckResult:
        """Raise ``InvariantError`` when there is an error-severity violation or when nothing at all was
        verified (an empty capture, or checks that could not run on any record); return self otherwise."""
        __tracebackhide__ = True  # pytest: show the caller's line, not this one
        if not self.ok or not self.verified:
            raise InvariantError(self)
        return self
