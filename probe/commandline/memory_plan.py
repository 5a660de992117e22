"""Will the capture fit? The command line's memory plan, made before the forward and before the input is tokenized.

Two lower bounds for ``rows`` inputs padded to ``length`` tokens: what the model's own forward holds at once
(``forward_bytes``: a hidden state and a feed-forward activation), and what the capture stores
(``capture_bytes``: every selected head's (query x key) scores and weights and its q, k, v and output in a full
capture, its per-row statistics in a statistics capture). The limits they must fit: the capture ``--max-bytes``, the
two together the memory available (``available_memory``: the least of the machine's available memory, the cgroup's
room and the process's address-space limit). What follows from them: the switch to the statistics mode when a full
capture would not fit (``switch_to_stats``), a refusal when nothing fits (``check_input_size``; ``InputPlan`` asks the
same question from the line count and the longest line, before the texts are tokenized), and how finely a
statistics report pools each head (``default_cells``, ``statistics_overview``). Each takes the attention modules
found before the run (``attnprobe.attention_modules(model)``, which the command asks once).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from ..capture import AttentionModule
from ..engine.stats import KEY_STATS, ROW_STATS, Overview
from ..selection import format_bytes
from .bad_input import InputError
from .loading import Workload, parse_int_list

#: Bytes per (batch, head, query) row of a statistics capture, at least: its float statistics as float32 (two of
#: them, ``finite`` and ``diagonal_allowed``, are booleans).
STATS_ROW_BYTES = 4 * (len(ROW_STATS) - 2) + 2
#: ... and per (batch, head, key): ``key_weight`` (float32) and ``key_allowed`` (a boolean).
STATS_KEY_BYTES = 4 * (len(KEY_STATS) - 1) + 1


@dataclass(frozen=True)
class Need:
    """What ``rows`` inputs of ``length`` tokens need, at least: ``forward`` bytes for the model's own forward and
    ``capture`` bytes for what the capture stores."""

    rows: int
    length: int
    forward: int
    capture: int
    exact: bool = True  # False: ``length`` is a lower bound of the padded length (the texts are not all tokenized)

    @property
    def total(self) -> int:
        return self.forward + self.capture

    def shape(self) -> str:
        if self.exact:
            return f"the input ({self.rows:,} row(s) of up to {self.length:,} tokens)"
        return f"the input ({self.rows:,} row(s), padded to at least {self.length:,} tokens)"


def _itemsize(model: nn.Module) -> int:
    return next((p.dtype.itemsize for p in model.parameters() if p.is_floating_point()), 4)


def _config_int(config: Any, *names: str) -> int | None:
    for name in names:
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def forward_bytes(model: nn.Module, rows: int, length: int) -> int:
    """A lower bound on what the model's own forward holds at once on ``rows`` inputs of ``length`` tokens: a hidden
    state (kept for the residual connection) beside the feed-forward activation of one layer (the config's
    intermediate size, the hidden size where it says none or where experts share the tokens), or two hidden states.
    Hidden size: the config's, else the first embedding's width; 0 when neither says."""
    config = getattr(model, "config", None)
    hidden = _config_int(config, "hidden_size", "d_model", "n_embd", "dim")
    if hidden is None:
        embedding = next((m for m in model.modules() if isinstance(m, nn.Embedding)), None)
        hidden = embedding.embedding_dim if embedding is not None else 0
    experts = _config_int(config, "num_local_experts", "num_experts", "n_routed_experts")
    inner = None if experts else _config_int(config, "intermediate_size", "d_ff", "n_inner", "ffn_dim")
    return rows * length * (hidden + (inner or hidden)) * _itemsize(model)


def capture_bytes(
    model: nn.Module, rows: int, length: int, options: dict[str, Any], modules: Sequence[AttentionModule]
) -> int:
    """A lower bound on what the capture stores for ``rows`` inputs of ``length`` tokens: one call of every selected
    attention module found before the run; in a full capture its (batch, head, query, key) scores and weights and,
    where the head size is known, q, k, v and the output; in a statistics capture (``keep=("stats",)``) its per-row
    and per-key statistics (attention found only while the model runs comes on top)."""
    if not modules:
        return 0
    keep = options.get("keep")
    stats = keep is not None and set(keep) == {"stats"}
    square = 2 if keep is None else sum(name in keep for name in ("scores", "weights"))
    per_head = 4 if keep is None else sum(name in keep for name in ("q", "k", "v", "output"))
    itemsize = _itemsize(model)
    n = len(modules)
    layers = options.get("layers")
    chosen = None if layers is None else {layer + n if layer < 0 else layer for layer in layers}
    heads = options.get("heads")
    total = 0
    for m in modules:
        if (chosen is not None and m.layer not in chosen) or not m.num_heads:
            continue
        h = m.num_heads if heads is None else sum(0 <= x < m.num_heads for x in heads)
        if stats:  # O(T) per head: per query row and per key
            total += rows * h * length * (STATS_ROW_BYTES + STATS_KEY_BYTES)
            continue
        head_dim = _head_dim(model, m.name, m.num_heads)
        vectors = per_head * head_dim if head_dim is not None else 0  # k, v counted as if not grouped
        total += rows * h * length * (length * square + vectors) * itemsize
    return total


def planned_attention_bytes(work: Workload, options: dict[str, Any], modules: Sequence[AttentionModule]) -> int:
    """``capture_bytes`` of the workload's inputs (cross-attention is decoder x encoder: the shorter side bounds it)."""
    size = _input_size(work)
    return 0 if size is None else capture_bytes(work.model, *size, options, modules)


def _input_size(work: Workload) -> tuple[int, int] | None:
    ids = work.inputs.get("input_ids")
    if ids is None or ids.ndim != 2:
        return None
    rows, length = ids.shape
    if "decoder_input_ids" in work.inputs:
        length = min(length, work.inputs["decoder_input_ids"].shape[-1])
    return int(rows), int(length)


def _head_dim(model: nn.Module, name: str, num_heads: int) -> int | None:
    """The head size of attention module ``name``: its own ``head_dim``/``d_head``, the config's, or the hidden size
    over the heads; None when nothing says."""
    config = getattr(model, "config", None)
    module = model.get_submodule(name)
    head_dim = getattr(module, "head_dim", None) or getattr(module, "d_head", None) or getattr(config, "head_dim", None)
    if isinstance(head_dim, int):
        return head_dim
    hidden = getattr(config, "hidden_size", None)
    return hidden // num_heads if isinstance(hidden, int) else None


def _read_int(path: str) -> int | None:
    try:
        with open(path, encoding="ascii") as f:
            text = f.read(64).strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _status_bytes(field: str) -> int | None:
    """A ``kB`` field of ``/proc/self/status`` (``VmSize``, ``VmData``) in bytes; None where there is none."""
    try:
        with open("/proc/self/status", encoding="ascii") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _rlimit_room() -> int | None:
    """Bytes the process may still map under its address-space and data limits (``ulimit -v``, ``-d``); None when
    neither is set."""
    try:
        import resource
    except ImportError:  # not a Unix
        return None
    rooms = []
    for limit, used in ((resource.RLIMIT_AS, "VmSize"), (resource.RLIMIT_DATA, "VmData")):
        soft = resource.getrlimit(limit)[0]
        if soft != resource.RLIM_INFINITY:
            rooms.append(max(soft - (_status_bytes(used) or 0), 0))
    return min(rooms) if rooms else None


def _cgroup_room() -> int | None:
    """Bytes the process's cgroup (v2) and the cgroups above it may still use (``memory.max`` less
    ``memory.current``); None without a limit."""
    try:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            own = next((line.strip()[3:] for line in f if line.startswith("0::")), None)
    except OSError:
        return None
    if own is None:
        return None
    rooms = []
    path = own
    while True:
        folder = "/sys/fs/cgroup" + (path if path != "/" else "")
        limit, used = _read_int(folder + "/memory.max"), _read_int(folder + "/memory.current")
        if limit is not None and used is not None:
            rooms.append(max(limit - used, 0))
        if path in ("/", ""):
            break
        path = os.path.dirname(path)
    return min(rooms) if rooms else None


def available_memory() -> int | None:
    """Bytes of memory this process can still use: the least of the machine's available memory (Linux:
    MemAvailable, else the total), its cgroup's room and its address-space limit; None when nothing says."""
    machine = None
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    machine = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if machine is None:
        try:
            machine = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            machine = None
    known = [room for room in (machine, _cgroup_room(), _rlimit_room()) if room is not None]
    return min(known) if known else None


def capture_limit(options: dict[str, Any], max_bytes_text: str | None) -> tuple[int | None, str]:
    """(bytes, what) a capture must fit: --max-bytes, else the memory available (None: unknown)."""
    if options.get("max_bytes") is not None:
        return options["max_bytes"], f"--max-bytes {max_bytes_text}"
    return available_memory(), "the memory available on this machine"


def need(
    model: nn.Module,
    rows: int,
    length: int,
    options: dict[str, Any],
    modules: Sequence[AttentionModule],
    *,
    exact: bool = True,
) -> Need:
    """``Need`` of ``rows`` inputs of ``length`` tokens under ``options`` (its ``keep`` says full or statistics)."""
    return Need(
        rows, length, forward_bytes(model, rows, length), capture_bytes(model, rows, length, options, modules), exact
    )


def over_limit(need: Need, options: dict[str, Any], max_bytes_text: str | None) -> str | None:
    """Why ``need`` does not fit, in words (the figures and the limit), or None when it fits: its capture over
    --max-bytes, or its forward and capture together over the memory available."""
    if options.get("max_bytes") is not None and need.capture > options["max_bytes"]:
        return (
            f"capture budget exceeded: {need.shape()} needs at least {format_bytes(need.capture)} to capture the "
            f"selected attention layers, more than --max-bytes {max_bytes_text} ({format_bytes(options['max_bytes'])})"
        )
    memory = available_memory()
    if memory is not None and need.total > memory:
        parts = f"the model's forward {format_bytes(need.forward)} and the capture {format_bytes(need.capture)}"
        return (
            f"too large an input: {need.shape()} needs at least {format_bytes(need.total)} ({parts}), more than the "
            f"memory available on this machine ({format_bytes(memory)})"
        )
    return None


def _refusal(why: str, max_bytes_text: str | None) -> InputError:
    budget = why.startswith("capture budget")
    return InputError(
        f"{why}: give fewer inputs (--text/--file lines) or shorter ones, select fewer layers (--layers) or heads "
        "(--heads)" + (", or raise --max-bytes" if budget and max_bytes_text is not None else "")
    )


def switch_to_stats(
    work: Workload, options: dict[str, Any], max_bytes_text: str | None, modules: Sequence[AttentionModule]
) -> str | None:
    """When a full capture of this input would not fit (its capture over the limit, or with the forward over the
    memory available): the line that says the statistics mode is used instead (the command prints it on stderr once
    the capture worked); else None."""
    size = _input_size(work)
    if size is None:
        return None
    full = need(work.model, *size, options, modules)
    why = over_limit(full, options, max_bytes_text)
    if why is None:
        return None
    if why.startswith("capture budget"):
        figure, what = full.capture, f"--max-bytes {max_bytes_text} ({format_bytes(options['max_bytes'])})"
    else:
        figure, what = full.total, f"the memory available on this machine ({format_bytes(available_memory() or 0)})"
    return (
        f"attnprobe: a full capture of this input needs at least {format_bytes(figure)}, more than {what}: used the "
        "statistics mode (--stats: per-row statistics computed blockwise, no query x key matrix; --full refuses "
        "instead)"
    )


def check_input_size(
    work: Workload, options: dict[str, Any], max_bytes_text: str | None, modules: Sequence[AttentionModule]
) -> None:
    """Refuse, before the forward, an input whose capture cannot fit: over --max-bytes, or with the forward over this
    machine's memory. The figure says how much and what to change."""
    size = _input_size(work)
    if size is None:
        return
    why = over_limit(need(work.model, *size, options, modules), options, max_bytes_text)
    if why is not None:
        raise _refusal(why, max_bytes_text)


@dataclass
class InputPlan:
    """The memory plan asked before the texts are tokenized (``sizing.encode_texts``'s ``plan``): can ``rows``
    inputs of at least ``length`` tokens be captured at all, in the cheapest mode the command may use (statistics
    unless ``stats`` is False)? ``find`` lists the model's attention modules (``attnprobe.attention_modules``),
    asked once; ``options`` are the capture's (``layers``, ``heads``, ``max_bytes``, ``keep``)."""

    options: dict[str, Any]
    max_bytes_text: str | None
    stats: bool | None
    find: Callable[[nn.Module], Sequence[AttentionModule]]
    found: Sequence[AttentionModule] | None = None

    def check(self, model: nn.Module, rows: int, length: int, exact: bool) -> None:
        if self.found is None:
            self.found = self.find(model)
        options = self.options
        if self.stats is not False and options.get("keep") is None:
            options = {**options, "keep": ("stats",)}
        why = over_limit(need(model, rows, length, options, self.found, exact=exact), options, self.max_bytes_text)
        if why is not None:
            raise _refusal(why, self.max_bytes_text)


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
