"""A record as checks see it: facts about the whole record (``RecordFacts``) and blocks of its query rows
(``RowBlock``). A full record is checked as a few row blocks; every check runs once per block."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from ..engine.stats import KEY_STATS, ROW_STATS
from ..record import AttentionRecord
from .declarations import declared_for, mask_tensor
from .predicate import RecordDeclaration, expected
from .tolerances import tolerance

#: Where a record's key padding came from (``RecordFacts.key_pad_source``).
DECLARED_PADDING = "the declared attention_mask"
QUERY_PADDING = "the record's query_padding"
MASK_PADDING = "keys the record's mask lets no query attend"


def shared_heads(t: torch.Tensor) -> torch.Tensor:
    """``(batch, head, ...)`` -> ``(batch, 1, ...)`` when every head holds the same values (a mask shared by the
    heads is reported once, not once per head, as from a ``(batch, 1, query, key)`` mask)."""
    if t.shape[1] > 1 and torch.equal(t, t[:, :1].expand_as(t)):
        return t[:, :1]
    return t


def all_finite(t: torch.Tensor) -> bool:
    """Fast path: a finite float32 sum means every entry is finite (an overflowing sum falls back)."""
    return bool(torch.isfinite(t.sum(dtype=torch.float64 if t.dtype == torch.float64 else torch.float32)))


# --------------------------------------------------------------------------- record shapes
#: The axes of each record field (see ``attnprobe.probe.record``); "heads" = the stored query heads,
#: "heads|1" = one entry shared by the heads or one per head.
_AXES: dict[str, tuple[str, ...]] = {
    "q": ("batch", "heads", "query", "d_qk"),
    "k": ("batch", "kv_heads", "key", "d_qk"),
    "v": ("batch", "kv_heads", "key", "d_v"),
    "scores": ("batch", "heads", "query", "key"),
    "weights": ("batch", "heads", "query", "key"),
    "output": ("batch", "heads", "query", "d_v"),
    "allowed": ("batch", "heads|1", "query", "key"),
    "query_padding": ("batch", "query"),
    "sinks": ("heads",),
}


def record_shapes(rec: AttentionRecord, index: int) -> None:
    """Raise a ValueError naming the record when its tensors disagree on a size (instead of a broadcasting
    error deep inside a check)."""
    where = f"record {index} ({rec.name!r}, layer {rec.layer}, call {rec.call})"
    sizes: dict[str, dict[int, list[str]]] = {
        "heads": {len(rec.heads): ["heads"]},
        "kv_heads": {len(rec.kv_heads): ["kv_heads"]},
    }
    problems = []
    for name, axes in _AXES.items():
        t = getattr(rec, name)
        if t is None:
            continue
        if not isinstance(t, torch.Tensor):
            problems.append(f"{name} is a {type(t).__name__}, not a tensor")
            continue
        if t.dim() != len(axes):
            problems.append(f"{name} has shape {tuple(t.shape)}, expected ({', '.join(axes)})")
            continue
        for axis, size in zip(axes, t.shape):
            if axis == "heads|1":
                if size == 1:
                    continue
                axis = "heads"
            sizes.setdefault(axis, {}).setdefault(int(size), []).append(name)
    for axis, seen in sizes.items():
        if len(seen) > 1:
            said = "; ".join(f"{size} in {', '.join(names)}" for size, names in seen.items())
            problems.append(f"the {axis.replace('|1', '')} sizes disagree ({said})")
    if problems:
        shapes = ", ".join(
            f"{f}={tuple(getattr(rec, f).shape)}" for f in _AXES if isinstance(getattr(rec, f), torch.Tensor)
        )
        raise ValueError(
            f"{where} has inconsistent tensors: {'; '.join(problems)} [{shapes}]. Every field follows the "
            "notation of attnprobe.AttentionRecord (q (batch, head, query, d_head), weights (batch, head, query, "
            "key), ...); a record edited with dataclasses.replace must change every field together "
            "(Capture.select slices them consistently)"
        )


def allowed_extent(
    allowed: torch.Tensor | None, stats: Mapping[str, torch.Tensor] | None, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each row's count of allowed keys and its first and last allowed key (-1 each where it has none), from the
    mask ``(..., Tk)``, else from a statistics record's ``allowed_keys``, ``first_allowed`` and ``last_allowed``."""
    if allowed is None:
        assert stats is not None, "neither a mask nor statistics"
        return stats["allowed_keys"].to(device), stats["first_allowed"].to(device), stats["last_allowed"].to(device)
    a = allowed.to(torch.uint8)  # (..., Tk)
    count = a.sum(-1)  # (...)
    some = count > 0
    first = torch.where(some, a.argmax(-1), -1)
    last = torch.where(some, a.shape[-1] - 1 - a.flip(-1).argmax(-1), -1)
    return count, first, last


class RecordFacts:
    """What holds for a whole record: sizes, tolerance, declarations, key padding, query positions.

    Nothing quadratic is computed here; ``RowBlock(facts, a, b)`` holds the tensors of query rows ``a:b``.
    """

    def __init__(self, run, rec: AttentionRecord, index: int) -> None:
        self.rec, self.index = rec, index
        B, Tq, Tk = rec.batch_size, rec.query_len, rec.key_len
        if B is None or Tq is None or Tk is None:  # check() skips such records before it gets here
            raise ValueError(f"record {index} ({rec.name!r}, layer {rec.layer}) has no tensors to check")
        self.B, self.Tq, self.Tk = B, Tq, Tk
        stored = [getattr(rec, f) for f in ("weights", "scores", "output", "v")]
        wide = any(t is not None and t.dtype == torch.float64 for t in stored)
        self.cdtype = torch.float64 if wide else torch.float32
        # a statistics-only record: every check reads per-row statistics instead of (query, key) tensors
        self.stats = rec.stats if rec.weights is None and rec.stats is not None else None
        first_stat = None if self.stats is None else self.stats["entropy"]
        self.device = next((t.device for t in stored + [rec.allowed, first_stat] if t is not None), torch.device("cpu"))
        self.tol = tolerance(rec.dtype, *(t.dtype for t in stored if t is not None), atol=run.atol, rtol=run.rtol)
        self.allowed = None if rec.allowed is None else rec.allowed.to(self.device, torch.bool)
        self.qpos = torch.arange(self.Tq, device=self.device) + rec.query_offset  # reported query positions
        self.kpos = torch.arange(self.Tk, device=self.device)  # reported key positions
        self.diag: torch.Tensor | None = None  # (Tq,) key index (cache slot) of each query (self-attention only)
        self.offset: int | None = None
        self.key_start = 0  # position of the first key: > 0 when a sliding-window cache dropped older keys
        if rec.kind == "self":
            # the queries sit at query_offset in the keys; a cache that dropped old keys (sliding window)
            # keeps the most recent ones, so the queries are then the last keys
            offset = rec.query_offset if rec.query_offset + self.Tq <= self.Tk else self.Tk - self.Tq
            if offset >= 0:
                self.offset = offset
                self.diag = torch.arange(self.Tq, device=self.device) + offset
                self.key_start = rec.key_start
                self.kpos = self.kpos + self.key_start

        self.causal = declared_for(run.causal, rec)
        self.causal_declared = self.causal is not None
        self.causal_source = f"declared causal={self.causal}"
        intent = rec.meta.get("declared_causal")  # what the module's own code declares (probe/intent.py)
        unasked = expected(rec.meta, "causal") if rec.kind == "self" else None  # what the model's config says
        if self.causal is None and unasked is not None:
            self.causal, self.causal_declared = bool(unasked[0]), True
            self.causal_source = f"causal={self.causal} from {unasked[1]}"
            run.declarations.setdefault(f"causal={self.causal} ({unasked[1]})", {})[rec.layer] = rec.name or "<root>"
        elif self.causal is None and intent and rec.kind == "self":
            self.causal, self.causal_declared = True, True
            self.causal_source = f"causal as declared by {intent}"
            run.declarations.setdefault(f"causal (declared by {intent})", {})[rec.layer] = rec.name or "<root>"
        elif self.causal is None:
            self.causal = rec.causal
            self.causal_source = rec.meta.get("causal_source") or "the module says it is causal"

        self.key_pad, self.key_pad_source, declared_query_pad = self._padding(run)
        query_pad = rec.query_padding.to(self.device, torch.bool) if rec.query_padding is not None else None
        if declared_query_pad is not None:
            query_pad = declared_query_pad if query_pad is None else query_pad | declared_query_pad
        self.query_pad = query_pad  # (B, Tq) or None
        self.own, self.own_excused, self.own_selected = self._own_position()
        self.decl = RecordDeclaration(run.declared, self)  # documents, blocks, windows, chunks, mask_fn, scale
        opens = [o.name for o in self.decl.openings if o.user]
        if opens and declared_for(run.causal, rec) is None:
            # a prefix or blocks declared: the rest is causal (prefix-LM, Gemma 3's images), whatever the module says
            self.causal, self.causal_declared = True, True
            self.causal_source = f"causal outside what {opens[0]}= opens"
            self.decl.make_causal(self.causal_source)
        for name, source in self.decl.notes:
            run.declarations.setdefault(f"{name} ({source})", {})[rec.layer] = rec.name or "<root>"
        for name, reason in self.decl.problems:
            for check in ("declared", "reach"):
                run.skip(check, f"{name} could not be applied: {reason}", self)

    def _own_position(self):
        """(may each query attend its own position, is that position a padded key, do the row's allowed keys select
        among its range (``_selected``)): ``(B, 1 or H, Tq)`` each, or None without a mask. Linear in the sequence:
        one entry per query row."""
        if self.diag is None or (self.allowed is None and self.stats is None):
            return None, None, None
        own_key = self.diag.clamp(max=self.Tk - 1)
        if self.allowed is None:
            own = shared_heads(self.stats["diagonal_allowed"].to(self.device))  # (B, 1 or H, Tq)
            attends_any = shared_heads(self.stats["allowed_keys"].to(self.device) > 0)
        else:
            own = self.allowed[..., torch.arange(self.Tq, device=self.device), own_key]  # (B, 1 or H, Tq)
            attends_any = self.allowed.any(-1)
        # a mask shifted by one drops every row's own key and keeps the rest of its causal range; a mask that selects
        # keys (Doge's dynamic mask, DeepSeek's sparse attention: each row's top keys) drops some rows' own keys only,
        # or leaves a row a hole or a late start inside its range: no shift by one there
        real = torch.ones_like(own) if self.query_pad is None else ~self.query_pad[:, None, :]
        some_own = (own & real & attends_any).any(-1, keepdim=True)  # (B, 1 or H, 1)
        selected = self._selected(own_key) | some_own  # (B, 1 or H, Tq)
        if self.key_pad is None:
            return own, torch.zeros_like(own), selected
        excused = self.key_pad[:, own_key][:, None, :].expand_as(own)  # a padded token: its row is padding too
        if self.key_pad_source == MASK_PADDING:
            # padding read off the mask (keys no query attends) is also what a mask shifted by one gives
            # the last key; trust it only where no other row of that (batch, head) misses its own key
            shifted = (~own & ~excused & real & attends_any).any(-1, keepdim=True)
            excused = excused & ~shifted
        return own, excused, selected

    def _selected(self, own_key: torch.Tensor) -> torch.Tensor:
        """``(B, 1 or H, Tq)``: rows whose allowed keys select among the keys of their causal range: a key between
        their first and last allowed key that they may not attend, or a first allowed key after a key of the range
        (from the first key, or the record's sliding window's first), padding aside. From each row's count, first
        and last allowed key (the mask's, or the statistics')."""
        count, first, last = allowed_extent(self.allowed, self.stats, self.device)  # (B, 1 or H, Tq) each
        real = torch.ones(self.B, self.Tk, device=self.device) if self.key_pad is None else (~self.key_pad).float()
        before = torch.cat([real.new_zeros(self.B, 1), real.cumsum(-1)], -1)[:, None, :]  # (B, 1, Tk + 1)
        before = before.expand(self.B, count.shape[1], self.Tk + 1)  # real keys before each key

        def real_keys(lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:  # real keys in [lo, hi), (B, 1 or H, Tq)
            lo, hi = lo.clamp(0, self.Tk).long().expand_as(first), hi.clamp(0, self.Tk).long().expand_as(first)
            return before.gather(-1, hi) - before.gather(-1, lo)

        window = self.rec.sliding_window
        start = (own_key - window + 1) if window else torch.zeros_like(own_key)  # (Tq,): where the range begins
        hole = real_keys(first, last + 1) > count  # (B, 1 or H, Tq)
        late = real_keys(start, first) > 0
        return shared_heads((count > 0) & (hole | late))

    def _padding(self, run):
        """(key padding (B, Tk) or None, where it comes from, declared query padding or None)."""
        rec = self.rec
        declared = declared_for(run.attention_mask, rec)
        if declared is not None:
            mask = mask_tensor(declared, "attention_mask").to(self.device)
            B, L = mask.shape
            if B != self.B:
                run.skip("padding", f"the declared attention_mask has batch {B}, the record batch {self.B}", self)
            elif (
                rec.kind == "self"
                and rec.meta.get("stack") == "decoder"
                and not isinstance(run.attention_mask, Mapping)
            ):
                # one mask for every layer of an encoder-decoder is the encoder input's; these keys are decoder tokens
                run.skip(
                    "padding",
                    "one attention_mask declared for every layer is the encoder input's, but the "
                    "keys of a decoder self-attention are decoder tokens; declare attention_mask={layer: mask} "
                    "with the decoder's mask for these layers",
                    self,
                )
            elif rec.kind == "cross":
                if self.Tk == L:
                    run.mask_fitted = True
                    return ~mask, DECLARED_PADDING, None
                run.skip(
                    "padding",
                    f"the declared attention_mask has {L} positions but this cross-attention "
                    f"has {self.Tk} keys; pass attention_mask={{layer: mask}} per layer",
                    self,
                )
            elif self.offset is not None and self.key_start + self.Tk <= L:
                # positions of the whole sequence: a KV-cache step reads the positions of its keys (a
                # sliding-window cache keeps only the most recent ones); later positions are not used
                run.mask_fitted = True
                real = mask[:, self.key_start : self.key_start + self.Tk]
                return ~real, DECLARED_PADDING, ~real[:, self.offset : self.offset + self.Tq]
            elif self.offset is not None and self.Tk == L:
                run.mask_fitted = True  # one entry per cache slot
                return ~mask, DECLARED_PADDING, ~mask[:, self.offset : self.offset + self.Tq]
            elif self.offset is not None and not rec.query_offset and rec.step is None:
                run.skip(
                    "padding", f"the declared attention_mask has {L} positions but the record has {self.Tk} keys", self
                )
            elif self.offset is not None:
                run.skip(
                    "padding",
                    f"the declared attention_mask has {L} positions, fewer than the keys of "
                    "these records reach (KV-cache steps?); under generate, declare the mask of the whole "
                    "sequence: the prompt's mask followed by ones for the generated tokens",
                    self,
                )
            else:
                run.skip(
                    "padding",
                    f"the declared attention_mask has {L} positions but the record has "
                    f"{self.Tq} queries and {self.Tk} keys, which no cache layout explains",
                    self,
                )
            return None, "", None
        if rec.kind == "self" and self.offset == 0 and self.Tq == self.Tk and rec.query_padding is not None:
            return rec.query_padding.to(self.device, torch.bool), QUERY_PADDING, None
        if rec.kind == "cross" or (self.offset == 0 and self.Tq == self.Tk):
            if self.allowed is not None:
                return ~self.allowed.any(1).any(1), MASK_PADDING, None
            if self.stats is not None:
                return ~self.stats["key_allowed"].to(self.device).any(1), MASK_PADDING, None
        return None, "", None

    def chunks(self, elements: int):
        """Row ranges ``(a, b)`` such that no (batch, head, rows, key) temporary passes ``elements``."""
        if self.stats is not None:  # per-row statistics: the whole record is one block, O(T)
            yield 0, self.Tq
            return
        per_row = self.B * max(len(self.rec.heads), 1) * self.Tk
        step = max(1, elements // max(per_row, 1))
        for a in range(0, self.Tq, step):
            yield a, min(a + step, self.Tq)


class RowBlock:
    """Query rows ``a:b`` of one record, in compute precision, with the rows every value check looks at."""

    def __init__(self, facts: RecordFacts, a: int, b: int) -> None:
        rec = facts.rec
        self.rec, self.index = rec, facts.index
        self.B, self.Tq, self.Tk = facts.B, b - a, facts.Tk
        self.device, self.cdtype, self.tol = facts.device, facts.cdtype, facts.tol
        self.causal, self.causal_declared, self.causal_source = facts.causal, facts.causal_declared, facts.causal_source
        self.key_pad, self.key_pad_source = facts.key_pad, facts.key_pad_source
        self.start, self.all_qpos = a, facts.qpos
        self.qpos = facts.qpos[a:b]
        self.diag = None if facts.diag is None else facts.diag[a:b]
        self.kpos = facts.kpos
        self.own = None if facts.own is None else facts.own[:, :, a:b]
        self.decl: RecordDeclaration = facts.decl
        self.own_excused = None if facts.own_excused is None else facts.own_excused[:, :, a:b]
        self.own_selected = None if facts.own_selected is None else facts.own_selected[:, :, a:b]

        def rows(t):
            return None if t is None else t[:, :, a:b]

        self.w = None if rec.weights is None else rows(rec.weights).to(self.device, self.cdtype)
        #: per-row statistics of these rows (``ROW_STATS`` (B, H, rows), ``KEY_STATS`` whole) for a
        #: statistics-only record, else None
        self.st = (
            None
            if facts.stats is None
            else {
                n: (s if n in KEY_STATS else s[:, :, a:b]).to(self.device)
                for n, s in facts.stats.items()
                if n in KEY_STATS or n in ROW_STATS
            }
        )
        self.scores, self.output = rows(rec.scores), rows(rec.output)
        self.allowed = rows(facts.allowed)
        self.query_pad = None if facts.query_pad is None else facts.query_pad[:, a:b]

        # rows with no allowed key: under the record's own mask, or under what was declared
        self.empty_known = False
        empty = torch.zeros(self.B, 1, self.Tq, dtype=torch.bool, device=self.device)
        if self.allowed is not None:
            empty = empty | ~self.allowed.any(-1)
            self.empty_known = True
        if self.st is not None:
            empty = empty | shared_heads(self.st["allowed_keys"] == 0)
            self.empty_known = True
            self.declared = None  # never (rows, key): the declared-empty rows are counted per row below
            declared_empty = self._declared_empty_rows()
            if declared_empty is not None:
                empty = empty | declared_empty
        else:
            self.declared = self._declared_allowed()
            if self.declared is not None:
                empty = empty | ~self.declared.any(-1)
                self.empty_known = True
        self.empty = empty  # (B, 1 or H, Tq)
        self.real = torch.ones_like(empty) if self.query_pad is None else ~self.query_pad[:, None, :]
        self.checked = self.real & ~empty  # (B, 1 or H, Tq): the rows every value check looks at
        self._finite_rows: torch.Tensor | None = None

    def own_keys(self) -> torch.Tensor:
        """``(Tq,)`` the key index of each query's own key; a ValueError when the record does not place its queries
        among its keys (cross-attention, more queries than keys: ``diag`` is None)."""
        if self.diag is None:
            raise ValueError(f"record {self.index} ({self.rec.name!r}) does not place its queries among its keys")
        return self.diag

    def future(self) -> torch.Tensor:
        """(Tq, Tk) bool: key index after the query's own key index; ``(batch or 1, 1, Tq, Tk)`` after the last key a
        declared opening lets the row see (its bidirectional block, the prefix) where the record has openings."""
        keys = torch.arange(self.Tk, device=self.device)
        if self.decl.opened():
            return (keys > self.ahead()[..., None])[:, None]
        return keys[None, :] > self.own_keys()[:, None]

    def ahead(self) -> torch.Tensor:
        """``(batch or 1, Tq)``: the last key index causality and the declared openings let each row attend."""
        self.own_keys()
        return self.decl.ahead()[:, self.start : self.start + self.Tq]

    def outside_window(self) -> torch.Tensor | None:
        """(Tq, Tk) bool: keys older than a causal sliding window (the window includes the query); None without one,
        or where a declared window (``declared`` reports it, naming where it comes from) replaces the record's."""
        window = self.rec.sliding_window
        if not window or any(b.name == "sliding_window" for b in self.decl.bounds):
            return None
        keys = torch.arange(self.Tk, device=self.device)
        return keys[None, :] <= self.own_keys()[:, None] - window

    def _declared_allowed(self) -> torch.Tensor | None:
        """(B, 1, Tq, Tk) what the declarations allow, or None when nothing was declared."""
        allowed = None
        if self.causal_declared and self.causal and self.diag is not None:
            allowed = ~self.future()
            window = self.outside_window()
            if window is not None:
                allowed = allowed & ~window
            allowed = allowed.expand(self.B, 1, self.Tq, self.Tk)
        if self.key_pad is not None and self.key_pad_source == DECLARED_PADDING:
            keys = ~self.key_pad[:, None, None, :]
            allowed = keys.expand(self.B, 1, self.Tq, self.Tk) if allowed is None else allowed & keys
        return allowed

    def _declared_empty_rows(self) -> torch.Tensor | None:
        """(B, 1, rows) rows the declarations leave no key to attend, counted per row (O(T), no (rows, key))."""
        diag = self.diag if self.causal_declared and self.causal else None  # (rows,) each row's own key
        pad = self.key_pad if self.key_pad_source == DECLARED_PADDING else None  # (B, Tk)
        if diag is None and pad is None:
            return None
        real = torch.ones(self.B, self.Tk, device=self.device) if pad is None else (~pad).float()  # (B, Tk)
        if diag is None:
            return (real.sum(-1) == 0)[:, None, None].expand(self.B, 1, self.Tq)
        cum = torch.cat([torch.zeros(self.B, 1, device=self.device), real.cumsum(-1)], dim=-1)  # (B, Tk + 1)
        hi = (diag + 1).clamp(0, self.Tk)
        window = self.rec.sliding_window
        lo = (diag - window + 1).clamp(0, self.Tk) if window else torch.zeros_like(hi)
        count = cum[:, hi] - cum[:, lo]  # real keys in the window [lo, diag]
        self.empty_known = True
        return (count == 0)[:, None, :]

    def finite_rows(self) -> torch.Tensor:
        """Checked rows whose weights are all finite (non-finite ones are ``finite``'s business)."""
        if self._finite_rows is None and self.st is not None:
            self._finite_rows = self.checked & self.st["finite"]
        if self._finite_rows is None:
            w = self.w
            if w is None:
                raise ValueError(f"record {self.index} ({self.rec.name!r}) has neither weights nor statistics")
            self._finite_rows = self.checked if all_finite(w) else self.checked & torch.isfinite(w).all(-1)
        return self._finite_rows
