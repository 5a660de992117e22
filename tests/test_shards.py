"""Sharded models, in one process: head shards from every process's head counts, the global layer order of pipeline
stages, whole records joined from the shards of a call, and how a scan splits inputs and orders gathered rows.
The same code under torchrun: tests/test_distributed.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attnprobe
from attnprobe.probe.analyses.processes import sort_rows, split_evenly
from attnprobe.probe.capture import Capture
from attnprobe.probe.shards import (
    GlobalSite,
    HeadShard,
    ShardLayout,
    ShardLayoutError,
    global_layer_order,
    join,
    join_capture_records,
    join_records,
    module_paths,
)


def test_head_shards_from_counts_even_uneven_and_replicated():
    assert HeadShard.from_counts([(2, 1), (2, 1)], 1, (4, 2)) == HeadShard(2, 1, 2, 1, 4, 2)
    uneven = HeadShard.from_counts([(4, 2), (2, 1)], 1, (6, 3))  # 6 heads, 3 kv heads over 2 processes
    assert (uneven.offset, uneven.kv_offset, uneven.num_heads) == (4, 2, 6)
    assert uneven.globals((0, 1)) == (4, 5) and uneven.globals((0,), kv=True) == (2,)
    assert uneven.locals((0, 3, 5)) == (1,)  # model heads 0 and 3 are held by process 0
    whole = HeadShard.from_counts([(4, 2), (4, 2)], 1, (4, 2))  # attention not split: every process holds all
    assert (whole.offset, whole.num_heads) == (0, 4)


def test_head_shards_refuse_counts_that_do_not_add_up():
    with pytest.raises(ShardLayoutError, match=r"add up to 5, not the 4"):
        HeadShard.from_counts([(3, 1), (2, 1)], 0, (4, 2), "layer 0")
    with pytest.raises(ShardLayoutError, match="separates query heads from their key/value heads"):
        HeadShard.from_counts([(3, 1), (1, 1)], 1, (4, 2), "layer 0")


def test_layout_refuses_unnamed_and_unknown_mesh_dimensions():
    class Mesh:
        mesh_dim_names = None
        shape = (2,)

    with pytest.raises(ShardLayoutError, match="unnamed dimensions"):
        ShardLayout.from_mesh(Mesh())
    Mesh.mesh_dim_names, Mesh.shape = ("cp", "tp"), (2, 2)
    Mesh.get_coordinate = lambda self: [0, 0]
    with pytest.raises(ShardLayoutError, match=r"splits along \['cp'\]") as info:
        ShardLayout.from_mesh(Mesh())
    assert info.value.dims == {"cp": 2, "tp": 2}


def test_layout_ranks_along_model_and_data_dimensions():
    layout = ShardLayout(rank=5, world=8, sizes={"pp": 2, "fsdp": 2, "tp": 2}, coords={"pp": 1, "fsdp": 0, "tp": 1})
    assert (layout.tp_size, layout.tp_rank, layout.pp_rank, layout.dp_size, layout.dp_rank) == (2, 1, 1, 2, 0)
    assert (layout.shard_rank, layout.shard_size, layout.sharded) == (3, 4, True)
    assert layout.rank_meta() == {"rank": 5, "tp_rank": 1, "pp_rank": 1, "dp_rank": 0}


def _gqa_capture(keep=("q", "k", "v", "weights", "output", "stats"), rows=None):
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(hidden_size=48, intermediate_size=64, num_hidden_layers=2, num_attention_heads=6,
                         num_key_value_heads=3, vocab_size=50)  # fmt: skip
    model = LlamaModel(config).eval()
    ids = torch.randint(0, 50, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, :2] = 0
    _, cap = attnprobe.run(model, {"input_ids": ids, "attention_mask": mask}, keep=keep, rows=rows)
    return cap


def test_join_of_uneven_head_shards_is_the_whole_record():
    cap = _gqa_capture()
    shards = [cap.select(heads=[4, 5]), cap.select(heads=[0, 1, 2, 3])]  # 4 + 2 heads, given out of order
    whole = join(shards)
    assert len(whole) == len(cap) and whole.info["joined"] == 2
    for got, want in zip(whole, cap):
        assert got.heads == want.heads and got.kv_heads == want.kv_heads
        for name in ("q", "k", "v", "weights", "output"):
            assert torch.equal(getattr(got, name), getattr(want, name)), name
        for n in want.stats:  # NaN where a statistic is undefined (previous_mass of the first row)
            torch.testing.assert_close(got.stats[n], want.stats[n], rtol=0, atol=0, equal_nan=True)
    assert attnprobe.check(whole).ok


def test_join_keeps_each_run_of_selected_rows_apart():
    cap = _gqa_capture(keep=("weights",), rows=[1, 2, 5])  # two runs per call: rows 1-2 and row 5
    assert [r.query_offset for r in cap] == [1, 5, 1, 5]
    whole = join([cap.select(heads=[3, 4, 5]), cap.select(heads=[0, 1, 2])])
    assert [(r.layer, r.query_offset, r.heads) for r in whole] == [(r.layer, r.query_offset, r.heads) for r in cap]
    for got, want in zip(whole, cap):
        assert torch.equal(got.weights, want.weights)


def test_join_keeps_a_key_value_head_shared_by_two_shards_once():
    cap = _gqa_capture(keep=("k", "weights"))
    whole = join([cap.select(heads=[0]), cap.select(heads=[1, 2])])  # heads 0 and 1 read kv head 0
    assert whole[0].kv_heads == (0, 1)
    assert torch.equal(whole[0].k, cap.select(heads=[0, 1, 2])[0].k)


def test_join_refuses_heads_held_twice():
    cap = _gqa_capture(keep=("weights",))
    with pytest.raises(ShardLayoutError, match="some twice"):
        join_records([cap.select(heads=[0, 1])[0], cap.select(heads=[1, 2])[0]])


def test_join_of_pipeline_stages_puts_the_layers_side_by_side():
    cap = _gqa_capture(keep=("weights",))
    stages = [[cap[0]], [cap[1]]]
    records = join_capture_records(stages)
    assert [r.layer for r in records] == [0, 1]
    assert join([Capture(s, cap.info) for s in stages]).layers == (0, 1)


class _Identity(nn.Identity):
    pass


def test_global_layer_order_from_every_stage():
    """Two pipeline stages of one model: each holds one layer, the other replaced by an identity module in its place."""
    stage0 = nn.Sequential(nn.Sequential(nn.Linear(2, 2), attnprobe.MultiHeadAttention(4, num_heads=2)), _Identity())
    stage1 = nn.Sequential(_Identity(), nn.Sequential(nn.Linear(2, 2), attnprobe.MultiHeadAttention(4, num_heads=2)))
    paths0, paths1 = module_paths(stage0), module_paths(stage1)
    local0 = [GlobalSite(paths0[id(stage0[0][1])], "0.1", 2, 2)]
    local1 = [GlobalSite(paths1[id(stage1[1][1])], "1.1", 2, 2)]

    def gather(value, group):  # what every stage sends, in stage order
        return [local0, local1]

    order = global_layer_order(stage1, local1, gather=gather)
    assert [g.name for g in order] == ["0.1", "1.1"]
    assert global_layer_order(stage1, local1, gather=None) is order  # cached: no second all-gather

    def clash(value, group):
        return [local0, [GlobalSite(local0[0].path, "other", 2, 2)]]

    with pytest.raises(ShardLayoutError, match="do not share one module tree"):
        global_layer_order(stage0, local0, gather=clash)


def test_scan_splits_inputs_and_orders_gathered_rows():
    assert split_evenly(list(range(5)), 2) == [[0, 1, 2], [3, 4]]
    assert split_evenly([0], 2) == [[0], []]
    rows = {"call": [0, 0, 0, 0], "layer": [1, 0, 0, 1], "input": [0, 1, 0, 0], "head": [0, 2, 3, 1], "x": [1, 2, 3, 4]}
    assert sort_rows(rows)["x"] == [3, 2, 1, 4]
