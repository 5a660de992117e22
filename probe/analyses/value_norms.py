"""Value-weighted attention: how far each key actually moves each query (Kobayashi et al., 2020, "Attention is
Not Only a Weight: Analyzing Transformers with Vector Norms", https://arxiv.org/abs/2004.10102).

A head's output for query ``i`` is ``sum_j a_ij f(x_j)`` with ``f(x_j) = v_j W_O^h`` (the value, bias included, through
the head's slice of the output projection). A large weight on a key whose ``f(x_j)`` is near zero moves nothing; the
norm ``||a_ij f(x_j)||`` says how much key ``j`` contributes. Per record, in float64:

- ``norm`` ``(batch, head, query, key)``: ``a_ij ||v_j||``, without the output projection (always available);
- ``projected`` ``(batch, head, query, key)``: ``a_ij ||v_j W_O^h||`` with it;
- ``summed`` ``(batch, query, key)``: ``||sum_h a^h_ij v^h_j W_O^h||``, the whole layer's contribution (the paper's
  layer-level measure; the output projection's bias, the same for every key, is left out).

The output projection is read from the model (``value_norms(cap, model=model)``): the attention module's ``o_proj``,
``out_proj``, ``dense``, ``o``, ``wo``, ``out_lin`` or ``c_proj`` (GPT-2's transposed ``Conv1D``), or, as in BERT, the
sibling ``output.dense`` of its parent. Where none of them fits (or no model is given), ``projected`` and ``summed``
are None and ``ValueNorms.projection`` says why for that layer.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..record import AttentionRecord
from .rollout import AttributionError, add_tokens, required

#: Attribute names of output projections on an attention module, in the order they are tried.
PROJECTION_NAMES = ("o_proj", "out_proj", "dense", "o", "wo", "out_lin", "c_proj")

#: Bytes of one block of the layer-level sum's ``(batch, rows, key, d_model)`` float64 temporary.
_BLOCK_BYTES = 64 << 20


@dataclass(frozen=True, eq=False)
class RecordNorms:
    """The value-weighted norms of one record (see the module docstring for each tensor's meaning)."""

    layer: int
    call: int
    step: int | None
    heads: tuple[int, ...]
    query_offset: int
    weights: torch.Tensor  # (batch, head, query, key) float64
    norm: torch.Tensor  # (batch, head, query, key) float64: a_ij ||v_j||
    projected: torch.Tensor | None  # (batch, head, query, key) float64: a_ij ||v_j W_O^h||
    summed: torch.Tensor | None  # (batch, query, key) float64: ||sum_h a^h_ij v^h_j W_O^h||


@dataclass(frozen=True, eq=False)
class ValueNorms:
    """``attnprobe.value_norms``: one ``RecordNorms`` per record, and where each layer's output projection came from
    (``projection``: layer -> the module path, or the reason there is none)."""

    records: tuple[RecordNorms, ...]
    projection: dict[int, str]

    def to_frame(self, level: str = "head", tokens=None):
        """``level="head"``: one row per (layer, call, head, batch, query_pos, key_pos) with ``weight``, ``norm``
        and ``projected_norm`` (NaN without a projection). ``level="layer"``: one row per (layer, call, batch,
        query_pos, key_pos) with ``weight`` (the heads' mean), ``norm`` (``sqrt(sum_h norm^2)``: the heads' values
        side by side, before the projection) and ``projected_norm`` (``summed``). ``tokens`` as in
        ``Attribution.to_frame``."""
        import pandas as pd

        if level not in ("head", "layer"):
            raise AttributionError(f"level must be 'head' or 'layer', not {level!r}")
        frames = [_record_frame(r, level) for r in self.records]
        frame = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame()
        batch = self.records[0].weights.shape[0] if self.records else 0
        return add_tokens(frame, tokens, batch)


def _record_frame(r: RecordNorms, level: str):
    import pandas as pd

    nan = torch.full_like(r.weights, float("nan"))
    B, H, Tq, Tk = r.weights.shape
    if level == "head":
        columns = {"weight": r.weights, "norm": r.norm, "projected_norm": nan if r.projected is None else r.projected}
        columns = {name: t.transpose(0, 1) for name, t in columns.items()}  # (head, batch, query, key)
        heads = torch.tensor(r.heads)
    else:
        summed = nan[:, 0] if r.summed is None else r.summed
        columns = {"weight": r.weights.mean(1), "norm": r.norm.square().sum(1).sqrt(), "projected_norm": summed}
        columns = {name: t[None] for name, t in columns.items()}  # (1, batch, query, key)
        heads = None
    index = torch.cartesian_prod(
        torch.arange(1 if heads is None else H), torch.arange(B), torch.arange(Tq), torch.arange(Tk)
    )
    data: dict[str, Any] = {"layer": r.layer, "call": r.call}
    if heads is not None:
        data["head"] = heads[index[:, 0]].numpy()
    data.update(
        {
            "batch": index[:, 1].numpy(),
            "query_pos": (index[:, 2] + r.query_offset).numpy(),
            "key_pos": index[:, 3].numpy(),
        }
    )
    for name, t in columns.items():
        data[name] = t.reshape(-1).numpy()
    return pd.DataFrame(data)


def output_projection(model: nn.Module, record: AttentionRecord, d_value: int) -> tuple[torch.Tensor | None, str]:
    """``(W, where)``: the output projection of ``record``'s module as a ``(d_model, num_heads * d_value)`` float64
    matrix and its module path; ``(None, why)`` when none is found or its shape does not fit."""
    try:
        module = model.get_submodule(record.name)
    except AttributeError:
        return None, f"the model has no module {record.name!r}"
    width = record.num_heads * d_value
    candidates = [(f"{record.name}.{n}" if record.name else n, getattr(module, n, None)) for n in PROJECTION_NAMES]
    if "." in record.name or record.name:
        parent_name = record.name.rsplit(".", 1)[0] if "." in record.name else ""
        parent = model.get_submodule(parent_name)
        output = getattr(parent, "output", None)
        sibling = f"{parent_name}.output.dense" if parent_name else "output.dense"
        candidates.append((sibling, getattr(output, "dense", None) if isinstance(output, nn.Module) else None))
    for where, sub in candidates:
        weight = getattr(sub, "weight", None)
        if not isinstance(sub, nn.Module) or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        matrix = weight.detach().to("cpu", torch.float64)
        if type(sub).__name__ == "Conv1D":  # GPT-2: weight is (in, out), y = x @ W
            matrix = matrix.T
        if matrix.shape[1] == width:
            return matrix, where
    return None, (
        f"no output projection of {width} inputs on {record.name!r} "
        f"(looked for {', '.join(PROJECTION_NAMES)} and the parent's output.dense)"
    )


def record_norms(record: AttentionRecord, projection: torch.Tensor | None) -> RecordNorms:
    """The norms of one record (``weights`` and ``v`` kept); ``projection`` ``(d_model, num_heads * d_value)`` or
    None."""
    w = required(record, "weights").detach().to("cpu", torch.float64)  # (B, H, Tq, Tk)
    v = required(record, "v").detach().to("cpu", torch.float64)  # (B, kv_head, Tk, d)
    group = record.num_heads // max(record.num_kv_heads, 1)
    try:
        kv = [record.kv_heads.index(h // group) for h in record.heads]
    except ValueError:
        raise AttributionError(
            f"layer {record.layer}: the values of some captured heads' kv heads were not kept"
        ) from None
    v = v[:, kv]  # (B, H, Tk, d): each head's values
    norm = w * v.norm(dim=-1)[:, :, None, :]  # (B, H, Tq, Tk): a_ij ||v_j||
    projected = summed = None
    if projection is not None:
        d = v.shape[-1]
        blocks = torch.stack([projection[:, h * d : (h + 1) * d] for h in record.heads])  # (H, d_model, d)
        f = torch.einsum("bhkd,hmd->bhkm", v, blocks)  # (B, H, Tk, d_model): v_j W_O^h
        projected = w * f.norm(dim=-1)[:, :, None, :]  # (B, H, Tq, Tk)
        summed = _summed_norm(w, f)
    return RecordNorms(
        record.layer, record.call, record.step, record.heads, record.query_offset, w, norm, projected, summed
    )


def _summed_norm(w: torch.Tensor, f: torch.Tensor) -> torch.Tensor:
    """``(batch, query, key)``: ``||sum_h w[:, h, i, j] f[:, h, j]||``, over blocks of query rows."""
    B, _, Tq, Tk = w.shape
    rows = max(1, _BLOCK_BYTES // max(1, B * Tk * f.shape[-1] * 8))
    out = torch.empty(B, Tq, Tk, dtype=torch.float64)
    for a in range(0, Tq, rows):
        b = min(a + rows, Tq)
        vectors = torch.einsum("bhqk,bhkm->bqkm", w[:, :, a:b], f)  # (B, rows, Tk, d_model)
        out[:, a:b] = vectors.norm(dim=-1)
    return out


def value_norms(cap, *, model: nn.Module | None = None) -> ValueNorms:
    """Value-weighted attention norms of every record of ``cap`` that kept ``weights`` and ``v`` (Kobayashi et al.,
    2020); with ``model=``, through each layer's output projection too.

    Example::

        >>> import torch, attnprobe
        >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2)
        >>> with attnprobe.capture(attn, keep=("weights", "v")) as cap:
        ...     _ = attn(torch.randn(1, 4, 8))
        >>> norms = attnprobe.value_norms(cap, model=attn)
        >>> norms.projection, tuple(norms.records[0].summed.shape)
        ({0: 'out_proj'}, (1, 4, 4))
    """
    records = list(cap)
    if not records:
        raise AttributionError("value_norms: the capture holds no record")
    out: list[RecordNorms] = []
    projection: dict[int, str] = {}
    for r in records:
        missing = [f for f in ("weights", "v") if getattr(r, f) is None]
        if missing:
            stats = " (a statistics capture keeps no (query x key) tensor)" if r.stats is not None else ""
            raise AttributionError(
                f"value_norms needs the weights and values of every record: layer {r.layer} has no "
                f"{', '.join(missing)}{stats}; capture with keep=('weights', 'v')"
            )
        matrix, where = (None, "no model given: value_norms(cap, model=model) reads the output projection")
        if model is not None:
            matrix, where = output_projection(model, r, int(required(r, "v").shape[-1]))
        projection.setdefault(r.layer, where)
        out.append(record_norms(r, matrix))
    return ValueNorms(tuple(out), projection)
