"""Bad capture requests fail early with attnprobe's own errors, saying what was wrong and what to do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import attnprobe
from attnprobe import MultiHeadAttention, SelectionError, UnsupportedModelError


@pytest.fixture
def model():
    return nn.Sequential(*[MultiHeadAttention(8, num_heads=2) for _ in range(3)]).eval()


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_storage_without_cuda(model, assert_no_hooks):
    with pytest.raises(SelectionError, match=r"device='cuda'.*CUDA is not available.*device=None or 'cpu'"):
        attnprobe.capture(model, device="cuda")
    with pytest.raises(SelectionError, match="cuda:1"):
        attnprobe.run(model, torch.randn(1, 3, 8), device="cuda:1")
    assert_no_hooks(model)


@pytest.mark.parametrize(
    "device, match",
    [("meta", "would store no data"), ("banana", "is not a torch device"), (3.5, "is not a torch device")],
)
def test_other_unusable_devices(device, match):
    with pytest.raises(SelectionError, match=match):
        attnprobe.capture(nn.Identity(), device=device)


@pytest.mark.parametrize("keep", [5, 2.0, {"weights": True}, b"weights", object()])
def test_keep_must_be_tensor_names(keep):
    with pytest.raises(SelectionError, match=r"keep must be a tensor name or a list of them.*choose from"):
        attnprobe.capture(nn.Identity(), keep=keep)


def test_keep_accepts_a_name_a_list_a_set_and_nothing(model):
    x = torch.randn(1, 3, 8)
    for keep, kept in (("q", {"q"}), (["q", "k"], {"q", "k"}), ({"weights"}, {"weights"}), ((), set())):
        _, cap = attnprobe.run(model, x, layers=[0], keep=keep)
        present = {f for f in attnprobe.TENSOR_FIELDS if getattr(cap[0], f) is not None}
        assert present == kept, keep
    assert cap[0].allowed is not None  # masks are kept whatever keep says


def test_reentering_an_active_capture_is_refused(model, assert_no_hooks):
    x = torch.randn(1, 3, 8)
    session = attnprobe.capture(model, layers=[0])
    with session as cap:
        with pytest.raises(SelectionError, match=r"already active.*create another one"):
            with session:
                pass
        model(x)
    assert len(cap) == 1  # the outer capture was not disturbed: one record, not two
    assert_no_hooks(model)
    with pytest.raises(SelectionError, match=r"already run.*start a new one"):
        with session:
            pass
    assert_no_hooks(model)


def test_two_captures_of_one_model_may_nest(model, assert_no_hooks):
    x = torch.randn(1, 3, 8)
    with attnprobe.capture(model, layers=[0]) as outer, attnprobe.capture(model, layers=[0]) as inner:
        model(x)
    assert len(outer) == len(inner) == 1 and torch.equal(outer[0].weights, inner[0].weights)
    assert_no_hooks(model)


@pytest.mark.parametrize(
    "options, match",
    [
        (
            {"layers": [-4]},
            r"layer -4 is out of range: the model has 3 attention layer\(s\), numbered 0 to 2, or -1 to -3",
        ),
        ({"layers": [-1, -9]}, "layer -9 is out of range"),
        ({"heads": {5: [0]}}, "layer 5 is out of range"),
        ({"heads": {-4: [0]}}, "layer -4 is out of range"),
        (
            {"layers": [0], "heads": {1: [0]}},
            r"heads=\{\.\.\.\} names layer\(s\) \[1\] that layers=\[0\] does not select",
        ),
        ({"heads": {2: [0], -1: [1]}}, "names layer 2 twice with different heads"),
        ({"heads": {"0": [1]}}, r"keys of heads=\{layer: heads\} must be layer numbers"),
        ({"heads": {(0, 1): [1]}}, r"keys of heads=\{layer: heads\} must be layer numbers"),
        ({"heads": {0: [2]}}, r"head\(s\) \[2\] out of range for layer 0"),
    ],
)
def test_layer_and_head_errors(model, options, match, assert_no_hooks):
    with pytest.raises(SelectionError, match=match):
        with attnprobe.capture(model, **options):
            model(torch.randn(1, 3, 8))
    assert_no_hooks(model)


def test_negative_layers_and_head_dicts_resolve(model):
    x = torch.randn(1, 3, 8)
    _, cap = attnprobe.run(model, x, layers=[-1, 2, 0])
    assert cap.layers == (0, 2) and len(cap) == 2  # -1 and 2 are one layer, stored once
    _, cap = attnprobe.run(model, x, heads={-1: [1], 0: None})
    assert [(r.layer, r.heads) for r in cap] == [(0, (0, 1)), (2, (1,))]
    _, cap = attnprobe.run(model, x, layers=[0, 1], heads={1: [0]})
    assert [(r.layer, r.heads) for r in cap] == [(0, (0, 1)), (1, (0,))]


def test_no_attention_message_says_what_to_do():
    with pytest.raises(UnsupportedModelError) as err:
        attnprobe.capture(nn.Sequential(nn.Linear(4, 4))).__enter__()
    message = str(err.value)
    assert "no attention found in Sequential" in message
    assert "indirectly" in message and "modules='auto'" in message and "modules=[...]" in message


def test_numpy_and_torch_integers_select(model):
    np = pytest.importorskip("numpy")
    x = torch.randn(1, 3, 8)
    _, cap = attnprobe.run(model, x, layers=np.array([0, 2]), heads=torch.tensor([1]))
    assert [(r.layer, r.heads) for r in cap] == [(0, (1,)), (2, (1,))]
    _, cap = attnprobe.run(model, x, layers=np.int64(-1), heads={np.int64(2): [np.int64(0)]})
    assert [(r.layer, r.heads) for r in cap] == [(2, (0,))]
    assert cap[np.int64(0)] is cap[0] and cap.select(layers=np.array([2])).layers == (2,)
    with pytest.raises(SelectionError, match="must be integers"):
        attnprobe.capture(model, heads=[1.0])
    with pytest.raises(SelectionError, match="must be integers"):
        attnprobe.capture(model, layers=torch.tensor([0.5]))
    with pytest.raises(SelectionError, match="must be an int or a list of ints"):
        attnprobe.capture(model, layers=True)


def test_sizes_and_dtypes_by_name(model):
    x = torch.randn(1, 3, 8)
    _, cap = attnprobe.run(model, x, layers=[0], dtype="bfloat16", max_bytes="1MB")
    assert cap[0].weights.dtype == torch.bfloat16 and cap.info["selection"]["max_bytes"] == 10**6
    _, cap = attnprobe.run(model, x, layers=[0], dtype="torch.float16", max_bytes=1e6)
    assert cap[0].weights.dtype == torch.float16 and cap.info["selection"]["max_bytes"] == 10**6
    for bad in (0, -5, 2.5, "lots", True, "0MB"):
        with pytest.raises(SelectionError, match=r"max_bytes must be a positive|cannot read"):
            attnprobe.capture(model, max_bytes=bad)
    with pytest.raises(SelectionError, match="floating torch dtype"):
        attnprobe.capture(model, dtype="int8")


def test_captures_pickle_for_torch_save(model, tmp_path):
    import pickle

    _, cap = attnprobe.run(model, torch.randn(1, 3, 8), layers=[0, 1], heads=[1])
    back = pickle.loads(pickle.dumps(cap))
    assert isinstance(back, attnprobe.Capture) and back.info == cap.info and len(back) == 2
    for a, b in zip(cap, back):
        assert (a.layer, a.heads, a.kind, dict(a.meta)) == (b.layer, b.heads, b.kind, dict(b.meta))
        assert torch.equal(a.weights, b.weights) and torch.equal(a.allowed, b.allowed)
    with pytest.raises(TypeError):
        back.info["model_class"] = "x"  # still read-only after the round trip
    torch.save(cap, tmp_path / "cap.pt")
    loaded = torch.load(tmp_path / "cap.pt", weights_only=False)
    assert torch.equal(loaded[1].q, cap[1].q) and loaded.layers == (0, 1)


def test_select_and_record_count_negative_layers_from_the_end(model):
    _, cap = attnprobe.run(model, torch.randn(1, 3, 8), layers=[0, 2])
    assert cap.select(layers=-1).layers == (2,) and cap.record(-1) is cap[1]
    assert len(cap.select(layers=[-2])) == 0  # layer 1 exists but was not captured
    with pytest.raises(SelectionError, match=r"layer -4 cannot count from the end: the model has 3 attention layer"):
        cap.select(layers=[-4])
    bare = attnprobe.Capture(list(cap))
    with pytest.raises(SelectionError, match="does not know the model's layers"):
        bare.record(-1)


def test_empty_head_lists_are_refused():
    for heads in ([], {0: []}):
        with pytest.raises(SelectionError, match=r"heads=\[\] selects no head.*layers=\[\]"):
            attnprobe.capture(nn.Identity(), heads=heads)


def test_records_made_under_inference_mode_are_ordinary_tensors(model):
    x = torch.randn(1, 3, 8)
    with torch.inference_mode():
        out, cap = attnprobe.run(model, x, layers=[0], heads=[1])
    assert out.is_inference()  # the model's own output is untouched
    rec = cap[0]
    assert not any(getattr(rec, f).is_inference() for f in ("q", "weights", "allowed"))
    rec.q.requires_grad_()  # would raise on an inference tensor
    torch.testing.assert_close(rec.weights, attnprobe.run(model, x, layers=[0], heads=[1])[1][0].weights)
