"""generate() under capture: one record per module per step, stitched back into one forward."""

from __future__ import annotations

import pytest
import torch
from hf_helpers import CACHE_ARG, build, inputs, real_rows
from transformers import DynamicCache

import attnprobe
from attnprobe import AttnprobeError

NEW = 4


def _greedy(model, batch, **kwargs):
    with torch.no_grad(), attnprobe.capture(model) as cap:
        seq = model.generate(**batch, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0, **kwargs)
    return seq, cap


def _one_forward(model, **batch):
    with torch.no_grad(), attnprobe.capture(model) as cap:
        model(**batch)
    return {r.name: r for r in cap}


def _assert_stitched_equal(stitched, reference):
    assert len(stitched) == len(reference)
    for r in stitched:
        ref = reference[r.name]
        assert r.weights.shape == ref.weights.shape and r.kind == ref.kind
        rows = real_rows(ref).expand_as(ref.weights)
        assert float((r.weights - ref.weights).abs()[rows].max()) <= 1e-5, r.name
        assert torch.equal(r.allowed.expand_as(ref.allowed_for_heads())[rows], ref.allowed_for_heads()[rows]), r.name
        assert torch.allclose(r.output.where(real_rows(ref), 0), ref.output.where(real_rows(ref), 0), atol=1e-5)


def test_decoder_only_steps_stitch_to_one_forward(assert_no_hooks):
    model = build("llama")
    batch = inputs("llama", "left", length=5)
    seq, cap = _greedy(model, batch)
    assert len(cap) == 2 * NEW  # 2 layers x (prefill + 3 decoding steps): the last token is never fed back
    assert [(r.step, r.query_offset, r.query_len, r.key_len) for r in cap.select(layers=[0])] == [
        (0, 0, 5, 5),
        (1, 5, 1, 6),
        (2, 6, 1, 7),
        (3, 7, 1, 8),
    ]
    assert [r.call for r in cap.select(layers=[1])] == [0, 1, 2, 3]
    # decoding rows are real tokens; the prefill keeps the left padding
    assert cap[2].query_padding.tolist() == [[False], [False]] and cap[0].query_padding[0, :2].all()
    full = attnprobe.stitch(cap)
    mask = torch.cat([batch["attention_mask"], torch.ones(2, NEW, dtype=torch.long)], dim=1)[:, :-1]
    position_ids = (mask.cumsum(-1) - 1).clamp(min=0)  # generate's positions under left padding
    _assert_stitched_equal(
        full, _one_forward(model, input_ids=seq[:, :-1], attention_mask=mask, position_ids=position_ids)
    )
    assert_no_hooks(model)


def test_encoder_decoder_steps_stitch_to_one_forward(assert_no_hooks):
    model = build("t5")
    full_batch = inputs("t5", "right")
    batch = {"input_ids": full_batch["input_ids"], "attention_mask": full_batch["attention_mask"]}
    seq, cap = _greedy(model, batch)
    encoder = [r for r in cap if r.meta["stack"] == "encoder"]
    assert len(encoder) == 2 and all(r.step is None for r in encoder)  # the encoder runs once, before the steps
    cross = [r for r in cap if r.kind == "cross"]
    assert [r.step for r in cross[::2]] == [0, 1, 2, 3] and all(r.key_len == 7 for r in cross)
    full = attnprobe.stitch(cap)
    assert {r.kind for r in full} == {"self", "cross"} and len(full) == 4
    _assert_stitched_equal(
        full,
        {
            name: r
            for name, r in _one_forward(model, **batch, decoder_input_ids=seq[:, :-1]).items()
            if r.meta["stack"] == "decoder"
        },
    )
    assert_no_hooks(model)


def test_sliding_window_cache_cannot_be_stitched_and_a_full_cache_can():
    model = build("mistral")  # window 3, prompt 5
    batch = inputs("mistral", "right", length=5)
    _, cap = _greedy(model, batch)
    step1 = cap.select(layers=[0], steps=[1])[0]
    assert step1.key_len == 3 and step1.query_offset == 5 and step1.meta["first_key_pos"] == 3
    with pytest.raises(AttnprobeError, match="sliding-window"):
        attnprobe.stitch(cap)
    # a cache without sliding layers keeps every key: the steps then stitch
    seq, cap = _greedy(model, batch, **{CACHE_ARG: DynamicCache()})
    full = attnprobe.stitch(cap)
    mask = torch.cat([batch["attention_mask"], torch.ones(2, NEW, dtype=torch.long)], dim=1)[:, :-1]
    _assert_stitched_equal(full, _one_forward(model, input_ids=seq[:, :-1], attention_mask=mask))


def test_a_report_of_a_sliding_window_generation_says_how_to_make_it_stitchable(tmp_path):
    """Reports stitch a generate() capture; with a sliding-window cache that is refused, and the error names the
    fix the README gives (generate with a DynamicCache) instead of only saying that keys were dropped."""
    from attnprobe import reports

    model = build("mistral")  # window 3, prompt 5
    _, cap = _greedy(model, inputs("mistral", "right", length=5))
    for make in (
        lambda: attnprobe.stitch(cap),
        lambda: reports.to_html(cap),
        lambda: reports.save_grid(cap, tmp_path / "grid.png"),
    ):
        with pytest.raises(AttnprobeError, match=r"sliding-window.*transformers\.DynamicCache\(\) as its cache"):
            make()
    assert not (tmp_path / "grid.png").exists()


def test_plain_forwards_have_no_step():
    model = build("gpt2")
    with torch.no_grad(), attnprobe.capture(model) as cap:
        out = model(**inputs("gpt2", "right"), use_cache=True)
        model(
            input_ids=torch.tensor([[5], [6]]),
            **{CACHE_ARG: getattr(out, CACHE_ARG)},
            attention_mask=torch.ones(2, 8, dtype=torch.long),
        )
    first, second = cap.select(calls=[0]), cap.select(calls=[1])
    assert all(r.step is None and r.query_offset == 0 for r in first)
    # a cache handed in by the caller counts as a decoding step at its position
    assert all(r.step == 0 and r.query_offset == 7 and r.key_len == 8 for r in second)


@pytest.mark.parametrize("name", ["gpt2", "llama", "gemma2", "bart", "t5"])
def test_left_padded_generation_is_unchanged_and_checks_clean(name, assert_no_hooks):
    model = build(name)
    batch = {k: v for k, v in inputs(name, "left", length=5).items() if not k.startswith("decoder")}
    options = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        plain = model.generate(**batch, **options)
    seq, cap = _greedy(model, batch)
    assert torch.equal(plain, seq)
    assert sorted({r.step for r in cap if r.step is not None}) == list(range(NEW))
    encoder_decoder = name in ("bart", "t5")
    for r in cap:
        if r.meta.get("stack") == "encoder" or (r.step == 0 and not encoder_decoder):
            # the prompt's left padding marks its query rows
            assert r.query_padding is not None and r.query_padding[0, :2].all() and not r.query_padding[1].any()
        elif r.step > 0:
            assert r.query_len == 1
            # generate() hands a decoder-only model the grown mask; an encoder-decoder decoder gets none
            assert (r.query_padding is None) if encoder_decoder else not r.query_padding.any()
    result = attnprobe.check(cap)
    assert result.ok, result.violations
    assert_no_hooks(model)


@pytest.mark.parametrize("name", ["llama", "bart"])
def test_beam_search_steps_are_marked_and_stitch_refuses_them(name, assert_no_hooks):
    """num_beams > 1: generate reorders the cache's rows between steps, so row b of a step continues another
    row's history; stitching the steps would glue different hypotheses into one matrix."""
    model = build(name)
    batch = {k: v for k, v in inputs(name, "left", length=5).items() if not k.startswith("decoder")}
    options = dict(max_new_tokens=NEW, min_new_tokens=NEW, num_beams=2, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        plain = model.generate(**batch, **options)
    cache = DynamicCache() if name == "llama" else None  # a cache of the caller's own, handed back untouched
    extra = {} if cache is None else {CACHE_ARG: cache}
    with torch.no_grad(), attnprobe.capture(model) as cap:
        seq = model.generate(**batch, **options, **extra)
    assert torch.equal(plain, seq)
    steps = [r for r in cap if r.step is not None]
    assert {r.step for r in steps} == set(range(NEW)) and all(r.weights.shape[0] == 4 for r in steps)
    assert all(r.meta.get("reordered_rows", False) == (r.step > 0) for r in steps)
    with pytest.raises(AttnprobeError, match=r"beam search reordered the batch rows.*num_beams=1"):
        attnprobe.stitch(cap)
    if cache is not None:
        assert "reorder_cache" not in vars(cache)  # the capture's watcher is gone
        cache = DynamicCache()  # also when generate fails inside the capture (the budget runs out at a later step)
        budget = attnprobe.capture(model, max_bytes=cap.nbytes // 2)
        with pytest.raises(attnprobe.CaptureBudgetError), torch.no_grad(), budget:
            model.generate(**batch, **options, **{CACHE_ARG: cache})
        assert "reorder_cache" not in vars(cache) and cache.get_seq_length() > batch["input_ids"].shape[1]
    assert_no_hooks(model)


def test_greedy_run_after_a_beam_search_in_one_capture_still_stitches():
    model = build("llama")
    batch = inputs("llama", "left", length=5)
    with torch.no_grad(), attnprobe.capture(model) as cap:
        model.generate(**batch, max_new_tokens=3, num_beams=2, do_sample=False, pad_token_id=0)
        seq = model.generate(**batch, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0)
    greedy = [r for r in cap if r.step is not None and r.weights.shape[0] == 2]
    assert [r.step for r in greedy[::2]] == list(range(NEW))
    assert not any(r.meta.get("reordered_rows") for r in greedy)  # no reorder carried over from the beam run
    full = attnprobe.stitch(attnprobe.Capture(greedy, cap.info))
    mask = torch.cat([batch["attention_mask"], torch.ones(2, NEW, dtype=torch.long)], dim=1)[:, :-1]
    _assert_stitched_equal(
        full,
        _one_forward(
            model, input_ids=seq[:, :-1], attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
        ),
    )


def test_a_static_cache_generation_is_refused_by_name():
    """A static cache pads the keys to its length: the error says so (it said a sliding window dropped keys)."""
    model = build("llama")
    batch = inputs("llama", "left", length=5)
    seq, cap = _greedy(model, batch, cache_implementation="static")
    with torch.no_grad():
        plain = model.generate(
            **batch,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            do_sample=False,
            pad_token_id=0,
            cache_implementation="static",
        )
    assert torch.equal(plain, seq)
    assert all(r.key_len > r.query_offset + r.query_len for r in cap if r.step < NEW - 1)
    with pytest.raises(AttnprobeError, match=r"static cache .*transformers\.DynamicCache\(\) as its cache"):
        attnprobe.stitch(cap)
    whole = torch.cat([batch["attention_mask"], torch.ones(2, NEW, dtype=torch.long)], dim=1)
    result = attnprobe.check(cap, causal=True, attention_mask=whole)  # slots are positions: checks still run
    assert result.violations == () and result.coverage["padding"] == len(cap)


def test_a_report_of_selected_steps_draws_them_as_they_are(tmp_path):
    """capture.select(steps=[k]) holds part of a run: reports draw those steps (they failed, stitch needing step 0),
    stitch itself says the run is incomplete; whole runs are still drawn stitched."""
    from attnprobe import reports
    from attnprobe.probe.outputs.generation import shown

    model = build("llama")
    _, cap = _greedy(model, inputs("llama", "left", length=5), num_beams=2)  # beam steps: drawn only one by one
    part = cap.select(steps=[2])
    records, stitched = shown(list(part))
    assert stitched == 0 and [r.step for r in records] == [2, 2] and records[0].weights.shape[2] == 1
    assert "<html" in reports.to_html(part).lower()
    reports.save_grid(part, tmp_path / "step2.png")
    assert (tmp_path / "step2.png").stat().st_size > 0
    with pytest.raises(AttnprobeError, match=r"expected step 0, found step 2 .*selection of steps"):
        attnprobe.stitch(part)
    _, cap = _greedy(model, inputs("llama", "left", length=5))
    records, stitched = shown(list(cap.select(layers=[0])))
    assert stitched == 1 and [(r.step, r.weights.shape[2]) for r in records] == [(None, 5 + NEW - 1)]


def test_stitch_of_a_generation_without_cache_says_why_it_has_no_steps():
    model = build("llama")
    _, cap = _greedy(model, inputs("llama", "left", length=5), use_cache=False)
    assert len(cap) == 2 * NEW and all(r.step is None for r in cap)
    assert [r.query_len for r in cap.select(layers=[0])] == [5, 6, 7, 8]  # whole forwards over the sequence so far
    with pytest.raises(AttnprobeError, match=r"use_cache=False.*its last call already hold the full matrix"):
        attnprobe.stitch(cap)


def test_prompt_lookup_decoding_is_recorded_unchanged_and_stitch_names_the_rollback():
    """Prompt lookup feeds candidate tokens and crops the cache back when they are rejected: the steps are
    recorded at their true positions, and stitch says why they do not form one matrix."""
    model = build("llama", "eager")
    ids = torch.tensor([[5, 6, 7, 8, 5, 6, 7, 8, 5, 6]])
    options = dict(max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False, pad_token_id=0, prompt_lookup_num_tokens=3)
    with torch.no_grad():
        plain = model.generate(input_ids=ids, **options)
        with attnprobe.capture(model) as cap:
            seq = model.generate(input_ids=ids, **options)
    assert torch.equal(plain, seq)
    first, second = cap.select(layers=[0])[:2]
    rejected = first.query_len - (second.query_offset - first.query_offset)
    assert first.query_len > ids.shape[1] and rejected > 0  # candidates were fed, and some were dropped
    assert attnprobe.check(cap, causal=True).violations == ()
    with pytest.raises(AttnprobeError, match=rf"went back {rejected} position\(s\): assisted or prompt-lookup"):
        attnprobe.stitch(cap)
