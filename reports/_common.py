"""What the PNG and HTML reports share: one head of one batch row as arrays, token labels, output paths.

torch and numpy only; matplotlib, pandas and jinja2 are imported by the modules that draw or render.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from ..probe.errors import AttnprobeError
from ..probe.files import target_path
from ..probe.outputs.tokens import record_token_rows
from ..probe.record import AttentionRecord

#: Colour of cells the query may not attend (light neutral grey: no sequential colour map uses it).
DISALLOWED_COLOR = "#d4d4d4"
#: Colour of disallowed cells that nevertheless carry weight (a masking bug): never hidden as grey.
LEAK_COLOR = "#e0115f"


@dataclass(frozen=True)
class HeadView:
    """One head of one batch row of a record, as float32 / bool numpy arrays ``(query, key)``."""

    record: AttentionRecord
    head: int  # model head number
    batch: int
    weights: np.ndarray | None  # (query, key) float32, post-softmax
    scores: np.ndarray | None  # (query, key) float32, pre-softmax
    allowed: np.ndarray  # (query, key) bool; all True when the record has no mask
    query_padding: np.ndarray  # (query,) bool
    mask_known: bool  # False when the record carried no ``allowed`` mask

    @property
    def shape(self) -> tuple[int, int]:
        return self.allowed.shape

    @property
    def leaks(self) -> np.ndarray:
        """Cells that are not allowed yet carry non-zero weight (bool ``(query, key)``)."""
        if self.weights is None:
            return np.zeros(self.shape, dtype=bool)
        return ~self.allowed & (self.weights != 0)


def require_record(obj, function: str) -> AttentionRecord:
    """``obj`` when it is one AttentionRecord; a one-line TypeError naming what to pass otherwise."""
    if isinstance(obj, AttentionRecord):
        return obj
    from ..probe.capture import Capture

    if isinstance(obj, Capture):
        layer = obj[0].layer if len(obj) else 0
        raise TypeError(
            f"{function}() draws one AttentionRecord, got a Capture of {len(obj)} record(s): pick one, e.g. "
            f"{function}(cap.record({layer}), ...) or cap[0], or draw every record with save_grid(cap, path)"
        )
    raise TypeError(
        f"{function}() draws one AttentionRecord (e.g. cap[0] or cap.record(layer)), got {type(obj).__name__}"
    )


def require_records(obj, function: str) -> list[AttentionRecord]:
    """The records of a Capture (or of a list of records); a one-line TypeError naming what to pass otherwise."""
    if isinstance(obj, AttentionRecord):
        raise TypeError(
            f"{function}() takes a Capture, got one AttentionRecord: pass the capture it came from, or "
            f"Capture([record]); for one head of one record use heatmap(record, head=...)"
        )
    from ..probe.capture import Capture

    if isinstance(obj, Capture) or (
        isinstance(obj, (list, tuple)) and all(isinstance(r, AttentionRecord) for r in obj)
    ):
        return list(obj)
    raise TypeError(
        f"{function}() takes an attnprobe.Capture (from `with attnprobe.capture(model) as cap`), "
        f"got {type(obj).__name__}"
    )


def _numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu", torch.float32).numpy()


def matrix_shape(record: AttentionRecord) -> tuple[int, int]:
    """(query, key) lengths of a record that holds a (query x key) matrix; an error names the record otherwise."""
    q_len, k_len = record.query_len, record.key_len
    if q_len is None or k_len is None:
        raise AttnprobeError(
            f"layer {record.layer} ({record.name!r}) holds no (query, key) matrix: capture with keep=['weights'] "
            "or keep=['scores', 'weights'] to draw it"
        )
    return q_len, k_len


def matrix_rows(record: AttentionRecord) -> int:
    """Batch rows of a record that holds tensors; an error names the record otherwise."""
    size = record.batch_size
    if size is None:
        raise AttnprobeError(f"layer {record.layer} ({record.name!r}) holds no tensor to draw or compare")
    return size


def check_batch(record: AttentionRecord, batch: int) -> None:
    size = record.batch_size
    if isinstance(batch, bool) or not isinstance(batch, int):
        raise AttnprobeError(f"batch must be an int (the batch row to show), got {batch!r}")
    if size is None or not 0 <= batch < size:
        raise AttnprobeError(
            f"batch row {batch} does not exist in layer {record.layer} ({record.name!r}), "
            f"which has batch size {size}; pass batch= between 0 and {(size or 1) - 1}"
        )


def resolve_head(record: AttentionRecord, head: int | None) -> int:
    """The model head number to draw: ``head``, or the record's only head when None."""
    if head is None:
        if len(record.heads) == 1:
            return record.heads[0]
        raise AttnprobeError(
            f"layer {record.layer} ({record.name!r}) has {len(record.heads)} heads {list(record.heads)}; "
            "say which one with head="
        )
    if isinstance(head, bool) or not isinstance(head, int):
        raise AttnprobeError(f"head must be a model head number (int), got {head!r}")
    record.head_index(head)  # raises a KeyError naming the stored heads
    return head


def head_view(record: AttentionRecord, head: int, batch: int = 0) -> HeadView:
    """Arrays of model head ``head`` in batch row ``batch`` of ``record``."""
    if not isinstance(record, AttentionRecord):
        raise TypeError(f"expected an AttentionRecord (e.g. cap[0] or cap.record(layer)), got {type(record).__name__}")
    check_batch(record, batch)
    i = record.head_index(head)
    if record.weights is None and record.scores is None:
        raise AttnprobeError(
            f"layer {record.layer} ({record.name!r}) has neither weights nor scores: capture with "
            "keep=['weights'] or keep=['scores', 'weights'] to draw it"
        )
    weights = None if record.weights is None else _numpy(record.weights[batch, i])
    scores = None if record.scores is None else _numpy(record.scores[batch, i])
    tq, tk = matrix_shape(record)
    allowed_t = record.allowed_for_heads()
    if allowed_t is None:
        allowed = np.ones((tq, tk), dtype=bool)
    else:
        allowed = allowed_t[batch, i].detach().cpu().numpy().astype(bool, copy=False)
    qp = record.query_padding
    padding = np.zeros(tq, dtype=bool) if qp is None else qp[batch].detach().cpu().numpy().astype(bool, copy=False)
    return HeadView(record, head, batch, weights, scores, allowed, padding, allowed_t is not None)


# --------------------------------------------------------------------------------------- tokens
#: Characters that draw nothing yet count as printable: fillers, variation selectors, the combining
#: grapheme joiner, Mongolian selectors, the Braille blank (format characters such as the bidirectional
#: overrides U+202E and the zero-width space U+200B are already not printable).
INVISIBLE = frozenset(
    "\u034f\u115f\u1160\u17b4\u17b5\u3164\uffa0\u2800"
    + "".join(map(chr, range(0x180B, 0x1810)))
    + "".join(map(chr, range(0xFE00, 0xFE10)))
    + "".join(map(chr, range(0xE0100, 0xE01F0)))
)


def _escaped(ch: str) -> str:
    named = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
    if ch in named:
        return named[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def display_token(token: str, limit: int = 0) -> str:
    """A token as one line of visible text, the one form every report draws (HTML labels, readouts and
    token lists, PNG tick labels): control, bidirectional and invisible characters escaped as ``\\u202e``
    (so "\u202eevil" cannot read "live"), optionally shortened to ``limit`` characters."""
    text = "".join(ch if (ch.isprintable() or ch == " ") and ch not in INVISIBLE else _escaped(ch) for ch in token)
    if limit and len(text) > limit:
        text = text[: limit - 1] + "\u2026"
    return text


@dataclass(frozen=True)
class Labels:
    """Token labels of a record's query rows and key columns (None = positions only)."""

    query: list[str] | None
    key: list[str] | None


def record_labels(record: AttentionRecord, batch: int, tokens, key_tokens, image_tokens=None) -> Labels:
    """Query and key labels of ``record`` for batch row ``batch`` (see ``attnprobe.probe.outputs.tokens``); a record
    whose keys are all one picture's tokens (a vision tower's, with ``image_tokens``) is labelled by its patches."""
    patches = None if image_tokens is None else image_tokens.patch_labels(record, batch)
    if patches is not None:
        return Labels(*patches)
    q_rows, k_rows = record_token_rows(record, tokens, key_tokens)
    q_len, k_len = record.query_len, record.key_len  # None: no tensor says (positions only)
    q0, k0 = record.query_offset, record.key_start
    query = None if q_rows is None or q_len is None else q_rows[batch][q0 : q0 + q_len]
    key = None if k_rows is None or k_len is None else k_rows[batch][k0 : k0 + k_len]
    return Labels(query, key)


# --------------------------------------------------------------------------------------- files
def output_path(path, *, overwrite: bool) -> Path:
    """``path`` as a Path, refusing a folder, an existing path (a symlink too) unless ``overwrite``, and a
    missing folder (see ``attnprobe.probe.files``, which every writer here writes through)."""
    p = Path(os.fspath(path))
    if p.is_dir() and not p.is_symlink():
        raise IsADirectoryError(f"{p} is a folder; give a file name such as {p / 'report.html'}")
    return target_path(p, overwrite=overwrite)
