"""Hand a capture to the notebook viewers people already use: bertviz and circuitsvis.

Neither is imported here: these functions build exactly the arguments those libraries document, so
``bertviz.head_view(**cap.to_bertviz())`` and ``circuitsvis.attention.attention_patterns(**cap.to_circuitsvis(0))``
draw attnprobe's captures (recorded under sdpa or any other backend) with their tools.

Records captured under ``generate`` are stitched first (one full matrix per run, as reports show them).
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import AttnprobeError
from ..record import AttentionRecord
from .generation import shown
from .tokens import record_token_rows


def _records(capture, call: int) -> list[AttentionRecord]:
    records = [r for r in shown(list(capture))[0] if r.call == call]
    if not records:
        calls = sorted({r.call for r in capture})
        raise AttnprobeError(f"no record with call={call} in this capture (calls captured: {calls})")
    return records


def _weights(record: AttentionRecord, batch: int) -> torch.Tensor:
    """``(1, head, query, key)`` float32 weights of batch row ``batch``."""
    where = f"layer {record.layer} ({record.name!r}, call {record.call})"
    if record.weights is None:
        raise AttnprobeError(f"{where} has no weights: capture with keep=None or keep=['weights', ...]")
    size = record.weights.shape[0]
    if isinstance(batch, bool) or not isinstance(batch, int) or not -size <= batch < size:
        raise AttnprobeError(f"batch={batch!r} is out of range: {where} has {size} batch row(s), 0 to {size - 1}")
    batch %= size
    return record.weights[batch : batch + 1].float()


def _tokens(record: AttentionRecord, tokens, key_tokens, batch: int) -> tuple[list[str], list[str]]:
    """(query labels, key labels) of batch row ``batch``: the tokens given, else position numbers."""
    q_rows, k_rows = record_token_rows(record, tokens, key_tokens)
    tq, tk = record.query_len or 0, record.key_len or 0
    start, key_start = record.query_offset, record.key_start
    q = q_rows[batch][start : start + tq] if q_rows is not None else [str(start + i) for i in range(tq)]
    k = k_rows[batch][key_start : key_start + tk] if k_rows is not None else [str(key_start + i) for i in range(tk)]
    return q, k


def _same_heads(records: list[AttentionRecord], what: str) -> None:
    shapes = {(len(r.heads), r.query_len, r.key_len) for r in records}
    if len(shapes) > 1:
        detail = ", ".join(f"layer {r.layer}: {len(r.heads)} heads, {r.query_len}x{r.key_len}" for r in records[:4])
        raise AttnprobeError(
            f"bertviz draws every layer of {what} with the same heads and length ({detail}); capture the same heads "
            "in every layer or pass cap.select(layers=[...]) of layers that match"
        )


def to_bertviz(capture, batch: int = 0, *, tokens=None, key_tokens=None, call: int = 0) -> dict[str, Any]:
    """The keyword arguments of ``bertviz.head_view`` / ``bertviz.model_view`` for batch row ``batch``.

    For self-attention models: ``{"attention": (one (1, head, query, key) tensor per captured layer), "tokens":
    [...]}``.
    For encoder-decoder models (records whose ``meta["stack"]`` names the encoder or decoder): ``encoder_attention``,
    ``decoder_attention``, ``cross_attention``, ``encoder_tokens`` and ``decoder_tokens``. The tuples hold the
    captured layers in order (``cap.layers``), each layer's stored heads in order; ``tokens`` label the query
    sequence and ``key_tokens`` the encoder's (as in ``to_frame``), position numbers when not given. ``call``
    picks the call of each layer (records of ``generate`` are stitched first). Weights are float32 copies.

    Example::

        >>> import torch, attnprobe
        >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
        >>> out, cap = attnprobe.run(attn, torch.randn(1, 3, 8))
        >>> view = cap.to_bertviz(tokens=["a", "b", "c"])   # bertviz.head_view(**view)
        >>> view["attention"][0].shape, view["tokens"]
        (torch.Size([1, 2, 3, 3]), ['a', 'b', 'c'])
    """
    records = _records(capture, call)
    stacks = {r.meta.get("stack") for r in records}
    if stacks <= {None}:
        selfs = [r for r in records if r.kind == "self"]
        if not selfs:
            raise AttnprobeError(
                "bertviz draws self-attention (or an encoder-decoder): this capture has only cross-attention records"
            )
        _same_heads(selfs, "a model")
        q, k = _tokens(selfs[0], tokens, key_tokens, batch)
        if q != k:
            raise AttnprobeError(
                f"bertviz's head view labels queries and keys with one token list, but layer {selfs[0].layer} has "
                f"{len(q)} queries and {len(k)} keys; pass call= of a full forward (not a cached step)"
            )
        return {"attention": tuple(_weights(r, batch) for r in selfs), "tokens": q}
    groups = {
        "encoder_attention": [r for r in records if r.meta.get("stack") == "encoder" and r.kind == "self"],
        "decoder_attention": [r for r in records if r.meta.get("stack") == "decoder" and r.kind == "self"],
        "cross_attention": [r for r in records if r.meta.get("stack") == "decoder" and r.kind == "cross"],
    }
    missing = [name for name, rs in groups.items() if not rs]
    if missing:
        raise AttnprobeError(
            f"bertviz's encoder-decoder view needs {', '.join(missing)}: capture every layer "
            "of the encoder and the decoder (layers=None)"
        )
    for name, rs in groups.items():
        _same_heads(rs, name.replace("_", " "))
    encoder_tokens, _ = _tokens(groups["encoder_attention"][0], tokens, key_tokens, batch)
    decoder_tokens, _ = _tokens(groups["decoder_attention"][0], tokens, key_tokens, batch)
    out: dict[str, Any] = {name: tuple(_weights(r, batch) for r in rs) for name, rs in groups.items()}
    return {**out, "encoder_tokens": encoder_tokens, "decoder_tokens": decoder_tokens}


def to_circuitsvis(
    capture, layer: int, batch: int = 0, *, tokens=None, call: int = 0, head_names: bool = False
) -> dict[str, Any]:
    """The keyword arguments of ``circuitsvis.attention.attention_patterns`` for one self-attention layer.

    ``{"tokens": [...], "attention": (head, query, key) float32 tensor}`` (the record's stored heads in order);
    with ``head_names=True`` also ``"attention_head_names": ["L0H0", ...]`` carrying the model's head numbers, for
    ``circuitsvis.attention.attention_heads`` (the newer view, which takes them). ``tokens`` label the sequence
    (position numbers when not given); ``call`` picks the layer's call (``generate`` steps are stitched).

    Example::

        >>> import torch, attnprobe
        >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
        >>> out, cap = attnprobe.run(attn, torch.randn(1, 3, 8), heads=[1])
        >>> view = cap.to_circuitsvis(0)   # circuitsvis.attention.attention_patterns(**view)
        >>> view["attention"].shape, view["tokens"]
        (torch.Size([1, 3, 3]), ['0', '1', '2'])
        >>> cap.to_circuitsvis(0, head_names=True)["attention_head_names"]   # for attention_heads(**view)
        ['L0H1']
    """
    records = [r for r in _records(capture, call) if r.layer == layer]
    if not records:
        raise AttnprobeError(f"no record of layer {layer} (call {call}); captured layers: {list(capture.layers)}")
    record = records[0]
    if record.kind != "self":
        raise AttnprobeError(
            f"layer {layer} is cross-attention: circuitsvis's attention_patterns labels queries and "
            "keys with one token list (self-attention only)"
        )
    q, k = _tokens(record, tokens, None, batch)
    if q != k:
        raise AttnprobeError(
            f"layer {layer} has {len(q)} queries and {len(k)} keys (a cached generation step?): "
            "circuitsvis's attention_patterns needs one token per query and key"
        )
    view: dict[str, Any] = {"tokens": q, "attention": _weights(record, batch)[0]}
    if head_names:
        view["attention_head_names"] = [f"L{layer}H{h}" for h in record.heads]
    return view
