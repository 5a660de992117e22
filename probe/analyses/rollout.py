"""Where attention goes across layers: attention rollout and attention flow (Abnar & Zuidema, 2020, "Quantifying
Attention Flow in Transformers", https://arxiv.org/abs/2005.00928).

Both read one stack of self-attention layers over the same tokens and model the residual connection as in the paper:
each layer's head-fused weights ``A`` ``(batch, query, key)`` become ``Â = (1 - r) A + r I`` with the residual
share ``r`` (0.5 in the paper), each row divided by its sum (a no-op when the rows of ``A`` sum to one; it keeps
rows of weights that sum to less, such as with attention sinks or an empty row, a distribution).

- **rollout**: ``R_1 = Â_1`` and ``R_l = Â_l R_{l-1}``: how much each token at layer ``l`` is made of each input
  token, if identities mix linearly along the weights. ``values[:, l]`` is the rollout through layer ``l``.
- **flow**: the layers as a flow network (node ``(l, t)`` for token ``t`` after layer ``l``, an edge from
  ``(l, t)`` to ``(l - 1, s)`` of capacity ``Â_l[t, s]``); the value from output token ``t`` to input token
  ``s`` is the maximum flow between them, each row divided by its sum (as the paper's code does). One maximum-flow
  problem per (query, key) pair: meant for short inputs (``MAX_FLOW_TOKENS``), computed for one layer's tokens.

Heads are fused by their mean (the paper); ``head_fusion="max"`` or ``"min"`` are the variants other
implementations offer. Everything is float64. Both need every layer's whole ``(query x key)`` weights: a statistics
capture has none and is refused with what to capture instead.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import AttnprobeError, warn_user
from ..record import AttentionRecord

#: Head fusions: the paper averages the heads; max and min are offered by other rollout implementations.
HEAD_FUSIONS = ("mean", "max", "min")
METHODS = ("rollout", "flow")
#: Attention flow solves one maximum-flow problem per (query, key) pair over a graph of layers x tokens nodes: beyond
#: this many tokens it takes minutes; pass ``max_tokens=`` to go further.
MAX_FLOW_TOKENS = 64


class AttributionError(AttnprobeError, ValueError):
    """A capture an attribution cannot be computed from; the message says what to capture instead."""


@dataclass(frozen=True, eq=False)
class Attribution:
    """Token-to-token attribution per layer (``attnprobe.rollout``).

    ``values`` ``(batch, layer, query, key)`` float64: row ``query`` says how much of that token (after layer
    ``layers[i]``) comes from each input token ``key``; ``layers`` the model's layer numbers along the layer axis.
    """

    method: str
    values: torch.Tensor
    layers: tuple[int, ...]
    options: dict[str, Any] = field(default_factory=dict)

    def to_frame(self, tokens=None):
        """One row per (layer, batch, query_pos, key_pos): ``value``; with ``tokens`` (a list of strings, or one
        list per batch row) also ``query_token`` and ``key_token``."""
        import pandas as pd

        B, L, Tq, Tk = self.values.shape
        index = torch.cartesian_prod(torch.arange(L), torch.arange(B), torch.arange(Tq), torch.arange(Tk))
        frame = pd.DataFrame(
            {
                "layer": torch.tensor(self.layers)[index[:, 0]].numpy(),
                "batch": index[:, 1].numpy(),
                "query_pos": index[:, 2].numpy(),
                "key_pos": index[:, 3].numpy(),
                "value": self.values.permute(1, 0, 2, 3).reshape(-1).numpy(),
            }
        )
        return add_tokens(frame, tokens, B)


def add_tokens(frame, tokens, batch: int):
    """``frame`` with ``query_token``/``key_token`` columns from ``tokens`` (one list, or one per batch row)."""
    if tokens is None:
        return frame
    rows = [list(tokens)] * batch if tokens and isinstance(tokens[0], str) else [list(t) for t in tokens]
    if len(rows) != batch:
        raise AttributionError(f"tokens= has {len(rows)} rows for a batch of {batch}: give one list per batch row")
    lookup = {(b, i): tok for b, row in enumerate(rows) for i, tok in enumerate(row)}
    for column in ("query", "key"):
        frame[f"{column}_token"] = [lookup.get(key, "") for key in zip(frame["batch"], frame[f"{column}_pos"])]
    return frame


def layer_records(cap, *, what: str, need: Sequence[str] = ("weights",)) -> list[AttentionRecord]:
    """The records of one stack of self-attention layers over the same tokens, one per layer in layer order
    (generation steps stitched first); ``AttributionError`` naming what to capture when that is not what ``cap``
    holds."""
    records = list(cap)
    if any(r.step is not None for r in records):
        from ..outputs.generation import shown

        records = shown(records)[0]  # every generation run stitched into one forward's records
    records = [r for r in records if r.kind == "self"]
    if not records:
        raise AttributionError(f"{what} reads self-attention layers: this capture holds none")
    for r in records:
        missing = [f for f in need if getattr(r, f) is None]
        if missing:
            stats = " (a statistics capture keeps no (query x key) tensor)" if r.stats is not None else ""
            raise AttributionError(
                f"{what} needs {', '.join(missing)} of every layer: layer {r.layer} has none{stats}; capture with "
                f"keep={tuple(need)!r}"
            )
    by_layer: dict[int, AttentionRecord] = {}
    for r in records:
        if r.layer in by_layer:
            raise AttributionError(
                f"{what}: layer {r.layer} was called more than once in this capture; pick one forward "
                f"(cap.select(calls=[0])) or capture one forward only"
            )
        by_layer[r.layer] = r
    ordered = [by_layer[layer] for layer in sorted(by_layer)]
    first = ordered[0]
    for r in ordered:
        if r.query_offset != 0 or r.query_len != r.key_len:
            raise AttributionError(
                f"{what} multiplies whole (token x token) matrices: layer {r.layer} has {r.query_len} query rows "
                f"from position {r.query_offset} against {r.key_len} keys (a row selection or a cache step); "
                "capture every row of one forward"
            )
        if r.key_len != first.key_len or r.batch_size != first.batch_size:
            raise AttributionError(
                f"{what} needs one stack of layers over the same tokens: layer {first.layer} has {first.key_len} "
                f"tokens, layer {r.layer} {r.key_len} (an encoder and a decoder?); select one stack with "
                "cap.select(layers=[...])"
            )
    partial = [r.layer for r in ordered if len(r.heads) != r.num_heads]
    if partial:
        warn_user(f"{what}: layers {partial} hold only some of their heads; their fusion is over the captured heads")
    return ordered


def required(record: AttentionRecord, name: str) -> torch.Tensor:
    """``record``'s tensor ``name``, which the caller checked is there (``layer_records``)."""
    t = getattr(record, name)
    if t is None:
        raise AttributionError(f"layer {record.layer} has no {name}: capture with keep=({name!r},)")
    return t


def fuse_heads(weights: torch.Tensor, head_fusion: str) -> torch.Tensor:
    """``(batch, head, query, key) -> (batch, query, key)`` float64: the heads' mean, max or min."""
    w = weights.detach().to("cpu", torch.float64)
    if head_fusion == "mean":
        return w.mean(1)
    if head_fusion == "max":
        return w.amax(1)
    return w.amin(1)


def with_residual(attention: torch.Tensor, residual: float) -> torch.Tensor:
    """``(batch, T, T)``: ``(1 - residual) * attention + residual * I``, each row divided by its sum (rows that sum to
    0 stay 0)."""
    eye = torch.eye(attention.shape[-1], dtype=attention.dtype)
    mixed = (1.0 - residual) * attention + residual * eye  # (batch, T, T)
    total = mixed.sum(-1, keepdim=True)
    return torch.where(total > 0, mixed / total.clamp_min(torch.finfo(mixed.dtype).tiny), 0.0)


def _check_options(method: str, residual: float, head_fusion: str) -> None:
    if method not in METHODS:
        raise AttributionError(f"method must be one of {METHODS}, not {method!r}")
    if head_fusion not in HEAD_FUSIONS:
        raise AttributionError(f"head_fusion must be one of {HEAD_FUSIONS}, not {head_fusion!r}")
    if not 0.0 <= float(residual) <= 1.0:
        raise AttributionError(f"residual is the identity's share of each layer, between 0 and 1: not {residual!r}")


def rollout(
    cap,
    *,
    method: str = "rollout",
    residual: float = 0.5,
    head_fusion: str = "mean",
    layer: int | None = None,
    max_tokens: int = MAX_FLOW_TOKENS,
) -> Attribution:
    """Attention rollout (or ``method="flow"``: attention flow) over the self-attention layers of ``cap`` (a capture
    with weights, one forward, or a stitched generation).

    ``residual``: the identity's share of each layer (0.5 in the paper); ``head_fusion``: ``"mean"`` (the paper),
    ``"max"`` or ``"min"``. Rollout gives every layer's cumulative matrix; flow gives ``layer``'s tokens (default
    the last layer) and refuses more than ``max_tokens`` tokens.

    Example::

        >>> import torch, attnprobe
        >>> model = torch.nn.Sequential(*[attnprobe.MultiHeadAttention(8, num_heads=2) for _ in range(2)])
        >>> with attnprobe.capture(model, keep=("weights",)) as cap:
        ...     _ = model(torch.randn(1, 5, 8))
        >>> r = attnprobe.rollout(cap)
        >>> tuple(r.values.shape), r.layers, bool(torch.allclose(r.values.sum(-1), torch.ones(1, 2, 5).double()))
        ((1, 2, 5, 5), (0, 1), True)
    """
    _check_options(method, residual, head_fusion)
    records = layer_records(cap, what=f"attention {method}")
    mixed = [
        with_residual(fuse_heads(required(r, "weights"), head_fusion), residual) for r in records
    ]  # each (B, T, T)
    options = {"residual": float(residual), "head_fusion": head_fusion}
    if method == "rollout":
        cumulative = [mixed[0]]
        for a in mixed[1:]:
            cumulative.append(a @ cumulative[-1])  # (B, T, T) x (B, T, T): through one more layer
        return Attribution("rollout", torch.stack(cumulative, 1), tuple(r.layer for r in records), options)
    layers = [r.layer for r in records]
    top = layers[-1] if layer is None else layer
    if top not in layers:
        raise AttributionError(f"layer {top} is not among the captured self-attention layers {layers}")
    tokens = mixed[0].shape[-1]
    if tokens > max_tokens:
        raise AttributionError(
            f"attention flow solves {tokens**2} maximum-flow problems for {tokens} tokens: more than "
            f"max_tokens={max_tokens} "
            "takes minutes or hours; use method='rollout', fewer tokens, or raise max_tokens="
        )
    depth = layers.index(top) + 1
    values = torch.stack([flow_matrix([m[b] for m in mixed[:depth]]) for b in range(mixed[0].shape[0])])
    return Attribution("flow", values[:, None], (top,), options)


def flow_matrix(layers: Sequence[torch.Tensor]) -> torch.Tensor:
    """``(T, T)`` float64: the maximum flow from each token after the last of ``layers`` (each ``(T, T)``, residual
    already mixed in, bottom layer first) to each input token, rows divided by their sums."""
    import networkx as nx

    T, L = layers[0].shape[-1], len(layers)
    graph = nx.DiGraph()
    for depth, a in enumerate(layers, start=1):
        rows, cols = torch.nonzero(a > 0, as_tuple=True)
        graph.add_edges_from(
            ((depth, int(t)), (depth - 1, int(s)), {"capacity": float(a[t, s])})
            for t, s in zip(rows.tolist(), cols.tolist())
        )
    from networkx.algorithms.flow import build_residual_network, dinitz

    # one residual network for every pair (each solve resets its flows): Dinitz on it is ~12x networkx's default
    residual = build_residual_network(graph, "capacity")
    out = torch.zeros(T, T, dtype=torch.float64)
    for t in range(T):
        for s in range(T):
            source, sink = (L, t), (0, s)
            if source in graph and sink in graph:
                out[t, s] = nx.maximum_flow_value(graph, source, sink, flow_func=dinitz, residual=residual)
    total = out.sum(-1, keepdim=True)
    return torch.where(total > 0, out / total.clamp_min(torch.finfo(out.dtype).tiny), 0.0)
