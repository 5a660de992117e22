"""Scans on a Ray cluster: a callable for ``ray.data.Dataset.map_batches``, and the engine of ``scan(engine="ray")``.

``ScanBatches`` is a class Ray Data instantiates once per actor (the model is loaded there, once) and calls on every
batch of texts: it returns the rows ``attnprobe.scan`` writes, column for column (``probe/analyses/scan.py``), so
the Parquet files a Ray pipeline writes read like a scan folder's (pandas, DuckDB, ``attnprobe.heads.classify``)::

    import ray
    from attnprobe import ScanBatches

    ds = ray.data.read_parquet("texts/")                      # a "text" column, and an "input" column numbering rows
    stats = ds.map_batches(ScanBatches, fn_constructor_kwargs={"model": "./my-model"}, batch_size=16,
                           compute=ray.data.ActorPoolStrategy(size=4), num_gpus=1)
    stats.write_parquet("scan/")

``run_ray_scan`` is ``attnprobe.scan(..., engine="ray")``: the folder of ``attnprobe scan`` (``part-NNNNN.parquet``,
``_scan.json``, ``_manifest.json``, ``resume``), with one Ray task per chunk: an actor runs the chunk's batches exactly
as ``attnprobe scan`` batches them (so the rows are the same) and writes its part file. The folder must be one every
node of the cluster can write (a shared file system), as under ``torchrun``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from ..probe.analyses.scan import (
    FORMAT,
    MANIFEST,
    CutTexts,
    Plan,
    ScanError,
    ScanResult,
    input_chars,
    model_description,
    modules_json,
    part_name,
    prepare_folder,
    read_inputs,
    scan_batch,
    write_part,
)
from ..probe.reading import CONFIG_LIMIT, read_regular


def _ray():
    try:
        import ray
        import ray.data
    except ImportError:
        raise ScanError(
            "the Ray engine needs Ray Data: pip install 'attnprobe[ray]' (or scan without engine='ray')"
        ) from None
    return ray


def _load(model, tokenizer):
    """(model, tokenizer) from what ``ScanBatches`` was given: a model folder or factory for attnprobe's loader, a
    zero-argument function returning both, or the objects themselves."""
    if isinstance(model, (str, os.PathLike)):
        from ..probe.commandline.loading import load_model

        model, loaded, _ = load_model(str(model))
        tokenizer = tokenizer if tokenizer is not None else loaded
    elif callable(model) and not hasattr(model, "parameters"):
        model, loaded = model()
        tokenizer = tokenizer if tokenizer is not None else loaded
    if tokenizer is None:
        raise ScanError("ScanBatches reads texts: give the model's tokenizer (tokenizer=), or a model folder with one")
    return model.eval(), tokenizer


class ScanBatches:
    """Per-head attention statistics of a batch of texts, for ``ray.data.Dataset.map_batches``.

    ``model``: a model folder (or ``module:function`` factory) as the ``attnprobe`` command takes it, a
    zero-argument function returning ``(model, tokenizer)``, or a model object (Ray copies it to every actor).
    ``tokenizer``: when ``model`` does not bring one. ``text`` / ``index``: the batch's column of texts and of input
    numbers (written to the ``input`` column). ``max_length``, ``layers``, ``heads``, ``modules``, ``block_bytes``: as
    ``attnprobe.scan``'s. ``device``: where the actor runs the model (default: ``cuda`` when the actor has a GPU).

    Pass the class, not an instance, so Ray builds one per actor and the model is loaded once there:
    ``ds.map_batches(ScanBatches, fn_constructor_kwargs={"model": path}, batch_size=16, num_gpus=1,
    compute=ray.data.ActorPoolStrategy(size=2))`` (``concurrency=2`` in Ray releases before 2.51).
    Each batch runs as one padded forward: give ``batch_size`` as for ``attnprobe.scan``.
    """

    def __init__(
        self,
        model,
        tokenizer=None,
        *,
        text: str = "text",
        index: str = "input",
        max_length: int | None = None,
        layers=None,
        heads=None,
        modules=None,
        block_bytes: int | None = None,
        device=None,
    ) -> None:
        import torch

        from .api import capture

        self.model, self.tokenizer = _load(model, tokenizer)
        if device is None and torch.cuda.is_available():
            device = "cuda"
        if device is not None:
            self.model = self.model.to(device)
        self.text, self.index, self.max_length = text, index, max_length
        self.options: dict[str, Any] = {"layers": layers, "heads": heads, "modules": modules}
        if block_bytes is not None:
            self.options["block_bytes"] = block_bytes
        self.capture = capture

    def rows(self, texts, indexes) -> dict[str, list]:
        """The scan rows of one padded batch (columns of Python lists)."""
        return scan_batch(
            self.capture,
            self.model,
            self.tokenizer,
            [str(t) for t in texts],
            [int(i) for i in indexes],
            max_length=self.max_length,
            options=self.options,
        )

    def __call__(self, batch: dict) -> dict:
        import numpy as np

        for column in (self.text, self.index):
            if column not in batch:
                raise ScanError(
                    f"the batch has no column {column!r} (columns: {', '.join(batch)}): ScanBatches reads the texts "
                    "from text= and the input numbers from index= (add one with ds.add_column, or name yours)"
                )
        rows = self.rows(batch[self.text], batch[self.index])
        return {
            name: np.asarray(values, dtype=object if name in ("module", "kind") else None)
            for name, values in rows.items()
        }


class _ChunkWriter(ScanBatches):
    """The engine's actor: one row per chunk (its input numbers and texts), run in the scan's own batches and written
    to the chunk's part file."""

    def __init__(self, model, tokenizer=None, *, out: str, batch_size: int, metadata: dict, **options) -> None:
        super().__init__(model, tokenizer, **options)
        self.out, self.batch_size, self.metadata = Path(out), batch_size, metadata

    def __call__(self, batch: dict) -> dict:
        written = []
        for chunk, indexes, texts in zip(batch["chunk"], batch["input"], batch["text"]):
            columns: dict[str, list] = {}
            for start in range(0, len(indexes), self.batch_size):
                part = self.rows(texts[start : start + self.batch_size], indexes[start : start + self.batch_size])
                for name, values in part.items():
                    columns.setdefault(name, []).extend(values)
            metadata = {
                **self.metadata,
                "chunk": int(chunk),
                "first_input": int(indexes[0]),
                "last_input": int(indexes[-1]),
                "process": os.getpid(),
                "engine": "ray",
            }
            write_part(self.out / part_name(int(chunk)), columns, metadata)
            written.append(int(chunk))
        return {"chunk": written}


def run_ray_scan(
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
    source: str | None = None,
    concurrency: int | None = None,
    num_gpus: float | None = None,
    block_bytes: int | None = None,
    progress: bool = True,
) -> ScanResult:
    """``attnprobe.scan(..., engine="ray")``: the chunks of the scan as Ray tasks on ``concurrency`` actors (each
    with ``num_gpus`` GPUs), on the cluster ``ray.init()`` connects to (a local one when none is running)."""
    for name, value in (("batch_size", batch_size), ("chunk_size", chunk_size)):
        if not isinstance(value, int) or value < 1:
            raise ScanError(f"{name} must be a positive whole number, not {value!r}")
    if modules is not None and not isinstance(modules, str) and not all(isinstance(m, str) for m in modules):
        raise ScanError(
            "engine='ray' takes modules= as names from named_modules() or 'auto': each actor loads its own model, "
            "so module objects of this one cannot name its modules"
        )
    texts = list(data) if not isinstance(data, (str, os.PathLike)) else read_inputs(data, field=field, limit=limit)
    texts = texts[:limit] if limit is not None else texts
    if not texts:
        raise ScanError("no input to scan")
    view = _positions_view(model)
    if view is not None:  # refused, or cut where max_length truncates, as attnprobe.scan does, before any actor starts
        texts = list(CutTexts(texts, input_chars(view, texts, max_length)))
    ray = _ray()
    out = Path(out)
    plan = Plan(len(texts), chunk_size)
    config = _config(model, source, data, texts, field, chunk_size, max_length, layers, heads, modules)
    prepare_folder(out, config, resume=resume, main=True)
    todo = [c for c in range(plan.chunks) if not (resume and (out / part_name(c)).exists())]
    if todo:
        if not ray.is_initialized():
            ray.init(include_dashboard=False, log_to_driver=False)
        options = {"max_length": max_length, "layers": layers, "heads": heads, "modules": modules}
        options["block_bytes"] = block_bytes
        _run_chunks(ray, model, tokenizer, plan, texts, todo, out, config, batch_size, concurrency, num_gpus, progress,
                    options)  # fmt: skip
    parts = sorted(p.name for p in out.glob("part-*.parquet"))
    missing = [part_name(c) for c in range(plan.chunks) if part_name(c) not in parts]
    manifest = {**config, "parts": parts, "complete": not missing, "missing": missing, "engine": "ray"}
    (out / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return ScanResult(out=out, inputs=len(texts), chunks_written=len(todo), chunks_skipped=plan.chunks - len(todo))


def _positions_view(model):
    """What ``input_chars`` reads of the model, here on the driver (the actors load the model): the model itself, or
    the positions its folder's config.json names; None for a factory, whose actors refuse an input longer than its
    positions after tokenizing it."""
    if hasattr(model, "config"):
        return model
    if not isinstance(model, (str, os.PathLike)) or not Path(model).is_dir():
        return None
    try:
        config = json.loads(read_regular(Path(model) / "config.json", what="model file", limit=CONFIG_LIMIT))
    except (OSError, ValueError):
        return None  # the actors' loader says what is wrong with the folder
    if not isinstance(config, dict):
        return None
    return SimpleNamespace(
        config=SimpleNamespace(**{n: config.get(n) for n in ("max_position_embeddings", "n_positions")})
    )


def _config(model, source, data, texts, field, chunk_size, max_length, layers, heads, modules) -> dict:
    """``_scan.json``: the same description ``attnprobe.scan`` writes, so either engine resumes the other's folder."""
    if isinstance(model, (str, os.PathLike)):
        described = source or str(model)
    elif callable(model) and not hasattr(model, "parameters"):
        described = source or getattr(model, "__qualname__", repr(model))
    else:
        described = model_description(model, source)
    return {
        "format": FORMAT,
        "model": described,
        "data": str(data) if isinstance(data, (str, os.PathLike)) else f"{len(texts)} texts given in Python",
        "field": field,
        "inputs": len(texts),
        "chunk_size": chunk_size,
        "max_length": max_length,
        "layers": None if layers is None else list(layers),
        "heads": _heads_json(heads),
        "modules": modules_json(modules),
    }


def _heads_json(heads):
    if heads is None:
        return None
    return {str(k): list(v) for k, v in heads.items()} if isinstance(heads, dict) else list(heads)


def _run_chunks(ray, model, tokenizer, plan, texts, todo, out, config, batch_size, concurrency, num_gpus, progress,
                options) -> None:  # fmt: skip
    rows = [
        {"chunk": c, "input": list(plan.span(c)), "text": [texts[i] for i in plan.span(c)]}
        for c in todo
    ]  # fmt: skip
    ray.data.DataContext.get_current().enable_progress_bars = progress
    dataset = ray.data.from_items(rows, override_num_blocks=len(rows))
    kwargs: dict[str, Any] = {"batch_size": 1, "compute": ray.data.ActorPoolStrategy(size=concurrency or 1)}
    if num_gpus:
        kwargs["num_gpus"] = num_gpus
    written = dataset.map_batches(
        _ChunkWriter,
        fn_constructor_kwargs={
            "model": model,
            "tokenizer": tokenizer,
            "out": str(out),
            "batch_size": batch_size,
            "metadata": config,
            **{k: v for k, v in options.items() if v is not None},
        },
        **kwargs,
    )
    done = sorted(int(row["chunk"]) for row in written.iter_rows())
    if done != sorted(todo):
        raise ScanError(f"the Ray engine wrote chunks {done}, not {sorted(todo)}: see the actors' logs")
