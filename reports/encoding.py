"""How matrices travel inside the HTML report: compact, lossless by default, decoded lazily by the browser.

Every (record, head, quantity) is one *blob*: the float32 values of the ``(query, key)`` matrix of
one batch row, little-endian, **byte-shuffled** (all first bytes, then all second bytes, ...: sign
and exponent bytes then compress well), deflated with zlib (the browser's built-in
``DecompressionStream("deflate")`` reads it) and base64-encoded into its own inert
``<script type="application/x-attnprobe-blob">`` element. The browser decodes a head only when it
is opened, so a long input costs load time only for the heads looked at.

- ``precision="exact"``: the stored float32 values, bit for bit (float16 / bfloat16 captures convert
  to float32 exactly; float64 ones are rounded to float32, and the report says so).
- ``precision="bfloat16"``: values rounded to bfloat16 (8 significant bits, about 3 decimal digits)
  before encoding; only the two high byte planes are stored. The report labels every value as rounded.
- Scores of cells the query may not attend are replaced by NaN unless ``masked_scores=True``:
  the softmax never saw them, and at a long causal input they are half of all scores.
- Thumbnails: each head max-pooled to at most ``THUMB`` x ``THUMB`` cells, as float16. NaN marks a
  block with no allowed cell, a negative value a block where a masked cell carries weight.
- ``allowed`` masks: bit-packed (little bit order), deflated.
"""

from __future__ import annotations

import base64
import zlib
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

#: Largest thumbnail side, in cells.
THUMB = 64
PRECISIONS = ("exact", "bfloat16")
#: zlib level: 1 is within ~2% of level 6 on byte-shuffled floats and several times faster.
LEVEL = 1


class Blobs:
    """Collects compressed payloads; each gets an element id (``b0``, ``b1``, ...; ``prefix`` other than ``"b"``
    for a second collection on the same page, e.g. the Image section's ``i0``, ``i1``, ...)."""

    def __init__(self, workers: int = 2, pending: int = 8, prefix: str = "b") -> None:
        self._prefix = prefix
        self._jobs: list = []
        self._pool = ThreadPoolExecutor(max_workers=workers)  # zlib releases the GIL
        # each queued job keeps its input matrix alive: without a bound, a producer faster than zlib
        # would hold every head of the capture in memory at once
        self._pending = max(pending, workers)
        self._waited = 0  # jobs before this index are known to be done

    def add(self, make_bytes) -> str:
        """Schedule ``make_bytes()`` (raw bytes, compressed here) and return the blob id.

        Blocks while ``pending`` jobs are still queued or running."""
        while len(self._jobs) - self._waited >= self._pending:
            self._jobs[self._waited].result()
            self._waited += 1
        ident = f"{self._prefix}{len(self._jobs)}"
        self._jobs.append(
            self._pool.submit(lambda: base64.b64encode(zlib.compress(make_bytes(), LEVEL)).decode("ascii"))
        )
        return ident

    def results(self) -> list[tuple[str, str]]:
        try:
            return [(f"{self._prefix}{i}", job.result()) for i, job in enumerate(self._jobs)]
        finally:
            self._pool.shutdown()

    def close(self) -> None:
        self._pool.shutdown(cancel_futures=True)


def shuffled_floats(values: np.ndarray, precision: str) -> bytes:
    """Float32 byte planes of ``values`` (row-major): 4 planes exact, the 2 high planes for bfloat16."""
    a = np.ascontiguousarray(values, dtype="<f4")
    if precision == "bfloat16":
        a = torch.from_numpy(a).to(torch.bfloat16).to(torch.float32).numpy()  # round to nearest even
    planes = a.reshape(-1).view(np.uint8).reshape(-1, 4).T  # (4, n): byte 0 of every value, then byte 1, ...
    if precision == "bfloat16":
        planes = planes[2:]
    return np.ascontiguousarray(planes).tobytes()


def packed_bits(mask: np.ndarray) -> bytes:
    return np.packbits(np.ascontiguousarray(mask, dtype=bool).reshape(-1), bitorder="little").tobytes()


def thumbnail(values: np.ndarray, allowed: np.ndarray, leaks: np.ndarray | None = None) -> np.ndarray:
    """Max-pool ``values`` over allowed cells to at most THUMB x THUMB (float16; NaN = nothing allowed,
    -1 = a block where a masked cell carries weight)."""
    tq, tk = values.shape
    size = (min(tq, THUMB), min(tk, THUMB))
    v = torch.from_numpy(np.where(allowed & np.isfinite(values), values, -np.inf).astype(np.float32))
    pooled = torch.nn.functional.adaptive_max_pool2d(v[None, None], size)[0, 0]
    out = torch.where(torch.isneginf(pooled), torch.nan, pooled)
    if leaks is not None and leaks.any():
        bad = torch.nn.functional.adaptive_max_pool2d(torch.from_numpy(leaks.astype(np.float32))[None, None], size)[
            0, 0
        ]
        out = torch.where(bad > 0, -1.0, out)
    return out.to(torch.float16).numpy()


def decode_floats(text: str, n: int, precision: str) -> np.ndarray:
    """Inverse of the blob encoding (used by tests and by anyone reading a report's data back)."""
    raw = np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype=np.uint8)
    planes = 4 if precision == "exact" else 2
    out = np.zeros((4, n), dtype=np.uint8)
    out[4 - planes :] = raw.reshape(planes, n)
    return np.ascontiguousarray(out.T).view("<f4").reshape(-1)
