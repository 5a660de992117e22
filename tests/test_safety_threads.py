"""Threads: a second capture of a model in another thread is refused naming the thread that holds it; a
forward in another thread meanwhile runs untouched and never lands in the capture."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

import attnprobe
from attnprobe import SelectionError


def tiny_bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        hidden_size=16,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=32,
        vocab_size=50,
        max_position_embeddings=32,
    )
    model = BertModel(config, add_pooling_layer=False).eval()
    ids = torch.randint(1, 50, (2, 7))
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[1, 5:] = 0
    return model, {"input_ids": ids, "attention_mask": mask}, 2


class OwnStack(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([attnprobe.MultiHeadAttention(16, num_heads=2, causal=True) for _ in range(2)])

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def own():
    torch.manual_seed(0)
    return OwnStack().eval(), {"x": torch.randn(2, 7, 16)}, 2


def encoder():
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    return model, {"src": torch.randn(2, 7, 16)}, 2


MODELS = {"bert": tiny_bert, "own": own, "encoder": encoder}


def output_of(result):
    return result.last_hidden_state if hasattr(result, "last_hidden_state") else result


def in_thread(fn, name):
    box = {}

    def target():
        try:
            box["value"] = fn()
        except BaseException as exc:
            box["error"] = exc

    t = threading.Thread(target=target, name=name)
    t.start()
    return t, box


@pytest.mark.parametrize("which", list(MODELS))
def test_second_capture_in_another_thread_is_refused_and_its_forward_is_untouched(which, assert_no_hooks):
    model, inputs, layers = MODELS[which]()
    expected = output_of(model(**inputs)).detach()  # grad on: nn.TransformerEncoder takes its plain path
    inside, done = threading.Event(), threading.Event()

    def holder():
        with attnprobe.capture(model) as cap:
            inside.set()
            done.wait(60)
            out = output_of(model(**inputs)).detach()
        return cap, out

    t, box = in_thread(holder, "holder-thread")
    assert inside.wait(60)
    try:
        with pytest.raises(
            SelectionError,
            match=r"already being captured in thread 'holder-thread' \(id \d+\); "
            r"this is thread 'MainThread'",
        ):
            with attnprobe.capture(model):
                pass
        # a plain forward here while the other thread's capture is open: untouched, not recorded there
        for _ in range(3):
            assert torch.equal(output_of(model(**inputs)).detach(), expected)
    finally:
        done.set()
        t.join(60)
    assert "error" not in box, box.get("error")
    cap, out = box["value"]
    assert torch.equal(out, expected)
    assert len(cap) == layers and [r.layer for r in cap] == list(range(layers))
    assert_no_hooks(model)
    with attnprobe.capture(model) as again:  # released when the holder's capture ended
        model(**inputs)
    assert len(again) == layers


@pytest.mark.parametrize("which", list(MODELS))
def test_many_threads_at_once_never_fail_a_forward_nor_mix_records(which, assert_no_hooks):
    model, inputs, layers = MODELS[which]()
    expected = output_of(model(**inputs)).detach()
    with attnprobe.capture(model) as reference:
        model(**inputs)
    errors, counts, refused = [], [], []
    lock = threading.Lock()

    def worker():
        for _ in range(15):
            try:
                with attnprobe.capture(model) as cap:
                    out = output_of(model(**inputs)).detach()
            except SelectionError as exc:
                with lock:
                    refused.append(str(exc))  # checked in the main thread: an assert here would only end this one
                out, cap = output_of(model(**inputs)).detach(), None  # plain forward while another captures
            except BaseException as exc:
                with lock:
                    errors.append(repr(exc))
                return
            if not torch.equal(out, expected):
                with lock:
                    errors.append("output changed")
            if cap is not None:
                with lock:
                    counts.append(len(cap))
                for mine, ref in zip(cap, reference):
                    if not torch.equal(mine.weights, ref.weights):
                        with lock:
                            errors.append(f"record of layer {mine.layer} holds another call's weights")

    threads = [threading.Thread(target=worker, name=f"worker-{i}") for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:5]
    assert all("already being captured in thread" in message for message in refused), refused[:5]
    assert counts and set(counts) == {layers}, counts  # each capture: its own thread's calls only
    assert len(counts) + len(refused) == 4 * 15
    assert_no_hooks(model)


def test_captures_of_different_models_in_different_threads_both_record():
    (m1, in1, n1), (m2, in2, n2) = own(), own()
    barrier = threading.Barrier(2)

    def run(model, inputs):
        with attnprobe.capture(model) as cap:
            barrier.wait(30)
            model(**inputs)
            barrier.wait(30)
        return len(cap)

    t, box = in_thread(lambda: run(m2, in2), "second")
    assert run(m1, in1) == n1
    t.join(60)
    assert box.get("value") == n2, box
