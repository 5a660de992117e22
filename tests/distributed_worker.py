"""Run by tests/test_distributed.py under ``torchrun --nproc_per_node 2`` (gloo, CPU): one sharding mode, every model.

    torchrun --nproc_per_node 2 tests/distributed_worker.py MODE MODELS_FOLDER OUT_FOLDER

MODE is ``tp``, ``pp`` or ``fsdp`` (``DistributedConfig(<mode>_size=2)``). For every model folder in MODELS_FOLDER
(saved by the test, with a tokenizer), each rank compares what a capture of the sharded model records with a
one-process capture of the same weights, and writes what it found to OUT_FOLDER/<mode>-rank<r>.json: a list of
problems (empty when everything holds) and the figures the test reports. Nothing is asserted here: the test reads the
files, so a failure names every problem of every rank at once.
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from pathlib import Path

import torch
import torch.distributed as dist
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.distributed import DistributedConfig

import attnprobe
from attnprobe.probe.capture import select_record_heads
from attnprobe.probe.shards import join

MODE = sys.argv[1] if len(sys.argv) > 1 else "tp"
KEEP = ("q", "k", "v", "weights", "output")
TEXTS = [f"the cat {'sat ' * (i % 4)}on mat {i}" for i in range(10)]


class Findings:
    def __init__(self) -> None:
        self.problems: list[str] = []
        self.figures: dict[str, float] = {}

    def expect(self, ok: bool, message: str) -> None:
        if not ok:
            self.problems.append(message)

    def same(self, where: str, got, want, *, bitwise: bool, tol: float = 1e-6) -> None:
        """Tensors equal: bitwise, or within ``tol`` (the all-reduce order of later layers)."""
        if got is None or want is None:
            self.expect(got is None and want is None, f"{where}: one side is None")
            return
        if got.shape != want.shape:
            self.problems.append(f"{where}: shape {tuple(got.shape)} != {tuple(want.shape)}")
            return
        diff = (got.double() - want.double()).abs().max().item() if got.numel() else 0.0
        key = "max_diff_layer0" if bitwise or tol < 1e-6 else "max_diff_later"
        self.figures[key] = max(self.figures.get(key, 0.0), diff)
        if bitwise:
            self.expect(torch.equal(got, want), f"{where}: not bitwise equal (max diff {diff:.3g})")
        else:
            self.expect(diff <= tol, f"{where}: max diff {diff:.3g} > {tol}")


def run(model, inputs, **options):
    with torch.no_grad(), attnprobe.capture(model, **options) as cap:
        model(**inputs)
    return cap


def exact(rec, name: str) -> dict:
    """How close a tensor must be: bitwise at layer 0 (what one process computes, heads relabelled), except k, v,
    weights and output of a grouped-query model split by tensor parallelism, within 1e-7 there: its key/value
    projection becomes a narrower matrix product on each process, which rounds differently (the model's own
    arithmetic, before attention); within 1e-6 after layer 0 (the all-reduce order)."""
    if rec.layer != 0:
        return {"bitwise": False}
    if name != "q" and rec.num_kv_heads != rec.num_heads and MODE == "tp":
        return {"bitwise": False, "tol": 1e-7}
    return {"bitwise": True}


def compare_records(found: Findings, what: str, records, reference) -> None:
    """Every record equals the reference record of its layer, restricted to the heads it says it holds."""
    for rec in records:
        ref = reference.record(rec.layer)
        where = f"{what} layer {rec.layer} heads {rec.heads}"
        found.expect(rec.name == ref.name, f"{where}: module {rec.name!r}, reference {ref.name!r}")
        found.expect(
            (rec.num_heads, rec.num_kv_heads) == (ref.num_heads, ref.num_kv_heads),
            f"{where}: head counts {(rec.num_heads, rec.num_kv_heads)}, model {(ref.num_heads, ref.num_kv_heads)}",
        )
        part = select_record_heads(ref, rec.heads)
        found.expect(rec.kv_heads == part.kv_heads, f"{where}: kv heads {rec.kv_heads}, expected {part.kv_heads}")
        for name in KEEP:
            found.same(f"{where} {name}", getattr(rec, name), getattr(part, name), **exact(rec, name))


def check_cover(found: Findings, mode: str, label: str, shards, reference) -> None:
    """Rank 0: the heads of every layer, over all ranks, are disjoint and cover the model's; layers likewise."""
    layers = {}
    for rank_records in shards:
        for layer, name, heads, kv in rank_records:
            layers.setdefault(layer, []).append((name, heads, kv))
    found.expect(
        sorted(layers) == list(reference.layers), f"{label}: layers {sorted(layers)}, model {list(reference.layers)}"
    )
    for layer, parts in layers.items():
        heads = [h for _, hs, _ in parts for h in hs]
        ref = reference.record(layer)
        found.expect(len(heads) == len(set(heads)), f"{label} layer {layer}: heads held twice {heads}")
        found.expect(sorted(heads) == list(range(ref.num_heads)), f"{label} layer {layer}: heads {sorted(heads)}")
        found.expect(all(n == ref.name for n, _, _ in parts), f"{label} layer {layer}: names {parts}")


def sharded_capture(found: Findings, mode: str, label: str, model, reference, inputs, out: Path) -> None:
    rank = dist.get_rank()
    cap = run(model, inputs, keep=KEEP)
    compare_records(found, f"{label} rank {rank}", cap, reference)
    found.expect(all(r.meta.get("rank") == rank for r in cap), f"{label}: records lack meta['rank'] == {rank}")
    found.expect(
        tuple(cap.info["attention_modules"]) == tuple(reference.info["attention_modules"]),
        f"{label}: info attention_modules {cap.info['attention_modules']}",
    )
    found.expect(
        tuple(cap.info["held_layers"]) == cap.layers, f"{label}: held_layers {cap.info.get('held_layers')} {cap.layers}"
    )
    result = attnprobe.check(cap)
    found.expect(bool(result.ok), f"{label} rank {rank}: check found {[str(v) for v in result.errors][:3]}")
    labels = [(r.layer, r.name, list(r.heads), list(r.kv_heads)) for r in cap]
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, labels)
    if mode == "fsdp":  # data parallel: every process holds the whole model
        compare_whole(found, f"{label} rank {rank}", cap, reference)
        return
    if rank == 0:
        check_cover(found, mode, label, everyone, reference)
    # saved per rank, joined offline
    folder = cap.save(out / f"{label}-rank{rank}", overwrite=True)
    dist.barrier()
    if rank == 0:
        paths = [out / f"{label}-rank{r}" for r in range(dist.get_world_size())]
        joined = join([attnprobe.load(p) for p in paths])
        compare_whole(found, f"{label} joined from disk", joined, reference)
    del folder


def compare_whole(found: Findings, what: str, cap, reference) -> None:
    found.expect(cap.layers == reference.layers, f"{what}: layers {cap.layers} != {reference.layers}")
    for rec in cap:
        ref = reference.record(rec.layer)
        found.expect(rec.heads == ref.heads, f"{what} layer {rec.layer}: heads {rec.heads} != {ref.heads}")
        found.expect(rec.kv_heads == ref.kv_heads, f"{what} layer {rec.layer}: kv {rec.kv_heads} != {ref.kv_heads}")
        for name in KEEP:
            found.same(f"{what} layer {rec.layer} {name}", getattr(rec, name), getattr(ref, name), **exact(rec, name))


def gathered(found: Findings, label: str, model, reference, inputs) -> None:
    cap = run(model, inputs, keep=KEEP, gather=True)
    compare_whole(found, f"{label} gather=True rank {dist.get_rank()}", cap, reference)
    result = attnprobe.check(cap)
    found.expect(bool(result.ok), f"{label} gathered: check found {[str(v) for v in result.errors][:3]}")
    frame, ref_frame = cap.to_frame(), reference.to_frame()
    cols = ["layer", "head", "batch", "query_pos", "key_pos"]
    found.expect(frame[cols].equals(ref_frame[cols]), f"{label} gathered: to_frame() labels differ from one process")


def selected_heads(found: Findings, label: str, model, reference, inputs) -> None:
    """heads=[...] names model heads: each rank keeps those it holds."""
    n = reference[0].num_heads
    cap = run(model, inputs, keep=("weights",), heads=[n - 1], layers=[-1])
    last = reference.layers[-1]
    for rec in cap:
        found.expect(rec.heads == (n - 1,) and rec.layer == last, f"{label} heads=[{n - 1}]: got {rec!r}")
        part = select_record_heads(reference.record(last), (n - 1,))
        found.same(f"{label} heads=[{n - 1}] weights", rec.weights, part.weights, bitwise=False)
    counts: list = [None] * dist.get_world_size()
    dist.all_gather_object(counts, len(cap))
    found.expect(sum(counts) >= 1, f"{label} heads=[{n - 1}]: no rank recorded head {n - 1}")


def scanned(found: Findings, label: str, model, tokenizer, out: Path) -> None:
    """The sharded scan's folder; the test compares it with a one-process scan (outside torchrun's processes)."""
    start = time.perf_counter()
    attnprobe.scan(model, TEXTS, out / f"scan-{label}", tokenizer=tokenizer, batch_size=4, chunk_size=4, progress=False)
    found.figures["scan_seconds"] = found.figures.get("scan_seconds", 0.0) + time.perf_counter() - start


def main() -> None:
    mode, models, out = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    dist.init_process_group("gloo")
    found = Findings()
    for folder in sorted(p for p in models.iterdir() if p.is_dir()):
        label = f"{mode}-{folder.name}"
        tokenizer = AutoTokenizer.from_pretrained(folder)
        one = AutoModelForCausalLM.from_pretrained(folder).eval()
        config = DistributedConfig(**{f"{mode}_size": 2})
        model = AutoModelForCausalLM.from_pretrained(folder, distributed_config=config).eval()
        inputs = dict(tokenizer(TEXTS[:3], padding=True, return_tensors="pt"))
        reference = run(one, inputs, keep=KEEP)
        steps = (
            (sharded_capture, (found, mode, label, model, reference, inputs, out)),
            (gathered, (found, label, model, reference, inputs)),
            (selected_heads, (found, label, model, reference, inputs)),
            (scanned, (found, label, model, tokenizer, out)),
        )
        for step, args in steps:
            print(f"rank {dist.get_rank()} {label}: {step.__name__}", file=sys.stderr, flush=True)
            try:
                step(*args)
            except Exception as e:  # a step that raises is a problem to report, and the others still run
                found.problems.append(f"{label}: {type(e).__name__}: {e}")
                traceback.print_exc()
                dist.barrier()
    report = {"problems": found.problems, "figures": found.figures}
    (out / f"{mode}-rank{dist.get_rank()}.json").write_text(json.dumps(report, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
