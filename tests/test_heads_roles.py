"""The long-context head roles (retrieval, streaming, local, sink) on a model whose heads are planted by hand: each
planted head gets its label, and no other head gets any of them."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

import attnprobe
from attnprobe.probe.analyses.head_roles import (
    ROLE_THRESHOLDS,
    RoleError,
    retrieval_scores,
    role_scores,
)
from attnprobe.probe.engine.kept_mass import EvictionPlan

P, V = 192, 40  # positions, vocabulary
D = P + 2 * V  # residual: [position one-hot | token one-hot | previous token one-hot]
TOK, PREV = P, P + V
SEP, BOS = 0, 1  # special tokens
L = 12.0  # a logit this large (after the 1/sqrt(d_head) scaling) takes (almost) all the weight
C = L * math.sqrt(P)


class Planted(nn.Module):
    """Two causal layers of attnprobe's MultiHeadAttention (d_head = P) with weights set by hand; every output
    projection is zero, so each layer reads the input embedding.

    layer 0: head 0 sink (the [SEP] tokens), head 1 local (uniform over the keys 2 to 8 positions back), head 2
             streaming (0.4 of the weight on key 0, 0.6 over the 8 most recent keys), head 3 retrieval (the key after
             an earlier occurrence of the query's token: it copies);
    layer 1: heads 0 and 2 attend position 5, head 1 attends position 9, head 3 attends every key alike (broad).
    """

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(
            attnprobe.MultiHeadAttention(D, num_heads=4, d_head=P, causal=True) for _ in range(2)
        )
        with torch.no_grad():
            for layer in self.layers:
                for p in layer.parameters():
                    p.zero_()
            q, k = self.layers[0].q_proj, self.layers[0].k_proj
            for j in range(P):
                for h in (1, 2):
                    k.weight[h * P + j, j] = 1.0  # heads 1, 2: keys say their position
            q.bias[0 * P] = C  # head 0: every query matches the [SEP] keys
            k.weight[0 * P, TOK + SEP] = 1.0
            for i in range(P):
                for j in range(max(0, i - 8), i - 1):  # head 1: keys 2 .. 8 back
                    q.weight[1 * P + j, i] = C
                for j in range(max(0, i - 7), i + 1):  # head 2: the 8 most recent keys
                    q.weight[2 * P + j, i] = C
            q.bias[2 * P + 0] = C + math.log(0.4 / (0.6 / 8)) * math.sqrt(P)  # head 2: key 0 gets 0.4 of the weight
            for t in range(V):  # head 3: the query's token against each key's previous token
                q.weight[3 * P + t, TOK + t] = C
                k.weight[3 * P + t, PREV + t] = 1.0
            q, k = self.layers[1].q_proj, self.layers[1].k_proj
            for h, position in ((0, 5), (1, 9), (2, 5)):
                q.bias[h * P] = C
                k.weight[h * P, position] = 1.0

    def forward(self, ids):
        B, T = ids.shape
        prev = torch.cat([torch.full((B, 1), -1), ids[:, :-1]], 1)
        x = torch.cat(
            [
                torch.eye(P)[:T].expand(B, T, P),
                nn.functional.one_hot(ids, V).float(),
                nn.functional.one_hot(prev.clamp(min=0), V).float() * (prev >= 0)[..., None],
            ],
            dim=-1,
        )
        for layer in self.layers:
            x = x + layer(x)
        return x


PLANTED = {(0, 0): "sink", (0, 1): "local", (0, 2): "streaming", (0, 3): "retrieval"}


def inputs(batch=2, length=P, seed=3):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(2, V, (batch, length), generator=g)
    ids[:, 0] = BOS
    ids[:, 1::24] = SEP  # [SEP] every 24 tokens, from position 1
    return ids


def test_the_same_scores_from_a_statistics_capture_as_from_the_weights():
    model = Planted().eval()
    ids = inputs()
    with torch.no_grad(), attnprobe.capture(model, keep=("weights",)) as full:
        model(ids)
    with torch.no_grad(), attnprobe.capture(model, keep=("stats",)) as stats:
        model(ids)
    weights_rows = role_scores(full, special=ids == SEP, budget=16, plan=EvictionPlan(observe=32))
    from_weights = {(r["layer"], r["head"]): r for r in weights_rows}
    # from the weights the streaming score too: all kept by the planted streaming head, little by the uniform one
    assert from_weights[(0, 2)]["streaming_kept"] > 0.99 and from_weights[(1, 3)]["streaming_kept"] < 0.3
    assert from_weights[(0, 1)]["local_share"] > 0.95 and from_weights[(0, 0)]["sink_mass"] > 0.95
    for row in role_scores(stats, special=ids == SEP):
        want = from_weights[(row["layer"], row["head"])]
        assert row["local_share"] == pytest.approx(want["local_share"], abs=1e-9)
        assert row["sink_mass"] == pytest.approx(want["sink_mass"], abs=1e-5)
        assert "streaming_kept" not in row  # a statistics capture without eviction= cannot say


def test_bad_arguments_say_what_to_do():
    model = Planted().eval()
    with pytest.raises(RoleError, match="give vocab_size="):
        retrieval_scores(attnprobe.capture, model)
    with pytest.raises(RoleError, match="needle >= 2"):
        retrieval_scores(attnprobe.capture, model, vocab_size=V, needle=1)
    with pytest.raises(RoleError, match="at least 2 positions back"):
        role_scores([], local=1)


def test_classify_labels_the_planted_roles_from_a_statistics_capture():
    model = Planted().eval()
    ids = inputs()
    plan = attnprobe.EvictionPlan(budgets=(16,), observe=32)
    with torch.no_grad(), attnprobe.capture(model, keep=("stats",), eviction=plan) as cap:
        model(ids)
    special = (ids == SEP) | (ids == BOS)
    table = attnprobe.heads.classify(
        cap, model=model, probe="retrieval", vocab_size=V, special=special, probe_length=150
    )
    got = {(r.layer, r.head): r.labels for r in table.itertuples()}
    # the uniform head of layer 1 is broad (a label of its own), and no role
    assert got == {key: PLANTED.get(key, "broad" if key == (1, 3) else "") for key in got}, table.to_string()
    assert set(ROLE_THRESHOLDS) <= set(table.attrs["thresholds"])
    # without the probe, the special tokens or an eviction plan, those roles are not scored: no label for them
    bare = attnprobe.heads.classify(cap)
    assert {"retrieval", "sink_mass"}.isdisjoint(bare.columns)
    assert dict(zip(zip(bare.layer, bare["head"]), bare.labels))[(0, 1)] == "local"
