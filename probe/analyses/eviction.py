"""KV-cache eviction profiles: per layer and head, the share of each query's attention a cache policy keeps at a
budget of K keys (``attnprobe.eviction_profile``).

The policies, the split, and what is exact are described in ``probe/engine/kept_mass.py``; in short: the cache is
compressed at a split position to ``K`` of the keys before it (``streaming``: sinks + window, ``h2o``: recent +
accumulated-attention heavy hitters, ``snapkv``: the observation window's own keys + the keys it attends most,
``oracle``: each row's own heaviest keys), every later key is kept, and each evaluated row's kept fraction is its
mass on the kept keys over its total.

Two sources:

- **a statistics capture** with ``capture(..., keep=("stats",), eviction=EvictionPlan(...))``: the kept fractions
  are computed during the forward, blockwise (memory grows as the keys, not their square), for the plan's budgets
  and policies; under ``generate`` the prompt fixes the key sets and every generated token is evaluated;
- **a full capture** that kept ``weights`` of every row: computed here for any budgets, from those weights (the
  evaluated rows: the generated tokens of a generation, else the last ``observe`` rows).
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from ..engine.kept_mass import POLICIES, EvictionPlan, EvictionState, TensorRows, evaluate_call
from ..errors import AttnprobeError

#: Columns of ``eviction_profile``'s frame, in order.
PROFILE_COLUMNS = ("layer", "name", "head", "policy", "budget", "kept", "kept_min", "rows")


class EvictionError(AttnprobeError, ValueError):
    """An eviction profile that cannot be computed from this capture; the message says what to capture."""


def _plan_for(policies, budgets, plan: EvictionPlan | None) -> EvictionPlan:
    """``plan`` (default ``EvictionPlan()``) with the ``policies`` and ``budgets`` given (None: the plan's)."""
    from dataclasses import replace

    plan = plan or EvictionPlan()
    return replace(
        plan,
        policies=plan.policies if policies is None else tuple([policies] if isinstance(policies, str) else policies),
        budgets=plan.budgets if budgets is None else tuple([budgets] if isinstance(budgets, int) else budgets),
    )


def _counted(record) -> torch.Tensor | None:
    """``(batch, query)`` float: 1 for the rows that are not padding."""
    return None if record.query_padding is None else (~record.query_padding.bool()).double()


def _parts_from_weights(cap, plan: EvictionPlan) -> list[tuple]:
    """(record, fractions, rows) for every evaluated record of a capture that kept full weights."""
    parts: list[tuple] = []
    states: dict[str, EvictionState | None] = {}
    for r in cap:
        if r.kind != "self":
            continue
        if r.weights is None:
            raise EvictionError(
                f"layer {r.layer} kept no weights: an eviction profile reads the full weights of every row, or the "
                "kept fractions of a statistics capture (capture(..., keep=('stats',), eviction=EvictionPlan()))"
            )
        source = TensorRows(r.weights, r.allowed)
        if r.step == 0:
            states[r.name] = None
        fractions, meta, state = evaluate_call(
            source, plan, step=r.step, query_offset=r.query_offset, state=states.get(r.name), counted=_counted(r)
        )
        if r.step is not None:
            states[r.name] = state
        if fractions is None:
            if r.step == 0:
                continue
            raise EvictionError(f"layer {r.layer} (call {r.call}): {meta['skipped']}")
        parts.append((r, fractions, torch.tensor(meta["rows"], dtype=torch.long), plan.budgets))
    return parts


def _parts_from_stats(cap, plan: EvictionPlan) -> list[tuple]:
    parts = []
    for r in cap:
        meta = r.meta.get("eviction")
        if meta is None or "skipped" in meta or not meta.get("rows"):
            continue
        have = set(meta["policies"]), set(meta["budgets"])
        missing = [p for p in plan.policies if p not in have[0]] + [b for b in plan.budgets if b not in have[1]]
        if missing:
            raise EvictionError(
                f"the capture evaluated policies {meta['policies']} at budgets {meta['budgets']}, not {missing}: "
                "capture with eviction=EvictionPlan(policies=..., budgets=...) naming them"
            )
        columns = [meta["budgets"].index(b) for b in plan.budgets]
        fractions = {p: r.stats[f"kept_{p}"][..., columns].double() for p in plan.policies}
        parts.append((r, fractions, torch.tensor(meta["rows"], dtype=torch.long), plan.budgets))
    return parts


def _captured_plan(cap) -> EvictionPlan | None:
    for r in cap:
        meta = r.meta.get("eviction")
        if meta is not None:
            return EvictionPlan(
                budgets=tuple(meta["budgets"]),
                policies=tuple(meta["policies"]),
                sinks=meta["sinks"],
                recent=meta["recent"],
                window=meta["window"],
                kernel=meta["kernel"],
                observe=meta["observe"],
            )
    return None


def eviction_parts(cap, policies=None, budgets=None, *, plan: EvictionPlan | None = None) -> list[tuple]:
    """``(record, {policy: (batch, head, row, budget)}, rows, budgets)`` for every evaluated record of ``cap``: from its
    statistics when it was captured with ``eviction=``, else from its weights."""
    captured = _captured_plan(cap)
    if captured is not None:
        if plan is not None:
            raise EvictionError("this capture was evaluated during the forward with its own plan: leave plan= out")
        chosen = _plan_for(policies or captured.policies, budgets or captured.budgets, captured)
        parts = _parts_from_stats(cap, chosen)
        if not parts:
            reasons = sorted({str(r.meta["eviction"].get("skipped")) for r in cap if "eviction" in r.meta})
            raise EvictionError(f"no record of this capture has an evaluated row: {'; '.join(reasons)}")
        return parts
    if any(r.weights is None and r.stats is not None for r in cap):
        raise EvictionError(
            "this statistics capture holds no kept fractions: capture with keep=('stats',) and "
            "eviction=attnprobe.EvictionPlan(budgets=[...]) (or keep the weights)"
        )
    return _parts_from_weights(cap, _plan_for(policies, budgets, plan))


def eviction_profile(cap, policies=None, budgets=None, *, plan: EvictionPlan | None = None, per_row: bool = False):
    """A DataFrame: per (layer, head, policy, budget) the mean kept fraction of the evaluated rows (``kept``), the
    smallest (``kept_min``) and how many real rows (``rows``; padding left out). ``policies`` (of ``POLICIES``) and
    ``budgets`` (numbers of keys) default to the captured plan (a statistics capture) or ``plan`` (full weights).
    ``per_row=True``: one row per (layer, call, step, head, batch, query_pos, policy, budget) with ``kept``.

    Example::

        >>> import torch, attnprobe
        >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
        >>> with attnprobe.capture(attn, keep=("weights",)) as cap:
        ...     _ = attn(torch.randn(1, 40, 8))
        >>> profile = attnprobe.eviction_profile(cap, budgets=[4, 16], plan=attnprobe.EvictionPlan(observe=8))
        >>> sorted(profile["policy"].unique()), sorted(profile["budget"].unique().tolist())
        (['h2o', 'oracle', 'snapkv', 'streaming'], [4, 16])
    """
    import pandas as pd

    parts = eviction_parts(cap, policies, budgets, plan=plan)
    long = pd.concat([_part_frame(*part) for part in parts], ignore_index=True)
    if per_row:
        return long
    real = long[long["kept"].notna()]
    grouped = real.groupby(["layer", "name", "head", "policy", "budget"], observed=True)["kept"]
    frame = grouped.agg(kept="mean", kept_min="min", rows="count").reset_index()
    frame["policy"] = pd.Categorical(frame["policy"], categories=[p for p in POLICIES if p in set(frame["policy"])])
    frame = frame.sort_values(["layer", "head", "policy", "budget"]).reset_index(drop=True)
    frame["policy"] = frame["policy"].astype(str)
    return frame[list(PROFILE_COLUMNS)]


def _part_frame(record, fractions: dict, rows: torch.Tensor, budgets: tuple[int, ...]):
    import pandas as pd

    frames = []
    for policy, values in fractions.items():
        B, H, n, nb = values.shape
        values = values.clone()
        if record.query_padding is not None:
            padded = record.query_padding.bool().cpu()[:, rows]  # (B, n)
            values[padded[:, None, :, None].expand_as(values)] = float("nan")
        index = torch.cartesian_prod(torch.arange(H), torch.arange(B), torch.arange(n), torch.arange(nb))
        frames.append(
            pd.DataFrame(
                {
                    "layer": record.layer,
                    "name": record.name,
                    "call": record.call,
                    "step": -1 if record.step is None else record.step,
                    "head": torch.tensor(record.heads)[index[:, 0]].numpy(),
                    "batch": index[:, 1].numpy(),
                    "query_pos": (rows[index[:, 2]] + record.query_offset).numpy(),
                    "policy": policy,
                    "budget": torch.tensor(budgets)[index[:, 3]].numpy(),
                    "kept": values.permute(1, 0, 2, 3).reshape(-1).numpy(),
                }
            )
        )
    return pd.concat(frames, ignore_index=True)


def policies_of(values: Iterable[str]) -> tuple[str, ...]:
    """``values`` in ``POLICIES`` order (what a plot's legend lists)."""
    chosen = set(values)
    return tuple(p for p in POLICIES if p in chosen)
