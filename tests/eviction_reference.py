"""A brute-force reference for KV-cache eviction profiles, written from the definitions in
``probe/engine/kept_mass.py`` with none of its code: dense float64 weights, Python sets of kept keys, explicit loops."""

from __future__ import annotations

import torch


def dense_weights(q, k, *, scaling, allowed=None):
    """``(batch, head, query, key)`` float64 softmax of ``q @ k^T * scaling`` where ``allowed`` (bool, broadcast)."""
    s = torch.einsum("bhqd,bhkd->bhqk", q.double(), k.double()) * scaling
    if allowed is not None:
        s = s.masked_fill(~allowed, float("-inf"))
    w = torch.softmax(s, -1)
    return torch.nan_to_num(w, nan=0.0)


def _pool(scores: list[float], lo: int, hi: int, kernel: int) -> dict[int, float]:
    half = kernel // 2
    return {j: sum(scores[i] for i in range(j - half, j + half + 1) if lo <= i < hi) / kernel for j in range(lo, hi)}


def _top(scores: dict[int, float], count: int) -> set[int]:
    return set(sorted(scores, key=lambda j: (-scores[j], j))[: max(0, count)])


def key_sets(w, P: int, start: int, counted, plan) -> dict[str, list[set[int]]]:
    """For one (batch, head): ``w`` ``(query, key)`` float64 of rows ``0 .. P - 1`` (at positions ``0 .. P - 1``),
    ``counted`` ``(query,)`` 0/1; the kept keys before ``P`` per policy and budget."""
    c = torch.tensor(counted, dtype=torch.float64)[:, None]  # (P, 1)
    accumulated = (w[:P, :P] * c).sum(0).tolist()  # attention each key got from every counted row before P
    rows = min(plan.window, P)
    window = (w[P - rows : P, :P] * c[P - rows :]).sum(0).tolist()  # ... from the last `rows` rows
    pooled = _pool(window, start, P - rows, plan.kernel)
    out: dict[str, list[set[int]]] = {p: [] for p in ("streaming", "h2o", "snapkv")}
    for K in plan.budgets:
        sinks = min(plan.sinks, K)
        recent = K - sinks
        out["streaming"].append(set(range(start, min(start + sinks, P))) | set(range(max(start, P - recent), P)))
        r = min(int(plan.recent * K), P - start)
        older = {j: accumulated[j] for j in range(start, P - r)}
        out["h2o"].append(set(range(P - r, P)) | _top(older, K - r))
        r = min(K, rows, P - start)
        older = {j: pooled[j] for j in range(start, P - r)} if r == rows else {}
        out["snapkv"].append(set(range(P - r, P)) | _top(older, K - r))
    return out


def kept(w_row, P: int, keys: set[int]) -> float:
    """Kept fraction of one row ``(key,)`` float64: mass on ``keys`` and on every key from ``P`` on, over the total."""
    total = float(w_row.sum())
    mass = float(w_row[sorted(keys)].sum()) + float(w_row[P:].sum())
    return mass / total


def oracle(w_row, P: int, K: int) -> float:
    before = sorted(w_row[:P].tolist(), reverse=True)
    return (sum(before[:K]) + float(w_row[P:].sum())) / float(w_row.sum())


def profile(weights, P: int, rows, plan, *, start=None, counted=None, prefix=None):
    """``{policy: (batch, head, row, budget)}`` float64 for rows ``rows`` of ``weights`` ``(batch, head, query,
    key)``; the key sets come from rows ``0 .. P - 1`` of ``prefix`` (default: ``weights``)."""
    B, H = weights.shape[:2]
    prefix = weights if prefix is None else prefix
    out = {p: torch.zeros(B, H, len(rows), len(plan.budgets), dtype=torch.float64) for p in plan.policies}
    for b in range(B):
        s = 0 if start is None else int(start[b])
        c = [1.0] * P if counted is None else [float(x) for x in counted[b, :P]]
        for h in range(H):
            sets = key_sets(prefix[b, h], P, s, c, plan)
            for i, t in enumerate(rows):
                w_row = weights[b, h, t]
                for n, K in enumerate(plan.budgets):
                    for policy in plan.policies:
                        value = oracle(w_row, P, K) if policy == "oracle" else kept(w_row, P, sets[policy][n])
                        out[policy][b, h, i, n] = value
    return out
