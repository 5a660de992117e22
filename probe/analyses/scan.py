"""Dataset-scale scans: per-head attention statistics over many inputs, to a partitioned Parquet dataset.

``scan(model, data, out)`` runs the model over every input of ``data`` in padded batches under a statistics
capture (``keep=("stats",)``: no (query x key) tensor is stored) and writes, for every input, layer and head,
the statistics aggregated over the input's real query rows (padding left out) to ``out/part-NNNNN.parquet``,
one file per chunk of ``chunk_size`` inputs. The folder reads as one table with pandas, polars or DuckDB
(``SELECT layer, head, avg(entropy) FROM 'out/*.parquet' GROUP BY ALL``).

- ``out/_scan.json`` holds what the scan is (model, selection, data, truncation, chunking): a scan refuses to
  write into a folder that holds another scan's files;
- ``resume=True`` skips the chunks already written (each file is written to a temporary name and renamed
  into place, so an interrupted scan loses at most the chunk it was writing);
- under ``accelerate launch`` or ``torchrun`` every process takes its own chunks (accelerate's
  ``split_between_processes``), writes its own files, and the main process writes ``out/_manifest.json``
  when all are done.

The capture itself is not made here: probe/ never imports the adapters. ``attnprobe.scan`` passes the
wired ``attnprobe.capture``.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import overload

import torch

from ..errors import AttnprobeError
from ..reading import DATA_FILE_LIMIT, open_regular
from ..textlines import measure, read_lines
from .head_classes import entropy_ratio

FORMAT = 1
CONFIG = "_scan.json"  # "_" first: pyarrow, pandas and Spark readers of the folder skip it
MANIFEST = "_manifest.json"

#: Per-row statistics averaged over an input's real query rows (NaN rows, e.g. ``previous_mass`` of the
#: first query, left out of the mean).
MEAN_STATS = (
    "entropy",
    "entropy_ratio",
    "max_weight",
    "first_key_mass",
    "diagonal_mass",
    "previous_mass",
    "masked_mass",
    "row_sum_error",
    "max_score",
    "output_error",
)
#: Row-level extremes kept beside the means: (column, statistic, "min" | "max").
EXTREMES = (
    ("entropy_min", "entropy", "min"),
    ("max_weight_max", "max_weight", "max"),
    ("max_score_max", "max_score", "max"),
    ("masked_mass_max", "masked_mass", "max"),
    ("row_sum_error_max", "row_sum_error", "max"),
    ("output_error_max", "output_error", "max"),
)


class ScanError(AttnprobeError, ValueError):
    """A scan's data, folder or options cannot be used; the message says what to do."""


# ----------------------------------------------------------------------------------------------- inputs


#: Inputs of a .txt or .jsonl file read at a time (``FileInputs``).
BLOCK_INPUTS = 256
#: The longest line of a .jsonl file, in characters (its text and the other fields).
JSONL_LINE_CHARS = 64 << 20
#: Characters of an input per token the model can take (``input_chars``): no tokenizer's tokens are that long.
CHARS_PER_TOKEN = 64
#: .csv and .parquet files are read whole: at most this many bytes.
TABLE_FILE_LIMIT = 1 << 30


class FileInputs(Sequence[str]):
    """The inputs of a ``.txt`` file (its non-blank lines) or a ``.jsonl`` file (``field`` of each non-blank line),
    counted and checked in one bounded pass (``probe.textlines.measure``: a regular file, UTF-8, no NUL byte; every
    JSON line parsed, its field there) and then read ``BLOCK_INPUTS`` at a time where they are asked for: a scan
    never holds the whole file. ``longest`` and ``longest_line``: the longest input's characters and line."""

    def __init__(self, path: Path, *, field: str | None = None, limit: int | None = None) -> None:
        self.path, self.jsonl = path, path.suffix.lower() == ".jsonl"
        self.field = field or "text"
        self.shape = measure(
            path,
            limit=DATA_FILE_LIMIT,
            what="data file",
            breaks="universal",
            mark_every=BLOCK_INPUTS,
            parse=(lambda number, line: len(self._text(number, line))) if self.jsonl else None,
            line_chars=JSONL_LINE_CHARS,
            most=limit,
        )
        self.total = self.shape.inputs
        self._block: tuple[int, list[str]] = (-1, [])

    @property
    def longest(self) -> int:
        return self.shape.longest

    @property
    def longest_line(self) -> int:
        return self.shape.longest_line

    def _text(self, number: int, line: str) -> str:
        if not self.jsonl:
            return line
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ScanError(f"{self.path}:{number}: not a JSON line ({e.msg})") from None
        if not isinstance(row, dict) or self.field not in row:
            raise ScanError(f"{self.path}:{number}: no field {self.field!r} (choose one with --field)")
        return str(row[self.field])

    def __len__(self) -> int:
        return self.total

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...

    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self.total))]
        i = i + self.total if i < 0 else i
        if not 0 <= i < self.total:
            raise IndexError(i)
        block, texts = self._block
        if block != i // BLOCK_INPUTS:
            block = i // BLOCK_INPUTS
            lines = read_lines(
                self.path,
                limit=DATA_FILE_LIMIT,
                what="data file",
                breaks="universal",
                start=self.shape.marks[block],
                count=BLOCK_INPUTS,
            )
            texts = [self._text(0, line) for line in lines]
            self._block = (block, texts)
        return texts[i - block * BLOCK_INPUTS]


def read_inputs(path: str | os.PathLike, *, field: str | None = None, limit: int | None = None) -> list[str]:
    """The texts of ``path``: ``.txt`` (one per line, blank lines skipped), ``.jsonl`` (``field``, default
    ``text``), ``.csv`` / ``.parquet`` (``field``), or a folder saved by ``datasets``' ``save_to_disk``. A scan reads
    .txt and .jsonl files a block at a time instead (``data_inputs``)."""
    return list(data_inputs(path, field=field, limit=limit))


def data_inputs(path: str | os.PathLike, *, field: str | None = None, limit: int | None = None) -> Sequence[str]:
    """``read_inputs``, with .txt and .jsonl files as ``FileInputs``: counted and checked, not held."""
    path = Path(path)
    if limit is not None and limit < 1:
        raise ScanError(f"limit must be a positive number of inputs, not {limit}")
    if not path.exists():
        raise ScanError(
            f"no data at {str(path)!r}: give a .txt, .jsonl, .csv or .parquet file, or a folder "
            "saved with datasets' save_to_disk"
        )
    suffix = path.suffix.lower()
    texts: Sequence[str]
    if path.is_dir():
        texts = _read_datasets_folder(path, field or "text", limit)
    elif suffix in (".txt", ".jsonl"):
        texts = FileInputs(path, field=field, limit=limit)
    elif suffix in (".csv", ".parquet"):
        texts = _read_table(path, field, limit)
    else:
        raise ScanError(f"cannot read {path.name}: give a .txt, .jsonl, .csv or .parquet file, or a datasets folder")
    if not texts:
        raise ScanError(f"{path} holds no input")
    return texts


def _read_table(path: Path, field: str | None, limit: int | None) -> list[str]:
    """The column ``field`` of a .csv or .parquet file (a regular file of at most ``TABLE_FILE_LIMIT`` bytes, read
    whole through the descriptor that was checked)."""
    import pandas as pd

    if field is None:
        raise ScanError(f"{path.name}: say which column holds the text (--field / field=)")
    suffix = path.suffix.lower()
    with open_regular(path, what="data file", limit=TABLE_FILE_LIMIT) as f:
        frame = (
            pd.read_csv(f, usecols=lambda c: c == field, dtype=str, keep_default_na=False, nrows=limit)
            if suffix == ".csv"
            else pd.read_parquet(f)
        )
    if field not in frame.columns:
        raise ScanError(
            f"{path.name}: no column {field!r} (columns: {', '.join(map(str, frame.columns))})"
            if suffix == ".parquet"
            else f"{path.name}: no column {field!r}"
        )
    return [str(t) for t in frame[field].tolist()[:limit]]


def scan_texts(model, data, *, field: str | None, limit: int | None, max_length: int | None) -> Sequence[str]:
    """The texts a scan reads: ``data`` itself (texts given in Python) or ``data_inputs`` of the path (a .txt or
    .jsonl file counted and checked, not held), at most ``limit``, each cut at ``input_chars``."""
    texts = list(data) if not isinstance(data, (str, os.PathLike)) else data_inputs(data, field=field, limit=limit)
    if limit is not None and len(texts) > limit:
        texts = texts[:limit]
    if not texts:
        raise ScanError("no input to scan")
    return CutTexts(texts, input_chars(model, texts, max_length))


class CutTexts(Sequence[str]):
    """``texts``, each cut at ``chars`` characters (``input_chars``) when it is read."""

    def __init__(self, texts: Sequence[str], chars: int) -> None:
        self.texts, self.chars = texts, chars

    def __len__(self) -> int:
        return len(self.texts)

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> Sequence[str]: ...

    def __getitem__(self, i: int | slice) -> str | Sequence[str]:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return self.texts[i][: self.chars]


def input_chars(model, texts: Sequence[str], max_length: int | None) -> int:
    """The characters of an input the tokenizer is given: ``CHARS_PER_TOKEN`` per token of ``max_length`` (the rest
    could not survive its truncation), else per position of the model (``max_position_embeddings``), else 2**20.
    Without ``max_length``, an input longer than that cannot fit the model and is refused before anything is
    tokenized; with it, longer inputs are cut there, as the truncation cuts them."""
    config = getattr(model, "config", None)
    sizes = (getattr(config, name, None) for name in ("max_position_embeddings", "n_positions"))
    positions = next((v for v in sizes if isinstance(v, int) and v > 0), None)
    tokens = max_length or positions
    chars = CHARS_PER_TOKEN * tokens if tokens else 1 << 20
    if isinstance(texts, FileInputs):
        longest, where = texts.longest, f"line {texts.longest_line:,} of {texts.path}"
    else:
        index = max(range(len(texts)), key=lambda i: len(texts[i]))
        longest, where = len(texts[index]), f"input {index:,}"
    if longest > chars and max_length is None:
        why = f"the model's {positions:,} positions" if positions else "a scan"
        raise ScanError(
            f"{where} is {longest:,} characters long, more than {why} can hold (at most {CHARS_PER_TOKEN} characters "
            f"a token: {chars:,}); give --max-length (max_length=) to truncate, or shorter inputs"
        )
    return chars


def _read_datasets_folder(path: Path, field: str, limit: int | None) -> list[str]:
    try:
        import datasets
    except ImportError:
        raise ScanError(
            f"{path} is a folder: reading a datasets folder needs the datasets package "
            "(pip install datasets); or give a .txt, .jsonl, .csv or .parquet file"
        ) from None
    try:
        data = datasets.load_from_disk(str(path))
    except Exception as e:
        raise ScanError(f"{path}: not a folder saved with datasets' save_to_disk ({e})") from None
    if isinstance(data, datasets.DatasetDict):
        raise ScanError(f"{path} holds the splits {', '.join(data)}: give one split's folder")
    if field not in data.column_names:
        raise ScanError(f"{path}: no column {field!r} (columns: {', '.join(data.column_names)})")
    column = data[field] if limit is None else data.select(range(min(limit, len(data))))[field]
    return [str(t) for t in column]


# ----------------------------------------------------------------------------------------------- aggregation


def aggregate(cap, indexes: Sequence[int], tokens: Sequence[int]) -> dict[str, list]:
    """Columns of one row per (input, record, head): statistics over each input's real query rows."""
    columns: dict[str, list] = {
        name: []
        for name in (
            "input",
            "tokens",
            "layer",
            "head",
            "module",
            "kind",
            "call",
            "rows",
            "nonfinite_rows",
            *MEAN_STATS,
            *(c for c, _, _ in EXTREMES),
        )
    }
    for rec in cap:
        stats = getattr(rec, "stats", None)
        if not stats:
            raise ScanError(
                f"{rec.name}: no statistics were computed for this layer "
                f"({rec.weights_source} weights); a scan needs q and k"
            )
        batch, heads, queries = stats["entropy"].shape
        real = rec.stats_real_rows  # every query row the statistics describe, less padding
        values = {
            name: stats[name].detach().double().cpu()
            for name in {*MEAN_STATS, *(s for _, s, _ in EXTREMES)}
            if name in stats
        }
        if "allowed_keys" in stats:  # entropy / its largest possible value, log(allowed keys)
            values["entropy_ratio"] = entropy_ratio(values["entropy"], stats["allowed_keys"].cpu())
        finite = stats["finite"].cpu().bool()
        count = real.sum(-1)
        for name in MEAN_STATS:
            if name not in values:
                values[name] = torch.full((batch, heads, queries), math.nan, dtype=torch.float64)
        means = {}
        for name in MEAN_STATS:
            v = values[name].masked_fill(~real, math.nan)
            v = v.masked_fill(v.isinf(), math.nan) if name == "max_score" else v
            means[name] = v.nanmean(-1)
        extremes = {}
        for column, name, how in EXTREMES:
            v = values[name].masked_fill(~real | values[name].isnan(), math.inf if how == "min" else -math.inf)
            out = v.amin(-1) if how == "min" else v.amax(-1)
            extremes[column] = out.masked_fill(out.isinf() & (count == 0), math.nan)
        nonfinite = (~finite & real).sum(-1)
        for b in range(batch):
            for h, head in enumerate(rec.heads):
                columns["input"].append(int(indexes[b]))
                columns["tokens"].append(int(tokens[b]))
                columns["layer"].append(rec.layer)
                columns["head"].append(int(head))
                columns["module"].append(rec.name)
                columns["kind"].append(rec.kind)
                columns["call"].append(rec.call)
                columns["rows"].append(int(count[b, h]))
                columns["nonfinite_rows"].append(int(nonfinite[b, h]))
                for name in MEAN_STATS:
                    columns[name].append(float(means[name][b, h]))
                for column in extremes:
                    columns[column].append(float(extremes[column][b, h]))
    return columns


# ----------------------------------------------------------------------------------------------- the folder


@dataclass(frozen=True)
class Plan:
    """Which inputs each chunk holds."""

    inputs: int
    chunk_size: int

    @property
    def chunks(self) -> int:
        return math.ceil(self.inputs / self.chunk_size)

    def span(self, chunk: int) -> range:
        return range(chunk * self.chunk_size, min(self.inputs, (chunk + 1) * self.chunk_size))


def part_name(chunk: int) -> str:
    return f"part-{chunk:05d}.parquet"


def prepare_folder(out: Path, config: dict, *, resume: bool, main: bool) -> None:
    """Create ``out`` (main process) and make sure it holds this scan's files only. The other processes call it
    after the main one has (a barrier between): they check only that the folder's config is this scan's, since
    the main process may already be writing its parts."""
    existing = out / CONFIG
    if out.exists() and not out.is_dir():
        raise ScanError(f"{out} is a file: give a folder for the scan")
    if not main and not existing.exists():
        raise ScanError(
            f"{existing} is missing after the main process prepared {out}: is it on a disk every process shares?"
        )
    if existing.exists():
        try:
            theirs = json.loads(existing.read_text())
        except (OSError, json.JSONDecodeError):
            raise ScanError(f"{existing} cannot be read: give another folder") from None
        different = sorted(k for k in set(theirs) | set(config) if theirs.get(k) != config.get(k))
        if different:
            raise ScanError(
                f"{out} holds another scan (its {', '.join(different)} differ): give another folder or remove it"
            )
        if main and not resume and any(out.glob("part-*.parquet")):
            raise ScanError(
                f"{out} already holds this scan's files: pass --resume (resume=True) to skip the chunks "
                "written, or give another folder"
            )
    elif out.is_dir() and any(out.iterdir()):
        raise ScanError(f"{out} holds other files: give an empty or new folder")
    if main:
        out.mkdir(parents=True, exist_ok=True)
        if not existing.exists():
            _write_text(existing, json.dumps(config, indent=2, sort_keys=True))


def _write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_part(path: Path, columns: dict[str, list], metadata: dict) -> None:
    """One chunk's rows, with the scan's description in the file's metadata; renamed into place."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table(columns)
    table = table.replace_schema_metadata(
        {**(table.schema.metadata or {}), b"attnprobe": json.dumps(metadata, sort_keys=True).encode()}
    )
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        pq.write_table(table, tmp)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def model_description(model, source: str | None) -> str:
    config = getattr(model, "config", None)
    name = getattr(config, "_name_or_path", "") or ""
    return source or name or type(model).__name__


# ----------------------------------------------------------------------------------------------- the run


@dataclass
class ScanResult:
    """Where a scan wrote, and how much."""

    out: Path
    inputs: int
    chunks_written: int
    chunks_skipped: int

    def to_frame(self):
        """The whole scan as one pandas DataFrame (reads every part)."""
        import pandas as pd

        parts = sorted(self.out.glob("part-*.parquet"))
        return pd.concat([pd.read_parquet(p) for p in parts], ignore_index=True)


def _processes(layout=None):
    """The processes this scan runs in (``probe/analyses/processes.py``): a sharded model's mesh, accelerate's view
    of the processes of a launch, or this one process."""
    from .processes import AccelerateProcesses, OneProcess, ShardedProcesses

    if layout is not None and layout.world > 1:
        return ShardedProcesses(layout)
    launched = int(os.environ.get("WORLD_SIZE", "1")) > 1
    try:
        from accelerate import PartialState
    except ImportError as exc:
        if launched:
            raise ScanError(
                "this scan runs in several processes: that needs accelerate (pip install accelerate)"
            ) from exc
        return OneProcess()
    return AccelerateProcesses(PartialState(cpu=not torch.cuda.is_available()))


def run_scan(
    capture: Callable,
    model,
    data,
    out,
    *,
    tokenizer=None,
    field: str | None = None,
    batch_size: int = 16,
    max_length: int | None = None,
    layers=None,
    heads=None,
    modules=None,
    limit: int | None = None,
    resume: bool = False,
    chunk_size: int = 256,
    progress: bool = True,
    source: str | None = None,
    block_bytes: int | None = None,
    layout=None,
) -> ScanResult:
    """See ``attnprobe.scan``. ``layout``: the ``probe.shards.ShardLayout`` of a model split across processes."""
    _check_sizes(tokenizer, batch_size=batch_size, chunk_size=chunk_size, max_length=max_length)
    texts = scan_texts(model, data, field=field, limit=limit, max_length=max_length)
    out = Path(out)
    plan = Plan(len(texts), chunk_size)
    config = {  # what the folder holds: a resumed scan must be this one
        "format": FORMAT,
        "model": model_description(model, source),
        "data": str(data) if isinstance(data, (str, os.PathLike)) else f"{len(texts)} texts given in Python",
        "field": field,
        "inputs": len(texts),
        "chunk_size": chunk_size,
        "max_length": max_length,
        "layers": None if layers is None else list(layers),
        "heads": _jsonable(heads),
        "modules": modules_json(modules, model),
    }
    processes = _processes(layout)
    processes.agree(config)
    opened = not out.exists()
    _open_folder(out, config, resume=resume, processes=processes)
    todo = [c for c in range(plan.chunks) if not (resume and (out / part_name(c)).exists())]
    mine = processes.share(todo)
    options: dict = {"layers": layers, "heads": heads, "modules": modules}
    if block_bytes is not None:
        options["block_bytes"] = block_bytes
    run = _BatchRun(capture, model, tokenizer, texts, batch_size=batch_size, max_length=max_length, options=options)
    bar = _progress_bar(sum(len(plan.span(c)) for c in mine), processes, progress=progress)
    was_training = model.training
    model.eval()
    try:
        for chunk in mine:
            span = plan.span(chunk)
            columns = _scan_span(run, span, processes=processes, bar=bar)
            if processes.writes:
                where = {"chunk": chunk, "first_input": span.start, "last_input": span.stop - 1}
                metadata = {**config, **where, "process": processes.index, **processes.describe()}
                write_part(out / part_name(chunk), columns, metadata)
        # a model sharded by FSDP gathers its parameters from every process: all run as many forwards
        for _ in range(
            processes.idle_batches(lambda share: sum(math.ceil(len(plan.span(c)) / batch_size) for c in share))
        ):
            run.rows(list(range(min(batch_size, len(texts)))))
    except BaseException:
        if processes.main and opened:
            _remove_unwritten(out)
        raise
    finally:
        bar.close()
        model.train(was_training)
    processes.wait()
    if processes.main:
        _write_manifest(out, plan, config)
    return ScanResult(out=out, inputs=len(texts), chunks_written=len(mine), chunks_skipped=plan.chunks - len(todo))


def _remove_unwritten(out: Path) -> None:
    """The folder a failed scan made, removed when it holds only the scan's ``_scan.json`` (the first forward failed,
    e.g. on a model with no attention found): the same command with the option it lacked (``--modules``) then runs
    where it was asked to, instead of finding "another scan" there."""
    if sorted(p.name for p in out.iterdir()) == [CONFIG]:
        (out / CONFIG).unlink()
        out.rmdir()


def _check_sizes(tokenizer, *, batch_size: int, chunk_size: int, max_length: int | None) -> None:
    """A tokenizer, and positive whole numbers for the sizes (an error naming the one that is not)."""
    if tokenizer is None:
        raise ScanError("a scan reads texts: give the model's tokenizer (tokenizer=)")
    for name, value in (("batch_size", batch_size), ("chunk_size", chunk_size)):
        if not isinstance(value, int) or value < 1:
            raise ScanError(f"{name} must be a positive whole number, not {value!r}")
    if max_length is not None and (not isinstance(max_length, int) or max_length < 1):
        raise ScanError(f"max_length must be a positive whole number, not {max_length!r}")


def _progress_bar(inputs: int, processes, *, progress: bool):
    """A tqdm bar over this process's inputs (named by its process index when there are several)."""
    from tqdm.auto import tqdm

    name = f"scan [{processes.index}]" if processes.count > 1 else "scan"
    return tqdm(total=inputs, unit="input", disable=not progress, desc=name)


def _tokenizer_options(max_length: int | None) -> dict:
    return {"padding": True, "truncation": max_length is not None, "max_length": max_length}


def _open_folder(out: Path, config: dict, *, resume: bool, processes) -> None:
    """The main process checks and creates the folder first; the others check it once it is there (checking at
    the same time, they could see the main process's config half-written and call the folder foreign)."""
    if processes.main:
        prepare_folder(out, config, resume=resume, main=True)
    processes.wait()
    if not processes.main:
        prepare_folder(out, config, resume=resume, main=False)


def model_device(model) -> torch.device:
    """Where the model's (materialized) parameters are: the device inputs go to."""
    return next((p.device for p in model.parameters() if p.device.type != "meta"), torch.device("cpu"))


def scan_batch(
    capture: Callable,
    model,
    tokenizer,
    texts: Sequence[str],
    indexes: Sequence[int],
    *,
    max_length: int | None = None,
    options: dict | None = None,
    device: torch.device | None = None,
) -> dict[str, list]:
    """The scan rows of ``texts`` (input numbers ``indexes``): one padded forward of ``model`` under
    ``capture(model, keep=("stats",), **options)``, aggregated by ``aggregate``. ``attnprobe.scan`` runs it batch
    after batch; the Ray Data engine (``hooks/ray_scan.py``) inside its actors."""
    from ..commandline.loading import Workload, fit_forward

    batch = tokenizer(list(texts), **_tokenizer_options(max_length), return_tensors="pt")
    if len(texts) > 1 and _padding_cannot_reach(model, batch):  # one unpadded forward per input instead
        rows = [
            scan_batch(capture, model, tokenizer, [t], [i], max_length=max_length, options=options, device=device)
            for t, i in zip(texts, indexes)
        ]
        return {name: [v for row in rows for v in row[name]] for name in rows[0]}
    device = model_device(model) if device is None else device
    batch = {k: v.to(device) for k, v in batch.items()}
    counts = (
        batch["attention_mask"].sum(-1).tolist()
        if "attention_mask" in batch
        else [batch["input_ids"].shape[-1]] * len(texts)
    )
    # fed as the command line feeds a model: the ids by the name its forward gives them (nanoGPT's forward(idx,
    # targets=None): idx=), or as its one argument (forward(ids, /)); token types and an unpadded mask it does not
    # take are left out
    work = Workload(model=model, source=type(model).__name__, tokenizer=tokenizer, inputs=dict(batch))
    fit_forward(work)
    with torch.no_grad(), capture(model, keep=("stats",), **(options or {})) as cap:
        work.forward()
    return aggregate(cap, indexes, counts)


def _padding_cannot_reach(model, batch) -> bool:
    """Whether ``batch`` is padded and ``model.forward`` takes no ``attention_mask`` (nor ``**kwargs``) to be told."""
    import inspect

    mask = batch.get("attention_mask")
    if mask is None or bool(mask.all()):
        return False
    params = inspect.signature(model.forward).parameters
    return "attention_mask" not in params and not any(p.kind is p.VAR_KEYWORD for p in params.values())


@dataclass
class _BatchRun:
    """What every batch of one scan shares: the model, its tokenizer, the texts and the capture's options."""

    capture: Callable
    model: object
    tokenizer: object
    texts: Sequence[str]
    batch_size: int
    max_length: int | None
    options: dict

    def __post_init__(self) -> None:
        self.device = model_device(self.model)

    def rows(self, index: list[int]) -> dict[str, list]:
        texts = [self.texts[i] for i in index]
        return scan_batch(
            self.capture,
            self.model,
            self.tokenizer,
            texts,
            index,
            max_length=self.max_length,
            options=self.options,
            device=self.device,
        )


def _scan_span(run: _BatchRun, span: range, *, processes, bar) -> dict[str, list]:
    """The rows of one chunk: its inputs a batch at a time, each batch run under a statistics capture (the rows of a
    sharded model's processes joined on the process that writes them; None elsewhere)."""
    columns: dict[str, list] = {}
    for start in range(span.start, span.stop, run.batch_size):
        index = list(range(start, min(span.stop, start + run.batch_size)))
        rows = processes.combine(run.rows(index))
        for name, values in (rows or {}).items():
            columns.setdefault(name, []).extend(values)
        bar.update(len(index))
    return columns


def _write_manifest(out: Path, plan: Plan, config: dict) -> None:
    """The folder's manifest: the scan, its parts, and whether every chunk was written."""
    parts = sorted(p.name for p in out.glob("part-*.parquet"))
    missing = [part_name(c) for c in range(plan.chunks) if part_name(c) not in parts]
    manifest = {**config, "parts": parts, "complete": not missing, "missing": missing}
    _write_text(out / MANIFEST, json.dumps(manifest, indent=2, sort_keys=True))


def modules_json(modules, model=None):
    """``modules=`` as ``_scan.json`` records it: None, ``"auto"`` or the list of names (a module given as an object
    by its name in ``model``, else by its class)."""
    if modules is None or isinstance(modules, str):
        return modules
    names = {id(m): n for n, m in model.named_modules()} if isinstance(model, torch.nn.Module) else {}
    return [m if isinstance(m, str) else names.get(id(m), type(m).__name__) for m in modules]


def _jsonable(heads):
    if heads is None:
        return None
    if isinstance(heads, dict):
        return {str(k): list(v) for k, v in heads.items()}
    return list(heads)
