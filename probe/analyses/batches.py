"""One padded batch of a scan: tokenize, run under a statistics capture, aggregate to one row per input, layer and
head. ``attnprobe.scan`` runs it batch after batch; the Ray Data engine runs it inside actors."""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from .scan import aggregate


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
    ``capture(model, keep=("stats",), **options)``, aggregated by ``scan.aggregate``."""
    batch = tokenizer(
        list(texts),
        padding=True,
        truncation=max_length is not None,
        max_length=max_length,
        return_tensors="pt",
    )
    device = model_device(model) if device is None else device
    batch = {k: v.to(device) for k, v in batch.items()}
    counts = (
        batch["attention_mask"].sum(-1).tolist()
        if "attention_mask" in batch
        else [batch["input_ids"].shape[-1]] * len(texts)
    )
    with torch.no_grad(), capture(model, keep=("stats",), **(options or {})) as cap:
        model(**batch)
    return aggregate(cap, indexes, counts)
