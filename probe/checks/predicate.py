"""The declarations of one record as one predicate: which keys each query row may attend.

Every declaration is a shorthand for a FlexAttention-style ``mask_mod(b, h, q_idx, kv_idx) -> bool``; this module
evaluates them for one record, a block of query rows at a time (never a ``(query x key)`` tensor beyond one block):

- ``causal``: a key after the query's own is masked, unless an *opening* lets the row see ahead: its bidirectional
  block (``bidirectional=``), the prefix (``prefix_length=``);
- *bounds* confine each row to an interval of keys: its document (``documents=``), its sliding window
  (``sliding_window=``: ``q - kv < W``, the past side only, so a block sees ahead within itself), its chunk
  (``chunk_size=``, counted from each row's first real token as transformers does with left padding);
- ``mask_fn``: anything else, evaluated as given.

So for every shorthand a row's keys are one interval (``RecordDeclaration.interval``) and its per-row statistics
(first and last key with weight, first and last allowed key) decide a verdict exactly. What the model declares
itself, unasked, comes from ``record.meta["expects"]`` (the Hugging Face adapter reads the config and the inputs):
``{name: {"value": ..., "source": "..."}}`` for ``causal``, ``sliding_window``, ``window_ahead`` (the window's
reach after the query on bidirectional sliding layers), ``chunk_size``, ``bidirectional``, ``documents`` and
``scale``; a user's declaration of the same name replaces it.

Shapes: rows ``(batch or 1, query)`` of key *indices* (cache slots: a position less ``record.key_start``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import DeclarationError
from .declarations import Declared

#: Unasked declarations a record may carry (``record.meta["expects"]``), in the order they are read.
EXPECTED_NAMES = ("causal", "documents", "bidirectional", "sliding_window", "window_ahead", "chunk_size", "scale")

#: What a key index far outside any record is (an open side of an interval).
_FAR = 1 << 40


@dataclass(frozen=True)
class Bound:
    """A declaration that confines each query row to the key indices ``lo..hi`` (inclusive)."""

    name: str
    """The declaration, as ``check`` names it (``"documents"``, ``"sliding_window"``, ``"chunk_size"``)."""
    source: str
    """Where it comes from: ``"declared documents="`` or the model's config or inputs."""
    user: bool
    lo: torch.Tensor
    """``(batch or 1, query)`` long: the first key index each row may attend."""
    hi: torch.Tensor
    """``(batch or 1, query)`` long: the last."""


@dataclass(frozen=True)
class Opening:
    """Keys after the query's own that a causal record lets a row see anyway (a bidirectional block, the prefix)."""

    name: str
    source: str
    user: bool
    hi: torch.Tensor
    """``(batch or 1, query)`` long: the last key index the row sees ahead; -1 where it opens nothing."""


def _runs(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(start, end)`` ``(batch, seq)`` each: the first and last position of the run of equal ids each token is in."""
    S = ids.shape[1]
    index = torch.arange(S, device=ids.device).expand_as(ids)  # (batch, seq)
    new = torch.ones_like(ids, dtype=torch.bool)
    new[:, 1:] = ids[:, 1:] != ids[:, :-1]
    start = torch.where(new, index, 0).cummax(1).values  # (batch, seq)
    last = torch.ones_like(new)
    last[:, :-1] = new[:, 1:]
    end = torch.where(last, index, S - 1).flip(1).cummin(1).values.flip(1)  # (batch, seq)
    return start, end


def spans_to_ids(spans: tuple[tuple[int, int], ...], batch: int, length: int) -> torch.Tensor:
    """``[(start, end), ...]`` (end exclusive) as block ids ``(batch, length)``: span i is block i + 1, 0 elsewhere."""
    ids = torch.zeros(batch, length, dtype=torch.long)
    for i, (s, e) in enumerate(spans):
        ids[:, s : min(e, length)] = i + 1
    return ids


def expected(meta: Mapping[str, Any], name: str) -> tuple[Any, str] | None:
    """``(value, source)`` of the unasked declaration ``name`` in ``record.meta["expects"]``, or None."""
    expects = meta.get("expects")
    entry = expects.get(name) if isinstance(expects, Mapping) else None
    if not isinstance(entry, Mapping) or entry.get("value") is None:
        return None
    return entry["value"], str(entry.get("source", "the model"))


class RecordDeclaration:
    """What the declarations, the user's and the model's own, say about one record's query rows.

    Built by ``RecordFacts`` from ``Declared`` and ``record.meta["expects"]``; the checks ``causal``, ``declared``,
    ``reach`` and ``scale`` read it. ``problems`` lists ``(declaration, reason)`` that could not be applied here
    (ids shorter than the record's positions, another batch size): said in ``CheckResult.skipped``."""

    def __init__(self, declared: Declared, facts) -> None:
        rec = facts.rec
        self.rec, self.B, self.Tq, self.Tk, self.device = rec, facts.B, facts.Tq, facts.Tk, facts.device
        self.own: torch.Tensor | None = facts.diag  # (query,) each row's own key index; None: not self-attention
        self.key_start = facts.key_start
        self.qpos = facts.qpos  # (query,) positions of the rows
        self.causal = bool(facts.causal) if facts.causal is not None else None
        self.causal_source = facts.causal_source
        self.bounds: list[Bound] = []
        self.openings: list[Opening] = []
        self.problems: list[tuple[str, str]] = []
        self.notes: list[tuple[str, str]] = []  # (declaration, source) of the unasked ones applied
        self.user_shapes: tuple[str, ...] = ()  # the user's declarations that shape this record (applied ones)
        self.mask_fn: Callable | None = declared.of("mask_fn", rec)
        # (the scale, or the scales any of which the model may mean; source; declared by the user)
        self.scale: tuple[tuple[float, ...], str, bool] | None = None
        self._ahead: torch.Tensor | None = None
        self._pad = facts.key_pad if facts.key_pad_source else None
        if rec.kind == "self" and self.own is not None:
            self._read_shapes(declared)
        self._read_scale(declared)
        applied = [o.name for o in self.openings if o.user] + [b.name for b in self.bounds if b.user]
        self.user_shapes = tuple(applied) + (("mask_fn",) if self.mask_fn is not None else ())

    # ------------------------------------------------------------------------------------- reading declarations
    def _pick(self, declared: Declared, name: str) -> tuple[Any, str, bool] | None:
        """``(value, source, user)``: the user's declaration of ``name`` for this layer, else the model's own."""
        value = declared.of(name, self.rec)
        if value is not None:
            return value, f"declared {name}=", True
        got = expected(self.rec.meta, name)
        if got is None:
            return None
        self.notes.append((name, got[1]))
        return got[0], got[1], False

    def _read_shapes(self, declared: Declared) -> None:
        for name, read in (
            ("documents", self._documents),
            ("bidirectional", self._blocks),
            ("prefix_length", self._prefix),
            ("sliding_window", self._window),
            ("chunk_size", self._chunks),
        ):
            picked = self._pick(declared, name)
            if picked is not None:
                read(*picked)

    def _read_scale(self, declared: Declared) -> None:
        picked = self._pick(declared, "scale")
        if picked is not None:
            values = picked[0] if isinstance(picked[0], (list, tuple)) else [picked[0]]
            self.scale = (tuple(float(v) for v in values), picked[1], picked[2])

    def _rows_of(self, name: str, ids: torch.Tensor) -> torch.Tensor | None:
        """``ids`` ``(batch, seq)`` checked against this record (batch, positions); None after noting why not."""
        if ids.shape[0] != self.B:
            self.problems.append((name, f"{name} has batch {ids.shape[0]}, the record batch {self.B}"))
            return None
        need = self.key_start + self.Tk
        if ids.shape[1] < need or int(self.qpos.max()) >= ids.shape[1]:
            self.problems.append(
                (
                    name,
                    f"{name} covers {ids.shape[1]} positions but the record's keys reach position {need - 1} "
                    "(under generate, declare the ids of the whole sequence)",
                )
            )
            return None
        return ids.to(self.device)

    def _at_rows(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` ``(batch, seq)`` read at each row's position, as key indices: ``(batch, query)``."""
        return t[:, self.qpos] - self.key_start

    def _documents(self, value, source: str, user: bool) -> None:
        if isinstance(value, str):  # "position_ids": where the position ids the model received restart
            got = documents_from_positions(self.rec.meta)
            if got is None:
                self.problems.append(("documents", "the record has no position_ids to read documents from"))
                return
            value = got
        ids = self._rows_of("documents", value)
        if ids is not None:
            start, end = _runs(ids)
            self.bounds.append(Bound("documents", source, user, self._at_rows(start), self._at_rows(end)))

    def _blocks(self, value, source: str, user: bool) -> None:
        if isinstance(value, tuple):  # (start, end) spans
            value = spans_to_ids(value, self.B, max([self.key_start + self.Tk] + [e for _, e in value]))
        ids = self._rows_of("bidirectional", value)
        if ids is not None:
            _, end = _runs(ids)
            inside = ids[:, self.qpos] != 0  # (batch, query)
            self.openings.append(Opening("bidirectional", source, user, torch.where(inside, self._at_rows(end), -1)))

    def _prefix(self, value, source: str, user: bool) -> None:
        n = torch.as_tensor(value, device=self.device).reshape(-1, 1)  # (batch or 1, 1)
        if n.shape[0] not in (1, self.B):
            self.problems.append(("prefix_length", f"prefix_length has {n.shape[0]} rows, the record batch {self.B}"))
            return
        inside = self.qpos[None, :] < n  # (batch or 1, query)
        self.openings.append(Opening("prefix_length", source, user, torch.where(inside, n - 1 - self.key_start, -1)))

    def _window(self, value, source: str, user: bool) -> None:
        pos = self.qpos[None, :] - self.key_start  # (1, query) each row's own key index
        ahead = None if user else expected(self.rec.meta, "window_ahead")
        hi = pos + int(ahead[0]) - 1 if ahead is not None else torch.full_like(pos, _FAR)
        self.bounds.append(Bound("sliding_window", source, user, pos - int(value) + 1, hi))

    def _chunks(self, value, source: str, user: bool) -> None:
        C = int(value)
        pos = self.qpos[None, :]  # (1, query)
        origin = torch.zeros(1, 1, dtype=torch.long, device=self.device)  # (batch or 1, 1): each row's first token
        left = self.rec.meta.get("left_padding")  # a cache that dropped the padded keys: the stack's mask said
        if left is not None and len(left) == self.B:
            origin = torch.tensor(left, dtype=torch.long, device=self.device).view(-1, 1)  # (batch, 1)
        elif self._pad is not None:
            origin = (~self._pad).to(torch.uint8).argmax(-1, keepdim=True) + self.key_start  # (batch, 1)
        first = origin + torch.div(pos - origin, C, rounding_mode="floor") * C  # (batch or 1, query)
        self.bounds.append(Bound("chunk_size", source, user, first - self.key_start, first + C - 1 - self.key_start))

    def make_causal(self, source: str) -> None:
        """Hold the record to causality outside its openings (a declared prefix or blocks imply it)."""
        self.causal, self.causal_source, self._ahead = True, source, None

    # --------------------------------------------------------------------------------------------- the predicate
    @property
    def shaped(self) -> bool:
        """Whether anything beyond causality and padding is declared here."""
        return bool(self.bounds or self.openings or self.mask_fn is not None)

    def ahead(self) -> torch.Tensor:
        """``(batch or 1, query)`` long: the last key index causality and the openings let each row attend (every
        key when the record is not causal)."""
        if self._ahead is None:
            last = torch.full((1, self.Tq), self.Tk - 1, dtype=torch.long, device=self.device)
            if self.causal and self.own is not None:
                last = self.own[None, :].clone()
                for o in self.openings:
                    last = torch.maximum(last, o.hi)
            self._ahead = last
        return self._ahead

    def opened(self) -> bool:
        return bool(self.causal and self.openings)

    def interval(self, a: int, b: int, *, reach: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """``(lo, hi)`` ``(batch or 1, rows)``: the keys rows ``a:b`` may attend under causality, the openings and
        every bound (``mask_fn`` aside). ``reach``: also within the record's own sliding window, where no window is
        declared (what the model was told to mask is no over-masking)."""
        hi = self.ahead()[:, a:b]
        lo = torch.zeros_like(hi)
        for bound in self.bounds:
            lo = torch.maximum(lo, bound.lo[:, a:b])
            hi = torch.minimum(hi, bound.hi[:, a:b])
        window = self.rec.sliding_window
        if reach and window and self.own is not None and not any(x.name == "sliding_window" for x in self.bounds):
            lo = torch.maximum(lo, self.own[None, a:b] - int(window) + 1)
        return lo, hi

    def block(self, a: int, b: int, heads: tuple[int, ...]) -> torch.Tensor:
        """``(batch or 1, 1 or head, rows, key)`` bool: what the declarations allow rows ``a:b``."""
        lo, hi = self.interval(a, b)
        keys = torch.arange(self.Tk, device=self.device)
        allowed = (keys >= lo[..., None]) & (keys <= hi[..., None])  # (batch or 1, rows, key)
        allowed = allowed[:, None]  # (batch or 1, 1, rows, key)
        if self.mask_fn is not None:
            allowed = allowed & self.mask_fn_block(a, b, 0, self.Tk, heads)
        return allowed

    def mask_fn_block(self, a: int, b: int, c: int, d: int, heads: tuple[int, ...]) -> torch.Tensor:
        """``(batch or 1, 1 or head, rows, keys)`` bool: ``mask_fn`` over rows ``a:b`` and keys ``c:d``, called with
        broadcastable index tensors (batch ``(B, 1, 1, 1)``, head ``(1, H, 1, 1)``, query and key positions)."""
        fn, dev = self.mask_fn, self.device
        assert fn is not None
        b_idx = torch.arange(self.B, device=dev).view(-1, 1, 1, 1)
        h_idx = torch.tensor(heads, device=dev, dtype=torch.long).view(1, -1, 1, 1)
        q_idx = self.qpos[a:b].view(1, 1, -1, 1)
        kv_idx = (torch.arange(c, d, device=dev) + self.key_start).view(1, 1, 1, -1)
        try:
            out = fn(b_idx, h_idx, q_idx, kv_idx)
        except Exception as exc:
            raise DeclarationError(
                f"mask_fn raised {type(exc).__name__}: {exc} on layer {self.rec.layer}'s query positions "
                f"{int(q_idx.min())}..{int(q_idx.max())} (it is called with broadcastable index tensors, as "
                "FlexAttention's create_mask does)",
                declaration="mask_fn",
                expected="a callable mask_mod(b, h, q_idx, kv_idx) -> bool tensor",
                layer=self.rec.layer,
            ) from exc
        out = torch.as_tensor(out, device=dev)
        if out.dtype != torch.bool:
            raise DeclarationError(
                f"mask_fn returned a {out.dtype} tensor on layer {self.rec.layer}; it must return bool",
                declaration="mask_fn",
                expected="a callable mask_mod(b, h, q_idx, kv_idx) -> bool tensor",
                layer=self.rec.layer,
            )
        while out.dim() < 4:
            out = out.unsqueeze(0)
        B = self.B if out.shape[0] != 1 else 1
        H = len(heads) if out.shape[1] != 1 else 1
        return out.expand(B, H, b - a, d - c)

    def names(self, *, users_only: bool = False) -> str:
        """The declarations that shape this record, with their sources, e.g. ``"documents (declared documents=)"``."""
        parts = [(o.name, o.source, o.user) for o in self.openings] + [(b.name, b.source, b.user) for b in self.bounds]
        if self.mask_fn is not None:
            parts.append(("mask_fn", "declared mask_fn=", True))
        return ", ".join(f"{n} ({s})" for n, s, u in parts if u or not users_only)


def documents_from_positions(meta: Mapping[str, Any]) -> torch.Tensor | None:
    """``(batch, seq)`` document ids where the position ids the model received (``meta["inputs"]``) restart (as
    transformers' ``find_packed_sequence_indices`` reads them: a position that is not the previous one plus 1);
    None without 2-D position ids."""
    inputs = meta.get("inputs")
    pos = inputs.get("position_ids") if isinstance(inputs, Mapping) else None
    if not isinstance(pos, torch.Tensor) or pos.dim() != 2:
        return None
    pos = pos.to(torch.long)
    step = torch.diff(pos, prepend=pos[:, :1] - 1, dim=-1)  # (batch, seq)
    return (step != 1).cumsum(-1)
