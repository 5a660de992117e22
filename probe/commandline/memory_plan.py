"""Will the capture fit? The command line's memory plan, made before the forward.

A lower bound on what a full capture of the input stores (``planned_attention_bytes``), the limit it must fit
(``--max-bytes``, else the memory available), and what follows from the two: the switch to the statistics mode
when a full capture would not fit (``switch_to_stats``), a refusal when it must not switch (``check_input_size``),
and how finely a statistics report pools each head (``default_cells``, ``statistics_overview``). Each takes the
attention modules found before the run (``attnprobe.attention_modules(model)``, which the command asks once).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from ..capture import AttentionModule
from ..engine.stats import Overview
from ..selection import format_bytes
from .loading import InputError, Workload, parse_int_list


def planned_attention_bytes(work: Workload, options: dict[str, Any], modules: Sequence[AttentionModule]) -> int:
    """A lower bound on what the capture will store: one call of every selected attention module found
    before the run, its (batch, head, query, key) scores and weights and, where the head size is known,
    q, k, v and the output (attention found only while the model runs comes on top)."""
    ids = work.inputs.get("input_ids")
    if ids is None or ids.ndim != 2 or not modules:
        return 0
    rows, length = ids.shape
    if "decoder_input_ids" in work.inputs:  # cross-attention is decoder x encoder: the shorter side bounds it
        length = min(length, work.inputs["decoder_input_ids"].shape[-1])
    keep = options.get("keep")
    if keep is not None and set(keep) == {"stats"}:  # O(T) per head: far below any (query x key) capture
        return 0
    square = 2 if keep is None else sum(name in keep for name in ("scores", "weights"))
    per_head = 4 if keep is None else sum(name in keep for name in ("q", "k", "v", "output"))
    itemsize = next((p.dtype.itemsize for p in work.model.parameters() if p.is_floating_point()), 4)
    n = len(modules)
    layers = options.get("layers")
    chosen = None if layers is None else {layer + n if layer < 0 else layer for layer in layers}
    heads = options.get("heads")
    total = 0
    for m in modules:
        if (chosen is not None and m.layer not in chosen) or not m.num_heads:
            continue
        h = m.num_heads if heads is None else sum(0 <= x < m.num_heads for x in heads)
        head_dim = _head_dim(work, m.name, m.num_heads)
        vectors = per_head * head_dim if head_dim is not None else 0  # k, v counted as if not grouped
        total += rows * h * length * (length * square + vectors) * itemsize
    return total


def _head_dim(work: Workload, name: str, num_heads: int) -> int | None:
    """The head size of attention module ``name``: its own ``head_dim``/``d_head``, the config's, or the hidden size
    over the heads; None when nothing says."""
    config = getattr(work.model, "config", None)
    module = work.model.get_submodule(name)
    head_dim = getattr(module, "head_dim", None) or getattr(module, "d_head", None) or getattr(config, "head_dim", None)
    if isinstance(head_dim, int):
        return head_dim
    hidden = getattr(config, "hidden_size", None)
    return hidden // num_heads if isinstance(hidden, int) else None


def available_memory() -> int | None:
    """Bytes of memory available now (Linux: MemAvailable), else the machine's total, else None."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def capture_limit(options: dict[str, Any], max_bytes_text: str | None) -> tuple[int | None, str]:
    """(bytes, what) a capture must fit: --max-bytes, else the memory available (None: unknown)."""
    if options.get("max_bytes") is not None:
        return options["max_bytes"], f"--max-bytes {max_bytes_text}"
    return available_memory(), "the memory available on this machine"


def switch_to_stats(
    work: Workload, options: dict[str, Any], max_bytes_text: str | None, modules: Sequence[AttentionModule]
) -> str | None:
    """When a full capture of this input would pass the limit: the line that says the statistics mode is used
    instead (the command prints it on stderr once the capture worked); else None."""
    need = planned_attention_bytes(work, options, modules)
    limit, what = capture_limit(options, max_bytes_text)
    if limit is None or need <= limit:
        return None
    return (
        f"attnprobe: a full capture of this input needs at least {format_bytes(need)}, more than {what} "
        f"({format_bytes(limit)}): used the statistics mode (--stats: per-row statistics computed blockwise, "
        "no query x key matrix; --full refuses instead)"
    )


def check_input_size(
    work: Workload, options: dict[str, Any], max_bytes_text: str | None, modules: Sequence[AttentionModule]
) -> None:
    """Refuse, before the forward, an input whose capture cannot fit: over --max-bytes, or over this
    machine's memory when no budget is given. The figure says how much and what to change."""
    need = planned_attention_bytes(work, options, modules)
    limit, what = capture_limit(options, max_bytes_text)
    if limit is None or need <= limit:
        return
    rows, length = work.inputs["input_ids"].shape
    over = "capture budget exceeded: " if max_bytes_text is not None else "too large an input: "
    raise InputError(
        f"{over}the input ({rows:,} row(s) of up to {length:,} tokens) needs at least {format_bytes(need)} "
        f"to capture the selected attention layers, more than {what} "
        f"({format_bytes(limit)}): give fewer inputs (--text/--file lines) or shorter ones, select "
        "fewer layers (--layers) or heads (--heads)" + (", or raise --max-bytes" if max_bytes_text is not None else "")
    )


def default_cells(heads: str | None, modules: Sequence[AttentionModule]) -> int:
    """Overview cells per side for a statistics report: 512 for up to 2 heads, 256 up to 8, 128 beyond (a
    32k-token report of 32 heads stays under 30 MB)."""
    chosen = parse_int_list(heads, "--heads")
    total = sum(m.num_heads if chosen is None else len(chosen) for m in modules if m.num_heads)
    return 512 if total <= 2 else 256 if total <= 8 else 128


def parse_window(text: str, length: int, key_length: int) -> tuple[int, int, int, int]:
    """``--window Q0:Q1,K0:K1`` -> (q0, q1, k0, k1), checked against the input's length."""
    try:
        rows, keys = text.split(",")
        q0, q1 = (int(x) for x in rows.split(":"))
        k0, k1 = (int(x) for x in keys.split(":"))
    except ValueError:
        raise InputError(
            f"--window {text!r}: write query rows and keys as Q0:Q1,K0:K1, e.g. --window 0:64,0:64"
        ) from None
    if not (0 <= q0 < q1 <= length and 0 <= k0 < k1 <= key_length):
        raise InputError(
            f"--window {text!r} is outside the input ({length} queries x {key_length} keys): "
            "choose 0 <= Q0 < Q1 <= queries and 0 <= K0 < K1 <= keys"
        )
    return q0, q1, k0, k1


def statistics_overview(
    work: Workload, heads: str | None, windows: tuple[str, ...], cells: int | None, modules: Sequence[AttentionModule]
) -> Overview:
    """The ``Overview`` a statistics report keeps: --cells (or ``default_cells``) and the --window choices
    (default: the first and the last 128 x 128 of the input)."""
    ids = work.inputs.get("input_ids")
    if ids is None or ids.ndim != 2:
        if windows:
            raise InputError("--window needs token ids (input_ids) to check the window against the input")
        return Overview(cells=cells or default_cells(heads, modules))
    length = key_length = int(ids.shape[-1])
    if "decoder_input_ids" in work.inputs:
        length = int(work.inputs["decoder_input_ids"].shape[-1])
    if windows:
        chosen = tuple(parse_window(w, length, key_length) for w in windows)
    else:
        n, m = min(128, length), min(128, key_length)
        chosen = tuple(dict.fromkeys([(0, n, 0, m), (length - n, length, key_length - m, key_length)]))
    return Overview(cells=cells or default_cells(heads, modules), windows=chosen)
