"""The attention mass that key sets receive, per query row, without a ``(query x key)`` tensor larger than a block:
what KV-cache eviction policies keep, and what declared spans receive.

**Eviction** (``EvictionPlan``): a cache compressed at a *split* position ``P`` keeps ``K`` of the keys before ``P``
(the budget) and every key from ``P`` on; the *kept fraction* of an evaluated query row (at ``P`` or later) is its
attention mass on the kept keys divided by its total mass. The policies (the key sets at budget ``K``):

- ``streaming`` (StreamingLLM, Xiao et al. 2023): the first ``sinks`` keys and the ``K - sinks`` keys just before
  ``P``;
- ``h2o`` (H2O, Zhang et al. 2023): the ``int(recent * K)`` keys just before ``P``, and the ``K - int(recent * K)``
  older keys with the most attention accumulated over every (real) query row before ``P``;
- ``snapkv`` (SnapKV, Li et al. 2024): the ``window`` keys just before ``P`` (the observation window's own), and the
  ``K - window`` older keys with the most attention from the ``window`` query rows just before ``P``, smoothed by an
  average pool of ``kernel`` keys (as SnapKV's code and kvpress's ``SnapKVPress``);
- ``oracle``: for each evaluated row, its own ``K`` heaviest keys before ``P`` (no policy can keep more of that row).

"Keys" count from the first key any row before ``P`` may attend (left padding is not a key); ties in a ranking go to
the earlier key. Keys are ranked per query head (a cache shared by a group of query heads, as under grouped-query
attention, ranks once per group: the kept fractions here are those of per-head caches).

What is exact, and why one pass suffices: every key set depends only on rows before ``P``, which come first. The
pass walks the query rows in blocks, with exact weights (the call's logits, mask, softcapping and sinks, as the
statistics engine computes them): rows before ``P`` add to two per-key sums (all rows: ``h2o``; the last ``window``
rows: ``snapkv``); at ``P`` the key sets are fixed (``EvictionState``: one 0/1 vector over the keys before ``P`` per
policy, head and budget); each evaluated row then gets its kept mass, a product of its weights with those vectors
(the oracle: its sorted top ``K`` weights). Memory: the blocks, the two sums and the vectors, O(budgets x keys) per
head. Under ``generate`` the prompt (generation step 0) is the part before the split: its pass leaves an
``EvictionState`` that every later step's rows are evaluated against, so the profile covers the generated tokens.

H2O itself evicts greedily while decoding (an evicted key never returns, and the scores it accumulates are those of
the compressed cache); here the cache is compressed once, at ``P``, from the full attention, as kvpress evaluates
such presses. The kept mass is that of the full attention's weights, not of the weights a compressed cache would
renormalise.

**Spans** (``span_mass``): per row, the mass on each of a set of key spans (a label per key).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .attention_math import AttentionCall

#: The eviction policies, in the order the profile lists them.
POLICIES: tuple[str, ...] = ("streaming", "h2o", "snapkv", "oracle")

#: Memory target of one block of weights (a few temporaries of this size exist at once).
BLOCK_BYTES = 32 << 20


class EvictionPlanError(ValueError):
    """An eviction plan that cannot be evaluated; the message says what to change."""


@dataclass(frozen=True)
class EvictionPlan:
    """What an eviction profile evaluates (``capture(..., eviction=EvictionPlan(...))``).

    ``budgets``: numbers of keys kept before the split (ascending); ``policies``: from ``POLICIES``;
    ``sinks``: first keys the ``streaming`` policy always keeps; ``recent``: the share of an ``h2o`` budget kept for
    the most recent keys; ``window``, ``kernel``: ``snapkv``'s observation window (query rows) and pooling kernel
    (keys); ``observe``: rows evaluated in a forward that selects no rows (``rows=``) and is no generation step: the
    last ``observe`` rows.
    """

    budgets: tuple[int, ...] = (64, 256, 1024, 4096)
    policies: tuple[str, ...] = POLICIES
    sinks: int = 4
    recent: float = 0.5
    window: int = 32
    kernel: int = 5
    observe: int = 64

    def __post_init__(self) -> None:
        budgets = tuple(int(b) for b in ([self.budgets] if isinstance(self.budgets, int) else self.budgets))
        policies = tuple([self.policies] if isinstance(self.policies, str) else self.policies)
        if not budgets or any(b < 1 for b in budgets):
            raise EvictionPlanError(f"budgets must be positive numbers of keys, such as (64, 256, 1024): {budgets}")
        unknown = [p for p in policies if p not in POLICIES]
        if unknown or not policies:
            raise EvictionPlanError(f"policies must be some of {POLICIES}, not {list(policies)}")
        if self.sinks < 0 or self.window < 1 or self.kernel < 1 or self.kernel % 2 == 0 or self.observe < 1:
            raise EvictionPlanError(
                "sinks >= 0, window >= 1, observe >= 1 and an odd kernel >= 1 are needed, got "
                f"sinks={self.sinks}, window={self.window}, kernel={self.kernel}, observe={self.observe}"
            )
        if not 0.0 <= self.recent <= 1.0:
            raise EvictionPlanError(f"recent is a share of the budget, between 0 and 1: not {self.recent}")
        object.__setattr__(self, "budgets", tuple(sorted(dict.fromkeys(budgets))))
        object.__setattr__(self, "policies", tuple(p for p in POLICIES if p in policies))

    def describe(self) -> dict:
        """The plan as plain values (what a record's ``meta["eviction"]`` holds)."""
        return {
            "budgets": list(self.budgets),
            "policies": list(self.policies),
            "sinks": self.sinks,
            "recent": self.recent,
            "window": self.window,
            "kernel": self.kernel,
            "observe": self.observe,
        }


@dataclass
class EvictionState:
    """The key sets fixed at the split: ``keep[policy]`` ``(batch, head or 1, budget, split)`` bool over the keys
    before the split (``oracle`` has none: it ranks each row's own weights)."""

    split: int
    keep: dict[str, torch.Tensor] = field(default_factory=dict)


_LOG2E = 1.4426950408889634


class CallRows:
    """Exact weights of blocks of query rows of an ``AttentionCall`` (the call's own logits, mask, softcapping and
    sinks; an empty row is zero, or uniform under an additive mask, as the statistics engine has it). A block comes as
    ``e`` and a per-row ``scale`` (the weights are ``e * scale``), over the keys the rows can reach."""

    def __init__(self, call: AttentionCall) -> None:
        self.call = call
        self.shape = call.shape  # (batch, head, query, key)
        self.sinks = None if call.sinks is None else call.sinks.to(call.q.device, call.compute_dtype).view(1, -1, 1)
        self._buffer: torch.Tensor | None = None  # the logits of one block, reused block after block

    def take(self, rows: torch.Tensor) -> CallRows:
        return CallRows(self.call.take_rows(rows))

    def _scratch(self, shape: tuple[int, ...]) -> torch.Tensor:
        """A ``shape`` view of one buffer kept for every block: fresh memory for each block costs page faults (a
        32 MiB block's logits took 4x as long to fill in new memory as in reused memory)."""
        need = math.prod(shape)
        if self._buffer is None or self._buffer.numel() < need:
            self._buffer = torch.empty(need, dtype=self.call.compute_dtype, device=self.call.q.device)
        return self._buffer[:need].view(shape)

    def block(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """``(e, scale, allowed)`` of rows ``a:b``: ``e`` ``(batch, head, b - a, K)`` over keys ``0:K`` (every later key
        weighs 0: a causal call's rows cannot reach them), ``scale`` ``(batch, head, b - a)`` float64 (weights = ``e *
        scale``), ``allowed`` the mask ``(batch or 1, head or 1, b - a, K)`` (None: every key, or causality alone)."""
        call, Tk = self.call, self.shape[3]
        empty_uniform = call.additive and self.sinks is None
        K = Tk if (empty_uniform and call.mask is not None) else call.key_limit(b)
        B, h = self.shape[:2]
        s = call.logits(a, b, 0, K, times=_LOG2E, out=self._scratch((B, h, b - a, K)))  # (B, h, n, K): base 2, ours
        allowed = None
        if call.mask is not None:
            allowed = call.allowed(a, b, 0, K)  # never None with a mask
            if allowed is not None:
                s = s.masked_fill_(~allowed, -math.inf)
        elif call.causal:  # only the keys past the block's first row can be later than some row
            positions = call.row_positions(a, b)
            lo = min(max(int(positions[0]) + call.causal_offset + 1, 0), K)
            if lo < K:
                later = torch.arange(lo, K, device=s.device)[None, :] > (positions[:, None] + call.causal_offset)
                s[..., lo:].masked_fill_(later, -math.inf)
        m = s.amax(-1)  # (B, h, n); -inf: no key allowed
        shift = torch.where(torch.isfinite(m), m, 0.0)
        e = s.sub_(shift[..., None]).exp2_()  # in place: e = 2^(s - max)
        total = e.sum(-1).double()  # (a float64 sum would first copy the block to float64: 20x the time)
        if self.sinks is not None:
            total = total + torch.exp2(self.sinks * _LOG2E - shift).double()
        scale = torch.where(total > 0, 1.0 / total, 0.0)
        if empty_uniform:
            empty = torch.isneginf(m)
            if bool(empty.any()):  # an additive mask's empty row is uniform over every key
                e = torch.where(empty[..., None], 1.0, e)
                scale = torch.where(empty, 1.0 / Tk, scale)
        return e, scale, allowed


class TensorRows:
    """Blocks of query rows of full ``weights`` ``(batch, head, query, key)`` (and ``allowed``, which may
    broadcast), in the form of ``CallRows.block`` (``scale`` 1)."""

    def __init__(self, weights: torch.Tensor, allowed: torch.Tensor | None = None) -> None:
        self.weights, self.allowed = weights, allowed
        self.shape = tuple(weights.shape)

    def take(self, rows: torch.Tensor) -> TensorRows:
        allowed = self.allowed
        if allowed is not None and allowed.shape[2] > 1:
            allowed = allowed.index_select(2, rows.to(allowed.device))
        return TensorRows(self.weights.index_select(2, rows.to(self.weights.device)), allowed)

    def block(self, a: int, b: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        allowed = self.allowed
        if allowed is not None and allowed.shape[2] > 1:
            allowed = allowed[:, :, a:b]
        w = self.weights[:, :, a:b]
        scale = torch.ones(w.shape[:3], dtype=torch.float64)
        return w, scale, None if allowed is None else allowed.bool()


def _weights(source, a: int, b: int) -> torch.Tensor:
    """``(batch, head, b - a, key)`` float64 weights of rows ``a:b`` over every key (for few rows: evaluated ones)."""
    e, scale, _ = source.block(a, b)
    w = torch.zeros(*e.shape[:3], source.shape[3], dtype=torch.float64)
    w[..., : e.shape[-1]] = e.detach().cpu().double() * scale.cpu()[..., None]
    return w


def _blocks(shape, start: int, stop: int, block_bytes: int):
    B, h, _, Tk = shape
    step = max(1, block_bytes // max(1, B * h * Tk * 4))
    for a in range(start, stop, step):
        yield a, min(a + step, stop)


def eviction_state(
    source,
    plan: EvictionPlan,
    *,
    before: int,
    split: int,
    counted: torch.Tensor | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> EvictionState:
    """The key sets at ``split`` (a key index), from query rows ``0:before`` of ``source`` (``CallRows`` or
    ``TensorRows``), which sit at key positions ``split - before`` to ``split - 1``. ``counted`` ``(batch,
    query)``: 1 for the rows whose attention counts (0: padding)."""
    B, h, _, Tk = source.shape
    P = split
    if split > Tk:
        raise EvictionPlanError(f"the split at key {split} lies beyond the call's {Tk} keys")
    need_h2o, need_snap = "h2o" in plan.policies, "snapkv" in plan.policies
    first = 0 if need_h2o else max(0, before - plan.window)
    if not (need_h2o or need_snap or "streaming" in plan.policies):
        first = before  # the oracle needs no rows before the split
    accumulated = torch.zeros(B, h, P, dtype=torch.float64)  # attention each key before the split received
    window = torch.zeros(B, h, P, dtype=torch.float64)
    seen = torch.zeros(B, P, dtype=torch.bool)
    for a, b in _blocks(source.shape, first, before, block_bytes):
        e, scale, allowed = source.block(a, b)  # (B, h, n, K), (B, h, n)
        K = min(e.shape[-1], P)
        real = torch.ones(B, b - a, dtype=torch.bool) if counted is None else counted[:, a:b].bool().cpu()
        coef = (scale.cpu() * real[:, None, :]).to(e.dtype)  # (B, h, n): each row's weight scale, 0 for padding
        if need_h2o:
            accumulated[..., :K] += (coef[:, :, None, :] @ e[..., :K]).squeeze(2).double()  # (B, h, 1, n) x (n, K)
        lo = max(a, before - plan.window)
        if lo < b:
            window[..., :K] += (coef[:, :, None, lo - a :] @ e[:, :, lo - a :, :K]).squeeze(2).double()
        if allowed is None:
            seen |= real.any(1, keepdim=True).expand(B, P) if b > a else seen
        else:
            row_allowed = allowed[..., :K].any(1).cpu().expand(B, b - a, K)  # (B, n, K) any head
            seen[:, :K] |= (row_allowed & real[:, :, None]).any(1)
    start = torch.where(seen.any(1), seen.to(torch.uint8).argmax(1), 0)  # (B,): the first key a row may attend
    rows_in_window = min(plan.window, before)
    state = EvictionState(split=P)
    for policy in plan.policies:
        if policy == "streaming":
            state.keep[policy] = _streaming(plan, start, P, h=1)
        elif policy == "h2o":
            state.keep[policy] = _ranked(
                accumulated, start, P, plan.budgets, [int(plan.recent * k) for k in plan.budgets]
            )
        elif policy == "snapkv":
            scores = _pooled(window, start, P - rows_in_window, plan.kernel)
            state.keep[policy] = _ranked(scores, start, P, plan.budgets, [min(k, rows_in_window) for k in plan.budgets])
    return state


def _streaming(plan: EvictionPlan, start: torch.Tensor, P: int, h: int) -> torch.Tensor:
    """``(batch, 1, budget, P)``: the first ``sinks`` keys from ``start`` and the last ``K - sinks`` before ``P``."""
    B = start.shape[0]
    keys = torch.arange(P)
    out = torch.zeros(B, h, len(plan.budgets), P, dtype=torch.bool)
    for i, K in enumerate(plan.budgets):
        sinks = min(plan.sinks, K)
        recent = K - sinks
        for b in range(B):
            s = int(start[b])
            out[b, :, i] = ((keys >= s) & (keys < s + sinks)) | ((keys >= max(s, P - recent)) & (recent > 0))
    return out


def _ranked(
    scores: torch.Tensor, start: torch.Tensor, P: int, budgets: tuple[int, ...], recents: list[int]
) -> torch.Tensor:
    """``(batch, head, budget, P)``: for budget ``K`` with ``r`` recent keys, keys ``P - r .. P - 1`` and the
    ``K - r`` keys from ``start`` to ``P - r`` with the highest ``scores`` ``(batch, head, P)`` (ties: the earlier
    key)."""
    B, h, _ = scores.shape
    keys = torch.arange(P)
    out = torch.zeros(B, h, len(budgets), P, dtype=torch.bool)
    for b in range(B):
        s = int(start[b])
        for i, (K, r) in enumerate(zip(budgets, recents)):
            r = min(r, P - s)
            recent = keys >= P - r
            heavy = K - r
            out[b, :, i] = recent[None, :].expand(h, P)
            older = P - r - s  # candidate keys s .. P - r - 1
            if heavy <= 0 or older <= 0:
                continue
            order = torch.sort(scores[b, :, s : P - r], dim=-1, descending=True, stable=True).indices  # (h, older)
            chosen = order[:, : min(heavy, older)] + s
            out[b, :, i].scatter_(1, chosen, True)
    return out


def _pooled(window: torch.Tensor, start: torch.Tensor, stop: int, kernel: int) -> torch.Tensor:
    """``window`` ``(batch, head, P)`` with keys ``start .. stop - 1`` averaged over ``kernel`` neighbours (zero
    padded at both ends, as ``avg_pool1d``), the rest as they are."""
    out = window.clone()
    if kernel == 1:
        return out
    for b in range(window.shape[0]):
        s = int(start[b])
        if stop > s:
            part = window[b : b + 1, :, s:stop]  # (1, h, n)
            out[b : b + 1, :, s:stop] = F.avg_pool1d(part, kernel, stride=1, padding=kernel // 2)
    return out


def kept_fractions(
    source,
    plan: EvictionPlan,
    state: EvictionState,
    *,
    block_bytes: int = BLOCK_BYTES,
) -> dict[str, torch.Tensor]:
    """``{policy: (batch, head, row, budget)}`` float64: the kept fraction of every row of ``source`` (the evaluated
    rows, all at or after the split) under each policy and budget; NaN for a row with no mass."""
    B, h, n, _ = source.shape
    P = state.split
    out = {p: torch.empty(B, h, n, len(plan.budgets), dtype=torch.float64) for p in plan.policies}
    budgets = torch.tensor(plan.budgets)
    keeps = {p: k.to(torch.float64).transpose(-1, -2) for p, k in state.keep.items()}  # (B, h or 1, P, budget)
    # float64 rows and a sorted copy for the oracle: a quarter of the target per block keeps the peak near it
    for a, b in _blocks(source.shape, 0, n, block_bytes // 4):
        w = _weights(source, a, b)  # (B, h, rows, Tk) float64
        total = w.sum(-1, keepdim=True)  # (B, h, rows, 1)
        after = w[..., P:].sum(-1, keepdim=True)  # every key from the split on is kept
        before = w[..., :P]
        scale = torch.where(total > 0, 1.0 / total, math.nan)
        for policy in plan.policies:
            if policy == "oracle":
                top = before.topk(min(int(budgets.max()), P), dim=-1, sorted=True).values if P else before
                sums = torch.cat([torch.zeros_like(total), top.cumsum(-1)], dim=-1)  # (B, h, rows, 1 + kmax)
                kept = sums[..., budgets.clamp(max=top.shape[-1])]
            else:
                kept = before @ keeps[policy]  # (B, h, rows, P) x (B, h or 1, P, budget)
            out[policy][:, :, a:b] = (kept + after) * scale
    return out


def span_mass(source, span_ids: torch.Tensor, spans: int, *, block_bytes: int = BLOCK_BYTES) -> torch.Tensor:
    """``(batch, head, row, span)`` float64: each row's weight summed over the keys of each span; ``span_ids``
    ``(batch, key)`` long, the span of each key (-1: none)."""
    B, h, n, Tk = source.shape
    ids = span_ids.to("cpu", torch.long)
    onehot = torch.zeros(B, Tk, spans + 1, dtype=torch.float64)
    onehot.scatter_(2, torch.where(ids < 0, spans, ids)[..., None], 1.0)  # the last column: keys in no span
    onehot = onehot[..., :spans]  # (B, Tk, S)
    out = torch.empty(B, h, n, spans, dtype=torch.float64)
    for a, b in _blocks(source.shape, 0, n, block_bytes):
        e, scale, _ = source.block(a, b)  # (B, h, rows, K), (B, h, rows)
        K = e.shape[-1]
        sums = e.detach().cpu().double() @ onehot[:, None, :K]  # (B, h, rows, K) x (B, 1, K, S)
        out[:, :, a:b] = sums * scale.cpu()[..., None]
    return out


def evaluate_call(
    source,
    plan: EvictionPlan,
    *,
    step: int | None,
    query_offset: int,
    rows: torch.Tensor | None = None,
    state: EvictionState | None = None,
    counted: torch.Tensor | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> tuple[dict[str, torch.Tensor] | None, dict, EvictionState | None]:
    """One attention call's part of an eviction profile: ``(fractions, meta, state)``.

    - a forward outside generation (``step`` None): the split is the first of ``rows`` (the evaluated rows; None:
      the last ``plan.observe``), the rows before it are read from the same call;
    - a generation's prompt (``step`` 0): every row lies before the split (the prompt's end); no fractions, and the
      ``state`` every later step is evaluated against;
    - a later generation step: all its rows are evaluated against ``state`` (the prompt's).

    ``fractions``: ``{policy: (batch, head, row, budget)}`` (see ``kept_fractions``), None where the call cannot be
    evaluated (``meta["skipped"]`` says why); ``meta``: the plan, ``split`` and ``rows`` (indices among the
    call's queries)."""
    Tq, Tk = source.shape[2:]
    meta = plan.describe()
    if step is not None and step > 0:
        if state is None:
            return (
                None,
                {**meta, "skipped": "no prompt (generation step 0) of this layer was seen before this step"},
                None,
            )
        if Tk != query_offset + Tq or Tk < state.split:
            reason = f"the cache holds {Tk} keys for queries ending at {query_offset + Tq}: a cache that drops keys"
            return None, {**meta, "skipped": reason}, state
        return (
            kept_fractions(source, plan, state, block_bytes=block_bytes),
            {
                **meta,
                "split": state.split,
                "rows": list(range(Tq)),
            },
            state,
        )
    if query_offset != 0:
        reason = f"the queries start at position {query_offset}: the rows before them are not in this call"
        return None, {**meta, "skipped": reason}, None
    if step == 0:
        state = eviction_state(source, plan, before=Tq, split=Tq, counted=counted, block_bytes=block_bytes)
        return None, {**meta, "split": Tq, "rows": []}, state
    evaluated = torch.arange(max(0, Tq - plan.observe), Tq) if rows is None else rows.to(torch.long).cpu()
    if evaluated.numel() == 0:
        return None, {**meta, "skipped": "no query row is evaluated"}, None
    first = int(evaluated[0])
    state = eviction_state(source, plan, before=first, split=first, counted=counted, block_bytes=block_bytes)
    fractions = kept_fractions(source.take(evaluated), plan, state, block_bytes=block_bytes)
    return fractions, {**meta, "split": first, "rows": evaluated.tolist()}, None


def rows_weights(call: AttentionCall, a: int, b: int, *, block_bytes: int = BLOCK_BYTES) -> torch.Tensor:
    """``(batch, head, b - a, key)`` in the call's compute dtype: the exact weights of query rows ``a:b`` alone (what a
    capture with ``rows=`` keeps instead of recomputing every row), block by block."""
    source = CallRows(call.take_rows(torch.arange(a, b, device=call.q.device)))
    B, h, n, Tk = source.shape
    out = torch.zeros(B, h, n, Tk, dtype=call.compute_dtype, device=call.q.device)
    for c, d in _blocks(source.shape, 0, n, block_bytes):
        e, scale, _ = source.block(c, d)  # (B, h, rows, K), (B, h, rows)
        out[:, :, c:d, : e.shape[-1]] = e * scale[..., None].to(e.dtype)
    return out


def rows_scores(call: AttentionCall, a: int, b: int) -> torch.Tensor:
    """``(batch, head, b - a, key)``: the logits of query rows ``a:b`` before the mask (``AttentionCall.logits``)."""
    sub = call.take_rows(torch.arange(a, b, device=call.q.device))
    return sub.logits(0, b - a, 0, call.shape[3])
