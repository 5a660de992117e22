"""Attention between spans of tokens: how much of each sentence's, chat turn's or document's attention goes to each
other one (``attnprobe.spans``).

Declare the spans (``SpanSet``), one of four ways:

- ``ranges({"question": (0, 12), "doc 1": (12, 300)})``: token ranges ``[start, stop)``;
- ``sentences(texts, tokenizer)``: sentences of each text (split after ``.``, ``!`` or ``?`` followed by white space),
  mapped to tokens through the tokenizer's character offsets (special tokens belong to no sentence);
- ``chat_turns(tokenizer, messages)``: the turns of a conversation as the tokenizer's chat template lays them out
  (each turn's tokens, template markup included, found by rendering the conversation up to that turn);
- ``labels(per_token)``: one label per token (None: no span); the tokens of a label form its span, contiguous or not.

Then ``attention(cap, spans)``: one row per (layer, head, batch, query span, key span) with

- ``mass``: the mean, over the query span's real rows, of the weight each row puts on the key span's keys (over a
  partition of the keys, a row's masses sum to its total weight: 1 without attention sinks);
- ``mean``: the mean weight of one (query, key) pair, ``mass / len(key span)``;
- ``rows``: how many real query rows the means are over.

From a capture that kept the weights, or from a statistics capture declared with ``capture(..., spans=spans)`` (the
per-row masses computed during the forward, blockwise: memory grows as tokens x spans).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from ..engine.kept_mass import TensorRows, span_mass
from ..errors import AttnprobeError

#: Columns of ``attention``'s frame, in order.
SPAN_COLUMNS = ("layer", "name", "head", "batch", "query_span", "key_span", "mass", "mean", "rows")

_SENTENCE_END = re.compile(r"(?<=[.!?])\s+")


class SpanError(AttnprobeError, ValueError):
    """Spans that cannot be declared or do not fit the capture; the message says what to change."""


@dataclass(frozen=True, eq=False)
class SpanSet:
    """Declared spans: ``labels`` (one per span, in order) and ``ids`` ``(batch or 1, tokens)`` long, the span of each
    token (-1: none). A row of 1 applies to every batch row; tokens past ``ids``' end belong to no span."""

    labels: tuple[str, ...]
    ids: torch.Tensor

    def __post_init__(self) -> None:
        ids = torch.as_tensor(self.ids, dtype=torch.long)
        ids = ids[None] if ids.dim() == 1 else ids
        if ids.dim() != 2:
            raise SpanError(f"span ids must be (tokens,) or (batch, tokens), got shape {tuple(ids.shape)}")
        if ids.numel() and (int(ids.max()) >= len(self.labels) or int(ids.min()) < -1):
            raise SpanError(f"span ids must lie in -1 .. {len(self.labels) - 1} (one per label)")
        if len(set(self.labels)) != len(self.labels):
            raise SpanError(f"span labels must differ: {list(self.labels)}")
        object.__setattr__(self, "ids", ids)
        object.__setattr__(self, "labels", tuple(str(label) for label in self.labels))

    def for_keys(self, batch: int, keys: int) -> torch.Tensor:
        """``(batch, keys)`` span ids: broadcast over the batch, cut or padded with -1 to ``keys``."""
        ids = self.ids
        if ids.shape[0] not in (1, batch):
            raise SpanError(f"the spans were declared for {ids.shape[0]} batch rows, the capture has {batch}")
        ids = ids.expand(batch, -1)
        if ids.shape[1] >= keys:
            return ids[:, :keys]
        return torch.cat([ids, torch.full((batch, keys - ids.shape[1]), -1, dtype=torch.long)], 1)

    def describe(self) -> dict:
        """Plain values (what a record's ``meta["spans"]`` holds)."""
        return {"labels": list(self.labels), "ids": self.ids.tolist()}

    @classmethod
    def from_meta(cls, meta: Mapping) -> SpanSet:
        return cls(tuple(meta["labels"]), torch.tensor(meta["ids"], dtype=torch.long))


def ranges(spans, length: int | None = None) -> SpanSet:
    """Spans from token ranges: ``{"label": (start, stop)}`` or ``[("label", start, stop), ...]`` (stop excluded),
    over ``length`` tokens (default: the largest stop). Ranges may not overlap.

    Example::

        >>> s = ranges({"a": (0, 2), "b": (3, 5)})
        >>> s.labels, s.ids.tolist()
        (('a', 'b'), [[0, 0, -1, 1, 1]])
    """
    items = list(spans.items()) if isinstance(spans, Mapping) else [(s[0], s[1:]) for s in spans]
    bounds = []
    for label, bound in items:
        start, stop = (int(x) for x in bound)
        if not 0 <= start < stop:
            raise SpanError(f"span {label!r}: ({start}, {stop}) is not a range of tokens (0 <= start < stop)")
        bounds.append((str(label), start, stop))
    total = max((stop for _, _, stop in bounds), default=0) if length is None else int(length)
    ids = torch.full((total,), -1, dtype=torch.long)
    for i, (label, start, stop) in enumerate(bounds):
        if stop > total:
            raise SpanError(f"span {label!r} ends at token {stop}, past the {total} tokens")
        if bool((ids[start:stop] >= 0).any()):
            raise SpanError(f"span {label!r} overlaps an earlier span: each token belongs to one span at most")
        ids[start:stop] = i
    return SpanSet(tuple(label for label, _, _ in bounds), ids)


def labels(per_token: Sequence) -> SpanSet:
    """Spans from one label per token (None: no span), or one such list per batch row; spans are listed in the order
    their labels first appear.

    Example::

        >>> labels(["sys", "sys", None, "user"]).ids.tolist()
        [[0, 0, -1, 1]]
    """
    rows = [list(r) for r in per_token] if per_token and not _is_label(per_token[0]) else [list(per_token)]
    order: dict[str, int] = {}
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), -1, dtype=torch.long)
    for b, row in enumerate(rows):
        for t, label in enumerate(row):
            if label is not None:
                ids[b, t] = order.setdefault(str(label), len(order))
    return SpanSet(tuple(order), ids)


def _is_label(x) -> bool:
    return x is None or isinstance(x, (str, int))


def sentences(texts, tokenizer=None, *, offsets=None, special=None) -> SpanSet:
    """The sentences of ``texts`` (a string or one per batch row) as spans, numbered across the batch by position:
    ``"1: The cat sat…"``. Tokens map to sentences through their character offsets: ``tokenizer`` is called with
    ``return_offsets_mapping=True`` (a fast tokenizer), or give ``offsets`` (``(start, end)`` per token, per row).
    Special tokens (zero-width offsets) belong to no sentence; ``padding`` in the tokenizer call is the caller's: pass
    ``offsets`` from the same call that made the model's inputs when they are padded."""
    texts = [texts] if isinstance(texts, str) else list(texts)
    if offsets is None:
        if tokenizer is None:
            raise SpanError("sentences() needs the tokenizer, or offsets= from a call with return_offsets_mapping=True")
        encoded = tokenizer(texts, return_offsets_mapping=True, padding=True)
        offsets = encoded["offset_mapping"]
    offsets = [list(map(tuple, row)) for row in offsets]
    if len(offsets) != len(texts):
        raise SpanError(f"{len(offsets)} rows of offsets for {len(texts)} texts")
    per_token: list[list[str | None]] = []
    for text, row in zip(texts, offsets):
        bounds = [0] + [m.end() for m in _SENTENCE_END.finditer(text)] + [len(text) + 1]
        names = []
        for i in range(len(bounds) - 1):
            sentence = text[bounds[i] : bounds[i + 1]].strip()
            names.append(f"{i + 1}: {sentence[:24]}{'…' if len(sentence) > 24 else ''}")
        tokens: list[str | None] = []
        for start, end in row:
            if end <= start:  # a special token, or padding
                tokens.append(None)
                continue
            index = max(i for i in range(len(bounds) - 1) if bounds[i] <= start)
            tokens.append(names[index])
        per_token.append(tokens)
    return labels(per_token)


def chat_turns(tokenizer, messages: Sequence[Mapping], **template) -> SpanSet:
    """The turns of a conversation (``[{"role": ..., "content": ...}, ...]``) as spans ``"1: user"``, ``"2:
    assistant"``, ..., over the tokens of ``tokenizer.apply_chat_template(messages, **template)`` (pass the same keyword
    arguments as for the model's input). Turn ``i`` is every token the template adds for message ``i``."""
    if not getattr(tokenizer, "chat_template", None):
        raise SpanError(
            "this tokenizer has no chat template (tokenizer.chat_template is empty): set one, or use ranges()"
        )
    template = {k: v for k, v in template.items() if k not in ("tokenize", "return_tensors", "return_dict")}
    full = list(tokenizer.apply_chat_template(list(messages), tokenize=True, **template))
    ends = []
    for i in range(1, len(messages) + 1):
        prefix = list(tokenizer.apply_chat_template(list(messages[:i]), tokenize=True, **template))
        if full[: len(prefix)] != prefix:
            raise SpanError(
                f"the chat template renders the first {i} message(s) differently inside the whole conversation: "
                "turns cannot be told apart from prefixes; declare them with ranges()"
            )
        ends.append(len(prefix))
    ids = torch.full((len(full),), -1, dtype=torch.long)
    start = 0
    for i, end in enumerate(ends):
        ids[start:end] = i
        start = end
    return SpanSet(tuple(f"{i + 1}: {m.get('role', '?')}" for i, m in enumerate(messages)), ids)


def row_masses(record, spans: SpanSet) -> tuple[torch.Tensor, torch.Tensor] | None:
    """``(masses, positions)``: ``(batch, head, row, span)`` float64 weight of each row on each span and each row's
    position; from the record's statistics (``capture(..., spans=)``) or its weights; None when it has neither."""
    stats = record.stats or {}
    if "span_mass" in stats:
        rows = record.meta.get("span_rows")
        positions = torch.arange(stats["span_mass"].shape[2]) if rows is None else torch.tensor(rows)
        return stats["span_mass"].double().cpu(), positions + record.query_offset
    if record.weights is None:
        return None
    B, _, Tq, Tk = record.weights.shape
    masses = span_mass(TensorRows(record.weights), spans.for_keys(B, Tk), len(spans.labels))
    return masses, torch.arange(Tq) + record.query_offset


def attention(cap, spans: SpanSet, *, level: str = "head"):
    """Span x span attention of every self-attention record of ``cap``: a DataFrame with ``SPAN_COLUMNS`` (see the
    module docstring); ``level="layer"``: the heads' mean, ``head`` -1. Generation steps of one module add up.

    Example::

        >>> import torch, attnprobe
        >>> attn = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
        >>> with attnprobe.capture(attn, keep=("weights",)) as cap:
        ...     _ = attn(torch.randn(1, 6, 8))
        >>> table = attention(cap, ranges({"a": (0, 3), "b": (3, 6)}))
        >>> round(float(table.query("head == 0 and query_span == 'a' and key_span == 'a'")["mass"].iloc[0]), 6)
        1.0
    """
    if not isinstance(spans, SpanSet):
        raise SpanError(
            f"spans must be a SpanSet (spans.ranges, sentences, chat_turns or labels), not {type(spans).__name__}"
        )
    if level not in ("head", "layer"):
        raise SpanError(f"level must be 'head' or 'layer', not {level!r}")
    sums: dict[tuple, torch.Tensor] = {}
    counts: dict[tuple, torch.Tensor] = {}
    names: dict[int, str] = {}
    S = len(spans.labels)
    for r in cap:
        if r.kind != "self":
            continue
        got = row_masses(r, spans)
        if got is None:
            raise SpanError(
                f"layer {r.layer} has no weights and no span masses: capture with keep=('weights',), or with "
                "keep=('stats',) and spans= declared"
            )
        masses, positions = got  # (B, h, n, S), (n,)
        B = masses.shape[0]
        query_ids = spans.for_keys(B, int(positions.max()) + 1 if len(positions) else 0)[:, positions]  # (B, n)
        real = torch.ones(B, len(positions), dtype=torch.bool)
        if r.query_padding is not None:
            real = ~r.query_padding.bool().cpu()[:, positions - r.query_offset]
        onehot = torch.zeros(B, len(positions), S + 1, dtype=torch.float64)
        onehot.scatter_(2, torch.where(query_ids < 0, S, query_ids)[..., None], 1.0)
        onehot = onehot[..., :S] * real[..., None]  # (B, n, S): which query span each real row is in
        total = torch.einsum("bhqk,bqs->bhsk", masses.nan_to_num(0.0), onehot)  # (B, h, S query, S key)
        for i, head in enumerate(r.heads):
            key = (r.layer, int(head))
            sums[key] = sums.get(key, 0) + total[:, i]
            counts[key] = counts.get(key, 0) + onehot.sum(1)  # (B, S)
        names[r.layer] = r.name
    return _span_frame(sums, counts, names, spans, level)


def _span_frame(sums: dict, counts: dict, names: dict, spans: SpanSet, level: str):
    import pandas as pd

    sizes = torch.stack([(spans.ids == s).sum(1) for s in range(len(spans.labels))], -1)  # (batch or 1, S)
    rows = []
    keys = sorted(sums)
    groups = (
        {(layer, -1): [k for k in keys if k[0] == layer] for layer, _ in keys}
        if level == "layer"
        else {k: [k] for k in keys}
    )
    for (layer, head), members in groups.items():
        mass = torch.stack([sums[k] for k in members]).mean(0)  # (B, S, S)
        count = counts[members[0]]  # (B, S)
        for b in range(mass.shape[0]):
            size = sizes[min(b, sizes.shape[0] - 1)]
            for qs, query in enumerate(spans.labels):
                n = int(count[b, qs])
                if n == 0:
                    continue
                for ks, key in enumerate(spans.labels):
                    if int(size[ks]) == 0:  # the key span has no token in this batch row
                        continue
                    value = float(mass[b, qs, ks]) / n
                    mean = value / int(size[ks])
                    rows.append((layer, names[layer], head, b, query, key, value, mean, n))
    return pd.DataFrame(rows, columns=list(SPAN_COLUMNS))
