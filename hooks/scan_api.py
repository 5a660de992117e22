"""``attnprobe.scan``: per-head statistics of a model over a data set, in this process (or every process of a
``torchrun`` / ``accelerate launch``) or on a Ray cluster (``hooks/ray_scan.py``). Apart from ``api.py`` so that the
Ray engine, which runs ``capture`` inside its actors, and the entry point that chooses it do not import each other."""

from __future__ import annotations

from .api import capture


def scan(
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
    engine: str = "torch",
    concurrency: int | None = None,
    num_gpus: float | None = None,
):
    """Per-head statistics of ``model`` over every input of ``data``, written to a Parquet dataset in ``out``.

    ``data``: a ``.txt`` file (one input per line), ``.jsonl`` (``field``, default ``text``), ``.csv`` or
    ``.parquet`` (``field``), a folder saved by ``datasets``' ``save_to_disk``, or a list of texts.
    Inputs are tokenized by ``tokenizer`` in padded batches of ``batch_size`` (truncated to ``max_length``)
    and run under ``capture(keep=("stats",))``: memory stays flat in the number of inputs, and no
    (query x key) tensor is stored. Each input gets one row per (layer, head): the mean of every statistic
    over its real query rows, and the row-level extremes (``entropy_min``, ``max_score_max``, ...).
    ``modules``: hand-written attention to read, as ``capture(modules=...)`` takes it (names from
    ``named_modules()``, the modules themselves, or ``"auto"``); the frame's layers are those they resolve to.
    The token ids go to the model as the command line gives them: by the name its forward gives its first parameter
    (nanoGPT's ``forward(idx, targets=None)`` gets ``idx=``), or as its one argument (``forward(ids, /)``); a forward
    that takes no ``attention_mask`` runs each input of a padded batch alone, so padding never reaches it unmasked.
    ``out/part-NNNNN.parquet`` holds ``chunk_size`` inputs each; ``resume=True`` skips chunks already
    written; a scan that fails before its first chunk is written removes the folder it made. Under
    ``accelerate launch`` / ``torchrun`` each process scans its own chunks; a model split across
    processes (tensor or pipeline parallelism) is fed the same inputs on the processes that hold its parts, and the
    first of them writes the rows of all its heads and layers.
    ``engine="ray"``: the chunks run on a Ray cluster (``pip install 'attnprobe[ray]'``), one task per chunk on
    ``concurrency`` actors with ``num_gpus`` GPUs each, each loading the model once (``model`` may then also be a
    model folder); the folder is the same. Returns a ``ScanResult`` (``.to_frame()`` reads the whole scan).
    """
    if engine == "ray":
        from .ray_scan import run_ray_scan

        options = dict(field=field, batch_size=batch_size, max_length=max_length, layers=layers, heads=heads)
        options.update(modules=modules)
        options.update(limit=limit, resume=resume, chunk_size=chunk_size, progress=progress)
        return run_ray_scan(
            model, data, out, tokenizer=tokenizer, concurrency=concurrency, num_gpus=num_gpus, **options
        )
    from ..probe.analyses.scan import ScanError, run_scan
    from .hf.sharding import shard_layout

    if engine != "torch":
        raise ScanError(f"engine must be 'torch' (this process, or torchrun/accelerate) or 'ray', got {engine!r}")
    if concurrency is not None or num_gpus is not None:
        raise ScanError("concurrency= and num_gpus= place Ray actors: they go with engine='ray'")
    return run_scan(
        capture,
        model,
        data,
        out,
        tokenizer=tokenizer,
        field=field,
        batch_size=batch_size,
        max_length=max_length,
        layers=layers,
        heads=heads,
        modules=modules,
        limit=limit,
        resume=resume,
        chunk_size=chunk_size,
        progress=progress,
        layout=shard_layout(model),
    )
