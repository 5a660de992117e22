"""cap.to_bertviz / cap.to_circuitsvis: the viewers receive exactly the capture's weights, and draw them.

circuitsvis and IPython are in the dev extra; bertviz is installed with ``--no-deps`` by ``make setup`` and CI (its
boto3 dependency needs python-dateutil < 3, below the pinned release; its views use only IPython and torch). Where it
is missing its drawing tests skip, and the argument tests still check what its documented call does with them
(``bertviz.util.format_attention``: a torch.stack of the layers).
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from hf_helpers import build, inputs
from reports_helpers import Stack, cross_capture, generation_capture, stack_capture, words

import attnprobe


def bertviz_params(html: str) -> dict:
    return json.loads(re.search(r"const params = (\{.*?\}); // HACK", html, flags=re.S).group(1))


def circuitsvis_props(html: str) -> dict:
    return json.loads(
        re.search(r"render\(\s*\"[^\"]+\",\s*[\w.]+,\s*(\{.*\})\s*\)\s*</script>", html, flags=re.S).group(1)
    )


def as_float32(nested) -> torch.Tensor:
    return torch.tensor(nested, dtype=torch.float64).float()  # JSON floats are the float32 values, exactly


def test_bertviz_arguments_are_the_weights(assert_no_hooks):
    cap = stack_capture(assert_no_hooks)
    view = cap.to_bertviz(batch=1, tokens=words(7))
    assert sorted(view) == ["attention", "tokens"] and view["tokens"] == words(7)
    assert len(view["attention"]) == 3
    for layer, t in zip(cap.layers, view["attention"]):
        assert t.shape == (1, 3, 7, 7) and t.dtype == torch.float32
        assert torch.equal(t, cap.record(layer).weights[1:2])
    stacked = torch.stack([t.squeeze(0) for t in view["attention"]])  # what bertviz's format_attention does
    assert stacked.shape == (3, 3, 7, 7)
    row0 = cap.to_bertviz()  # batch 0 and position numbers by default
    assert row0["tokens"] == [str(i) for i in range(7)] and torch.equal(row0["attention"][0], cap[0].weights[:1])


def test_bertviz_draws_them(assert_no_hooks):
    bertviz = pytest.importorskip("bertviz", reason="bertviz is not installed (pip install --no-deps bertviz ipython)")
    cap = stack_capture(assert_no_hooks)
    view = cap.to_bertviz(batch=1, tokens=words(7))
    for draw in (bertviz.head_view, bertviz.model_view):
        html = draw(**view, html_action="return").data
        params = bertviz_params(html)
        (data,) = params["attention"]
        assert data["left_text"] == words(7) == data["right_text"]
        assert torch.equal(
            as_float32(data["attn"]), torch.stack([cap.record(layer).weights[1].float() for layer in cap.layers])
        )


def test_bertviz_encoder_decoder_and_generation(assert_no_hooks):
    model = build("bart")
    batch = inputs("bart", padding="right")
    _, cap = attnprobe.run(model, batch)
    view = cap.to_bertviz(batch=0, tokens=words(5, "d"), key_tokens=words(7, "e"))
    assert sorted(view) == [
        "cross_attention",
        "decoder_attention",
        "decoder_tokens",
        "encoder_attention",
        "encoder_tokens",
    ]
    assert view["encoder_tokens"] == words(7, "e") and view["decoder_tokens"] == words(5, "d")
    enc = [r for r in cap if r.meta.get("stack") == "encoder"]
    cross = [r for r in cap if r.kind == "cross"]
    assert [t.shape for t in view["encoder_attention"]] == [(1, 4, 7, 7)] * 2
    assert [t.shape for t in view["cross_attention"]] == [(1, 4, 5, 7)] * 2
    assert all(torch.equal(t, r.weights[:1].float()) for t, r in zip(view["encoder_attention"], enc))
    assert all(torch.equal(t, r.weights[:1].float()) for t, r in zip(view["cross_attention"], cross))
    try:
        import bertviz
    except ImportError:
        pass
    else:
        params = bertviz_params(bertviz.head_view(**view, html_action="return").data)
        assert [d["name"] for d in params["attention"]] == ["Encoder", "Decoder", "Cross"]
        assert torch.equal(
            as_float32(params["attention"][2]["attn"]), torch.stack([r.weights[0].float() for r in cross])
        )

    steps, full = generation_capture(assert_no_hooks)  # KV-cached steps are stitched to the full matrix
    view = steps.to_bertviz(tokens=words(8))
    assert all(torch.equal(t, r.weights) for t, r in zip(view["attention"], full))


def test_circuitsvis_arguments_and_html(assert_no_hooks):
    cv = pytest.importorskip("circuitsvis.attention")
    model = build("gpt2")
    batch = inputs("gpt2", padding="left")
    _, cap = attnprobe.run(model, batch, heads=[3, 1])
    view = cap.to_circuitsvis(-1, batch=0, tokens=[words(7), words(7, "x")])
    assert sorted(view) == ["attention", "tokens"] and view["tokens"] == words(7)
    assert torch.equal(view["attention"], cap.record(1).weights[0].float())
    html = cv.attention_patterns(**view)
    for source in (html.local_src, str(html)):  # offline (inlined script) and CDN variants, built without network
        props = circuitsvis_props(source)
        assert props["tokens"] == words(7) and torch.equal(as_float32(props["attention"]), view["attention"])
    named = cap.to_circuitsvis(1, tokens=words(7), head_names=True)
    assert named["attention_head_names"] == ["L1H3", "L1H1"]
    props = circuitsvis_props(cv.attention_heads(**named).local_src)
    assert props["attentionHeadNames"] == ["L1H3", "L1H1"] and torch.equal(
        as_float32(props["attention"]), view["attention"]
    )


def test_bad_requests_say_what_to_do(assert_no_hooks):
    cap = stack_capture(assert_no_hooks)
    with pytest.raises(attnprobe.AttnprobeError, match=r"batch=5 is out of range: .* 2 batch row"):
        cap.to_bertviz(batch=5)
    with pytest.raises(attnprobe.AttnprobeError, match=r"no record with call=1 .*calls captured: \[0\]"):
        cap.to_bertviz(call=1)
    with pytest.raises(attnprobe.AttnprobeError, match="has no weights: capture with keep"):
        stack_capture(assert_no_hooks, keep=["q"]).to_bertviz()
    _, uneven = attnprobe.run(Stack().eval(), torch.randn(2, 7, 12), heads={0: [0], 1: None})
    with pytest.raises(attnprobe.AttnprobeError, match="same heads and length"):
        uneven.to_bertviz()
    assert uneven.select(layers=[1]).to_bertviz()["attention"][0].shape == (1, 3, 7, 7)
    with pytest.raises(attnprobe.AttnprobeError, match="tokens has 3 entries"):
        cap.to_circuitsvis(0, tokens=["a", "b", "c"])
    cross = cross_capture(assert_no_hooks)
    cross_layer = next(r.layer for r in cross if r.kind == "cross")
    with pytest.raises(attnprobe.AttnprobeError, match="cross-attention: circuitsvis"):
        cross.to_circuitsvis(cross_layer)
    with pytest.raises(attnprobe.AttnprobeError, match="no record of layer 7"):
        cap.to_circuitsvis(7)
