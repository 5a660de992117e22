"""The native row pass (``probe/engine/native_rows.py``): the eager engine with its per-element work in one C loop
per row gives the statistics of torch's ops alone, on the oracle's cases (every mask, NaN and inf logits, keys in
blocks, the kernel's lse or not), on a ``-inf`` logit at an allowed key, with two threads; ``capture(stats_engine=)``
says which engine ran and refuses ``"native"`` where the row pass cannot be built, naming why; the library is
compiled once into the user's cache."""

from __future__ import annotations

import math
import os
import time
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from test_stats_lse import assert_close_to, exact_lse
from test_stats_oracle import BLOCK_BYTES, MASKS, _case

import attnprobe
from attnprobe.probe.engine import native_rows
from attnprobe.probe.engine.attention_math import AttentionCall
from attnprobe.probe.engine.stats import ROW_STATS, attention_stats
from attnprobe.probe.errors import SelectionError

pytestmark = pytest.mark.skipif(
    not native_rows.available(), reason=f"the native row pass is not built here: {native_rows.why_unavailable()}"
)


def _both(call, diag, padding, **kw):
    """``(native, torch's ops, blocks the row pass took)`` for one call."""
    report: dict = {}
    got = attention_stats(call, diag_offset=diag, query_padding=padding, native=True, report=report, **kw)
    want = attention_stats(call, diag_offset=diag, query_padding=padding, **kw)
    return got, want, report["native_blocks"]


@pytest.mark.parametrize("lse", [False, True], ids=["own-max", "kernel-lse"])
@pytest.mark.parametrize("block_bytes", BLOCK_BYTES.values(), ids=BLOCK_BYTES.keys())
@pytest.mark.parametrize("mask", MASKS)
def test_the_row_pass_gives_the_statistics_of_torchs_ops(mask, block_bytes, lse):
    call, diag, padding = _case(mask, "plain", torch.float32)
    if lse:
        call = replace(call, lse=exact_lse(call))
    got, want, blocks = _both(call, diag, padding, block_bytes=block_bytes)
    assert_close_to(got, want, atol=1e-5)
    # keys in blocks without the lse take two passes, with torch's ops
    if mask != "nan" and (lse or block_bytes == BLOCK_BYTES["one-block"]):
        assert blocks > 0


def test_a_nan_or_inf_logit_sends_its_block_to_torchs_ops():
    call, diag, padding = _case("nan", "plain", torch.float32)
    got, want, blocks = _both(call, diag, padding, block_bytes=1 << 20)
    assert blocks == 0  # one block, holding the NaN rows: torch's ops took it whole
    assert_close_to(got, want, atol=1e-5)
    assert not bool(want["finite"].all())


def test_a_minus_inf_logit_at_an_allowed_key_makes_its_row_not_finite():
    """An overflowing query (``q = inf`` against keys whose first feature is negative): every logit of the row is
    ``-inf`` at keys the mask allows. torch's ops give its entropy ``-inf * 0 = NaN``; so must the row pass."""
    call, diag, padding = _case("causal", "plain", torch.float32)
    k = call.k.clone()
    k[..., 0] = -k[..., 0].abs() - 0.5
    q = call.q.clone()
    q[1, 0, 6] = 0.0
    q[1, 0, 6, 0] = math.inf
    call = replace(call, q=q, k=k)
    for lse in (None, exact_lse(call)):
        got, want, blocks = _both(replace(call, lse=lse), diag, padding)
        assert blocks > 0
        assert_close_to(got, want, atol=1e-5)
        assert not bool(got["finite"][1, 0, 6])


def test_the_row_pass_with_two_threads():
    call, diag, padding = _case("padding", "plain", torch.float32)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        got, want, blocks = _both(call, diag, padding, block_bytes=4000)
    finally:
        torch.set_num_threads(threads)
    assert blocks > 0
    assert_close_to(got, want, atol=1e-5)


def test_calls_the_row_pass_does_not_take_go_to_torchs_ops():
    """Attention sinks (their share of the normaliser) and float64: torch's ops alone, bit for bit."""
    sinks, diag, padding = _case("padding", "bias-softcap-sinks", torch.float32)
    double, _, _ = _case("padding", "plain", torch.float64)
    for call in (sinks, double):
        got, want, blocks = _both(call, diag, padding)
        assert blocks == 0
        for name, value in want.items():
            assert torch.equal(got[name].nan_to_num(-7.0), value.nan_to_num(-7.0)), name


def _tiny_llama():
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=100,
    )
    return transformers.LlamaModel._from_config(config, attn_implementation="sdpa").eval()


def test_capture_says_the_row_pass_ran_and_gives_torchs_statistics():
    model, ids = _tiny_llama(), torch.randint(0, 100, (2, 40), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        plain = model(input_ids=ids).last_hidden_state
        caps = {}
        for engine in ("native", "torch", "auto"):
            with attnprobe.capture(model, keep=("stats",), stats_engine=engine) as cap:
                out = model(input_ids=ids).last_hidden_state
            assert torch.equal(out, plain)
            caps[engine] = cap
    assert [r.meta.get("stats_engine") for r in caps["native"]] == ["native", "native"]
    assert [r.meta.get("stats_engine") for r in caps["auto"]] == ["native", "native"]
    assert [r.meta.get("stats_engine") for r in caps["torch"]] == [None, None]
    for got, want in zip(caps["native"], caps["torch"]):
        assert_close_to(got.stats, want.stats, atol=1e-5)


def test_native_is_refused_where_the_row_pass_cannot_be_built(monkeypatch):
    monkeypatch.setattr(native_rows, "_library", lambda: "no C compiler on the path (set CC, or install gcc)")
    with pytest.raises(SelectionError, match=r"no C compiler on the path.*stats_engine='torch'"):
        attnprobe.capture(_tiny_llama(), keep=("stats",), stats_engine="native")
    model, ids = _tiny_llama(), torch.randint(0, 100, (1, 12))
    with torch.no_grad(), attnprobe.capture(model, keep=("stats",)) as cap:  # auto: torch's ops, nothing said
        model(input_ids=ids)
    assert [r.meta.get("stats_engine") for r in cap] == [None, None]


def test_the_library_is_built_once_into_the_users_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native_rows._library.cache_clear()
    try:
        assert native_rows.available()
        built = list((tmp_path / "attnprobe" / "native").glob("native_rows-*.so"))
        assert len(built) == 1
        inode = built[0].stat().st_ino
        native_rows._library.cache_clear()
        assert native_rows.available()  # a new process loads the cached library, builds nothing
        assert built[0].stat().st_ino == inode
        assert [p.name for p in (tmp_path / "attnprobe" / "native").iterdir()] == [built[0].name]  # no leftovers
    finally:
        native_rows._library.cache_clear()


def test_building_a_library_removes_those_no_process_loaded_for_a_month(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cache = tmp_path / "attnprobe" / "native"
    cache.mkdir(parents=True)
    days = 86400
    ages = {"native_rows-stale.so": 40 * days, "native_rows-recent.so": 2 * days, "notes-stale.txt": 40 * days}
    for name, age in ages.items():
        (cache / name).write_bytes(b"")
        os.utime(cache / name, (time.time() - age, time.time() - age))
    native_rows._library.cache_clear()
    try:
        assert native_rows.available()  # builds this source's library, then prunes
        built = native_rows._library_path(native_rows._compiler())
        kept = sorted([built.name, "native_rows-recent.so", "notes-stale.txt"])
        assert sorted(p.name for p in cache.iterdir()) == kept
        os.utime(built, (time.time() - 40 * days, time.time() - 40 * days))
        native_rows._library.cache_clear()
        assert native_rows.available()  # loading it marks it as used: another version's build keeps it
        assert built.stat().st_mtime > time.time() - days
    finally:
        native_rows._library.cache_clear()


def test_a_compiler_that_fails_is_named(monkeypatch, tmp_path):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", "false")  # /bin/false: every build fails
    native_rows._library.cache_clear()
    try:
        assert not native_rows.available()
        assert "could not build native_rows.c" in str(native_rows.why_unavailable())
    finally:
        native_rows._library.cache_clear()


def _mask(kind: str, B: int, Tq: int, keys: int) -> torch.Tensor | None:
    """``(batch, 1, query, key)`` bool, as transformers' sdpa masks come: key padding (the first item's last 30 keys,
    the second's first 20), alone (also as one row for every query) or with the causal triangle folded in; a causal
    sliding window of 48 keys (with the padding too), or of another size in each of the 3 heads; packed documents,
    causal inside each and cut elsewhere in each item; or an irregular one (one row of one item with a hole its
    item's other rows attend), which is not of the fused pass's form. Query ``i`` sits at key ``i + keys - Tq``."""
    if kind in ("none", "causal"):
        return None
    keep = torch.ones(B, keys, dtype=torch.bool)
    keep[0, -30:], keep[1, :20] = False, False
    if kind == "padding-one-row":  # (batch, 1, 1, key): one row for every query
        return keep[:, None, None, :]
    allowed = keep[:, None, None, :].expand(B, 1, Tq, keys).clone()
    key, own = torch.arange(keys)[None, :], torch.arange(Tq)[:, None] + keys - Tq  # (1, key), (query, 1)
    if kind in ("causal+padding", "window", "window+padding"):
        allowed &= key <= own
    if kind == "window":
        return (key <= own) & (key > own - 48)[None, None].expand(B, 1, Tq, keys)
    if kind == "window+padding":
        allowed &= key > own - 48
    if kind == "documents":  # (item 0: documents from keys 0, 120 and 200 on; item 1: 0 and 90)
        starts = [torch.tensor([0, 120, 200]), torch.tensor([0, 90])]
        document = [torch.bucketize(torch.arange(keys), b, right=True) for b in starts]  # (key,) each
        same = torch.stack([doc[own.squeeze(1)][:, None] == doc[None, :] for doc in document])  # (batch, query, key)
        allowed = (same & (key <= own))[:, None]
    if kind == "window-per-head":  # head i: a causal window of 16 (i + 2) keys, and the padding
        windows = torch.tensor([32, 48, 64]).view(1, 3, 1, 1)
        return allowed & (key <= own) & (key > own - windows)  # (batch, head, query, key)
    if kind == "irregular":
        allowed[0, 0, 5, 100:110] = False
    return allowed


FUSED_MASKS = [
    "causal",
    "none",
    "padding",
    "padding-one-row",
    "causal+padding",
    "window",
    "window+padding",
    "documents",
    "window-per-head",
]


def _larger_call(
    *,
    causal: bool,
    lse: bool,
    seed: int = 0,
    d_head: int = 40,
    d_v: int = 48,
    keys: int = 300,
    mask: str = "none",
    queries: int = 70,
):
    """2 x 3 heads reading 1 kv head, ``queries`` queries (the last of the keys), ``keys`` keys: tiles of 512 keys and
    their tails, vectors of 64 keys and of 32 and 16 of v's columns; ``mask`` one of ``_mask``'s."""
    g = torch.Generator().manual_seed(seed)
    B, H, Tq = 2, 3, queries
    q, k = torch.randn(B, H, Tq, d_head, generator=g), torch.randn(B, 1, keys, d_head, generator=g)
    v = torch.randn(B, 1, keys, d_v, generator=g)
    allowed = _mask(mask, B, Tq, keys)
    call = AttentionCall.for_heads(
        q, k, v, heads=(0, 1, 2), kv_heads=(0, 0, 0), scaling=0.4, causal=causal, causal_offset=keys - Tq, mask=allowed
    )
    logits = call.logits(0, Tq, 0, keys).double()  # (batch, head, query, key)
    if causal:
        later = torch.arange(keys)[None, :] > torch.arange(Tq)[:, None] + keys - Tq
        logits = logits.masked_fill(later, -math.inf)
    if allowed is not None:
        logits = logits.masked_fill(~allowed, -math.inf)
    weights = torch.softmax(logits, -1)
    output = (weights @ call.v.double()).float()  # (batch, head, query, d_v): what the kernel returned
    call = replace(call, output=output, lse=torch.logsumexp(logits, -1).float() if lse else None)
    return call, keys - Tq


def _only(monkeypatch, fused: bool) -> None:
    """The native path of a block with the kernel's lse that must not run fails if it does: the row pass and the
    engine's own paths, which a block whose sums do not fit the lse falls back to (``fused``), or the fused pass's C
    loop."""
    from attnprobe.probe.engine import stats as engine

    def taken(*args, **kwargs):
        raise AssertionError("the fused pass " + ("did not take" if fused else "took") + " the block")

    if fused:
        for path in ("_lse_block_native", "_one_block", "_two_passes"):
            monkeypatch.setattr(engine._Engine, path, taken)
    else:
        monkeypatch.setattr(engine.native_rows, "fused", taken)


@pytest.mark.parametrize("keys", [300, 1100])
@pytest.mark.parametrize("mask", FUSED_MASKS)
def test_the_fused_pass_gives_the_statistics_of_torchs_ops(mask, keys, monkeypatch):
    """With the kernel's lse, every key in one block and no mask but an interval of keys per row and batch item
    (causal, a sliding window, documents) and keys no row of a batch item may attend (padding), the fused pass takes
    every block (the other native path fails if taken), and its statistics are torch's ops', on one and two
    threads."""
    call, diag = _larger_call(causal=mask == "causal", lse=True, keys=keys, mask=mask)
    want = attention_stats(call, diag_offset=diag)
    _only(monkeypatch, fused=True)
    for threads in (1, 2):
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            report: dict = {}
            got = attention_stats(call, diag_offset=diag, native=True, report=report, block_bytes=1 << 22)
        finally:
            torch.set_num_threads(previous)
        assert report["native_blocks"] > 0
        assert_close_to(got, want, atol=1e-5)
        assert bool(got["finite"].all())


def test_the_fused_pass_writes_every_statistic_as_the_engine_gives_it(monkeypatch):
    """The fused pass writes each row's statistics itself (``native_rows.FinalStats``): every one of ``ROW_STATS``,
    with the engine's dtypes and shapes, equal to torch's ops' in every row, also where a row attends no key (the
    padded item's first rows under a window) or its own key is not allowed."""
    call, diag = _larger_call(causal=False, lse=True, mask="window+padding")
    allowed = call.mask.clone()
    for row in range(10, 14):  # rows 10-13 attend the keys before their own (their interval ends there)
        allowed[0, 0, row, diag + row :] = False
    allowed[1, 0, 60:63] = False  # rows that attend no key
    call = replace(call, mask=allowed)
    call = replace(call, lse=exact_lse(call))
    names = native_rows.FINAL_FLOATS + native_rows.FINAL_LONGS + native_rows.FINAL_BOOLS
    assert sorted(names) == sorted(ROW_STATS)
    want = attention_stats(call, diag_offset=diag)
    _only(monkeypatch, fused=True)
    got = attention_stats(call, diag_offset=diag, native=True)
    assert list(got) == list(want)
    for name in want:
        assert (got[name].dtype, got[name].shape) == (want[name].dtype, want[name].shape), name
    assert not bool(want["diagonal_allowed"][0, :, 10:14].any()) and bool(want["diagonal_allowed"][0, :, 14:40].all())
    assert int((want["allowed_keys"] == 0).sum()) == 3 * 3
    assert_close_to(got, want, atol=1e-5)


def test_an_lse_that_is_not_the_logits_is_refused_by_the_fused_pass(monkeypatch):
    """A kernel lse off by 0.01: the fused pass refuses the block (each row's ``sum e`` is off 1 by 1%), nothing of it
    is kept, and the statistics are those of the engine's own paths."""
    call, diag = _larger_call(causal=True, lse=True, mask="causal+padding")
    want = attention_stats(replace(call, lse=None), diag_offset=diag)
    calls = _count_fused(monkeypatch)
    got = attention_stats(replace(call, lse=call.lse + 0.01), diag_offset=diag, native=True)
    assert calls == [(70, True)]
    assert_close_to(got, want, atol=1e-5)


def test_a_mask_of_another_form_goes_to_the_row_pass(monkeypatch):
    """A mask with a hole inside one row's keys that the item's other rows attend is no interval of keys per row and
    key padding: the fused pass refuses it (it would fail if it took the block) and the row pass gives torch's ops'
    statistics."""
    call, diag = _larger_call(causal=False, lse=True, mask="irregular")
    want = attention_stats(call, diag_offset=diag)
    _only(monkeypatch, fused=False)
    _native_gives(call, diag, want)


def _native_gives(call, diag, want) -> None:
    """The native engine on ``call`` takes some block and gives ``want``, torch's ops' statistics, within 1e-5."""
    report: dict = {}
    got = attention_stats(call, diag_offset=diag, native=True, report=report, block_bytes=1 << 22)
    assert report["native_blocks"] > 0
    assert_close_to(got, want, atol=1e-5)


def test_a_nan_logit_sends_the_fused_block_to_torchs_ops():
    call, diag = _larger_call(causal=True, lse=True)
    q = call.q.clone()
    q[1, 2, 40, 3] = math.nan
    call = replace(call, q=q)
    report: dict = {}
    got = attention_stats(call, diag_offset=diag, native=True, report=report)
    want = attention_stats(call, diag_offset=diag)
    assert report["native_blocks"] == 0
    assert_close_to(got, want, atol=1e-5)
    assert not bool(got["finite"][1, 2, 40])


#: 64 rows a block of the engine's own at 2 x 3 heads and 300 keys (two (rows x keys) float buffers), where the fused
#: pass, which holds no such block (only the mask's bools and the rows' statistics), takes every one of 300 rows
_SMALL_BLOCKS = 64 * 2 * (2 * 3 * 300 * 4)


def _count_fused(monkeypatch) -> list:
    """The fused pass's calls, each ``(rows, refused)``, as ``native_rows.fused`` gets them."""
    calls: list = []
    run = native_rows.fused

    def counted(q, *args, **kwargs):
        got = run(q, *args, **kwargs)
        calls.append((q.shape[2], got is None))
        return got

    monkeypatch.setattr(native_rows, "fused", counted)
    return calls


@pytest.mark.parametrize("mask", ["causal", "window+padding"])
def test_the_fused_pass_takes_more_rows_a_block_than_the_engines_own_blocks(mask, monkeypatch):
    """Where the fused pass may take a call, a block is as many rows as the mask's bools fit in the block budget (it
    holds no (rows x keys) block): 300 rows in one call where the engine's own blocks take 64; the statistics are
    torch's ops'."""
    call, diag = _larger_call(causal=mask == "causal", lse=True, queries=300, mask=mask)
    want = attention_stats(call, diag_offset=diag, block_bytes=_SMALL_BLOCKS)
    calls = _count_fused(monkeypatch)
    report: dict = {}
    got = attention_stats(call, diag_offset=diag, native=True, report=report, block_bytes=_SMALL_BLOCKS)
    assert calls == [(300, False)] and report["native_blocks"] == 1
    assert_close_to(got, want, atol=1e-5)


def test_a_fused_block_refused_whole_is_taken_in_the_engines_own_blocks(monkeypatch):
    """A NaN logit in one row makes the fused pass refuse the whole block of 300 rows; the rows are then taken in the
    engine's blocks of 64: the fused pass takes the four without the NaN, torch's ops the one with it, and the
    statistics are torch's ops' (the row with the NaN not finite)."""
    call, diag = _larger_call(causal=True, lse=True, queries=300)
    q = call.q.clone()
    q[1, 2, 140, 3] = math.nan
    call = replace(call, q=q)
    want = attention_stats(call, diag_offset=diag, block_bytes=_SMALL_BLOCKS)
    calls = _count_fused(monkeypatch)
    report: dict = {}
    got = attention_stats(call, diag_offset=diag, native=True, report=report, block_bytes=_SMALL_BLOCKS)
    assert calls == [(300, True), (64, False), (64, False), (64, True), (64, False), (44, False)]
    assert report["native_blocks"] == 4
    assert_close_to(got, want, atol=1e-5)
    assert not bool(got["finite"][1, 2, 140]) and bool(got["finite"][0].all())


@pytest.mark.parametrize("mask", ["causal", "window+padding"])
@pytest.mark.parametrize("queries", [1, 2, 3])
def test_decoding_rows_take_the_fused_pass_where_the_keys_are_few(queries, mask, monkeypatch):
    """A decoding step's one to three rows: the fused pass computes four (the rows past them repeat the last, never
    read) where a head's keys times its size are few (300 x 40), and its statistics are torch's ops'."""
    call, diag = _larger_call(causal=mask == "causal", lse=True, queries=queries, mask=mask)
    want = attention_stats(call, diag_offset=diag)
    calls = _count_fused(monkeypatch)
    got = attention_stats(call, diag_offset=diag, native=True)
    assert calls == [(queries, False)]
    assert_close_to(got, want, atol=1e-5)


def test_a_decoding_row_among_many_keys_takes_the_row_pass(monkeypatch):
    """Past ``_FUSED_FEW_KEYS`` (here lowered below 300 keys x 40) one row takes the row pass, not four rows of the
    fused pass and a copy of every key; four rows still take the fused pass."""
    from attnprobe.probe.engine import stats as engine

    monkeypatch.setattr(engine, "_FUSED_FEW_KEYS", 300 * 40 - 1)
    calls = _count_fused(monkeypatch)
    for queries, fused in ((1, False), (4, True)):
        call, diag = _larger_call(causal=True, lse=True, queries=queries)
        report: dict = {}
        got = attention_stats(call, diag_offset=diag, native=True, report=report)
        assert (calls.pop() if calls else None) == ((queries, False) if fused else None)
        assert report["native_blocks"] == 1  # the row pass's, or the fused pass's
        assert_close_to(got, attention_stats(call, diag_offset=diag), atol=1e-5)


def test_the_per_key_sums_of_thousands_of_rows_keep_their_digits():
    """The fused pass takes every row of a 4,096-token causal call in one block; each key's summed weight (up to 8.5)
    stays within 5e-6 of the float64 sum of the exact weights (added one row after another in float32, the sums of
    the first keys were 2.6e-5 off)."""
    g = torch.Generator().manual_seed(0)
    T, D = 4096, 16
    q, k, v = (torch.randn(1, 1, T, D, generator=g) for _ in range(3))
    call = AttentionCall.for_heads(q, k, v, heads=(0,), kv_heads=(0,), scaling=0.25, causal=True, causal_offset=0)
    later = torch.ones(T, T, dtype=torch.bool).triu(1)  # (query, key)
    logits = call.logits(0, T, 0, T).double().masked_fill(later, -math.inf)  # (1, 1, query, key)
    weights = torch.softmax(logits, -1)
    call = replace(call, output=(weights @ v.double()).float(), lse=torch.logsumexp(logits, -1).float())
    report: dict = {}
    got = attention_stats(call, diag_offset=0, native=True, report=report)
    assert report["native_blocks"] == 1
    assert float((got["key_weight"].double() - weights.sum(-2)).abs().max()) < 5e-6


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_a_nan_or_inf_value_reaches_the_fused_pass_output_check_as_torchs_ops(bad, monkeypatch):
    """The fused pass takes each key's largest |v| itself, head by head: a NaN or inf value at a key every row
    attends makes every row's output check of that item what torch's ops make it (not finite), and leaves the other
    item's rows finite."""
    call, diag = _larger_call(causal=True, lse=True)
    v = call.v.clone()
    v[1, :, 10, 7] = bad  # (batch, head, key, d_v): a key every row of the second item attends
    call = replace(call, v=v)
    want = attention_stats(call, diag_offset=diag)
    _only(monkeypatch, fused=True)
    report: dict = {}
    got = attention_stats(call, diag_offset=diag, native=True, report=report)
    assert report["native_blocks"] > 0
    assert_close_to(got, want, atol=1e-5)
    assert not bool(got["finite"][1].any()) and bool(got["finite"][0].all())
    assert not bool(got["output_scale"][1].isfinite().any()) and bool(got["output_scale"][0].isfinite().all())


def test_logits_in_a_layout_of_their_own_go_to_torchs_ops(monkeypatch):
    """The row pass reads raw memory: logits that come back as a non-contiguous tensor (a float mask or a score_mod
    may make a tensor of their own) are not handed to it; torch's ops take the block."""
    call, diag, padding = _case("padding", "plain", torch.float32)
    real = AttentionCall.logits

    def strided(self, *args, **kwargs):
        s = real(self, *args, **kwargs)
        return s.transpose(-1, -2).contiguous().transpose(-1, -2)  # the same values, not contiguous

    monkeypatch.setattr(AttentionCall, "logits", strided)
    got, want, blocks = _both(call, diag, padding)
    assert blocks == 0
    assert_close_to(got, want, atol=1e-5)


@pytest.mark.parametrize("seed", range(6))
def test_the_mask_scan_reads_each_rows_interval_and_the_kept_keys(seed):
    """``native_rows.intervals`` against torch's ops on random masks of the fused pass's form (a window per row,
    cut at random, padding at random keys of each item) and on the same masks with one hole more: the first and last
    allowed key, the count, the kept keys, and whether the mask has the form, also for a mask repeated along the
    rows (stride 0) and keys that are not contiguous."""
    g = torch.Generator().manual_seed(seed)
    items, n, d = 2, 37, 1000 + 97 * seed
    start = torch.randint(0, d, (items, n, 1), generator=g)
    limit = start + torch.randint(0, 600, (items, n, 1), generator=g)
    keep = torch.rand(items, 1, d, generator=g) > 0.2
    key = torch.arange(d)
    allowed = (key >= start) & (key < limit) & keep  # (item, query, key)
    for form in (allowed, allowed[:, :1].expand(items, n, d), allowed.transpose(1, 2).contiguous().transpose(1, 2)):
        got = native_rows.intervals(form)
        assert got is not None and got.fits
        some = form.any(-1)  # (item, query)
        assert torch.equal(got.start, torch.where(some, form.to(torch.uint8).argmax(-1), d))
        assert torch.equal(got.limit, torch.where(some, d - form.flip(-1).to(torch.uint8).argmax(-1), d))
        assert torch.equal(got.counts, form.sum(-1))
        assert torch.equal(got.keep, form.any(1))
    row = int(torch.nonzero(allowed.sum(-1)[0] > 2)[0, 0])  # a row of item 0 with keys inside its interval
    keys = torch.nonzero(allowed[0, row]).flatten()
    holed = allowed.clone()
    holed[0, row, keys[1]] = False  # its second allowed key, which item 0 keeps
    assert bool(holed[0, :, keys[1]].any())  # another row still attends it: a hole
    got = native_rows.intervals(holed)
    assert got is not None and not got.fits


def test_a_sliding_window_model_takes_the_fused_pass_on_every_layer(monkeypatch):
    """A Mistral with a sliding window of 16 keys over a left-padded batch of 100 tokens (transformers' sdpa passes
    the window and the padding as one boolean mask): every layer takes the fused pass (the other paths fail if
    taken) and its statistics are the torch engine's; the outputs are the uncaptured run's."""
    import transformers

    torch.manual_seed(0)
    config = transformers.MistralConfig(
        hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=100, sliding_window=16,
    )  # fmt: skip
    model = transformers.MistralModel._from_config(config, attn_implementation="sdpa").eval()
    ids = torch.randint(0, 100, (2, 100), generator=torch.Generator().manual_seed(0))
    padding = torch.ones(2, 100, dtype=torch.long)
    padding[1, :13] = 0
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=padding).last_hidden_state
        with attnprobe.capture(model, keep=("stats",), stats_engine="torch") as want:
            model(input_ids=ids, attention_mask=padding)
        _only(monkeypatch, fused=True)
        with attnprobe.capture(model, keep=("stats",), stats_engine="native") as got:
            out = model(input_ids=ids, attention_mask=padding).last_hidden_state
    assert torch.equal(out, plain)
    assert [r.meta.get("stats_engine") for r in got] == ["native", "native"]
    for a, b in zip(got, want):
        assert_close_to(a.stats, b.stats, atol=1e-5)


def _strided(t: torch.Tensor) -> torch.Tensor:
    """``t`` ``(batch, head, n, d)`` with the strides of a ``(batch, n, head, d)`` projection's view among as many
    other heads (the same values): rows ``2 x head x d`` apart, also for a call's single kv head."""
    wide = torch.cat([t, torch.zeros_like(t)], 1)  # (batch, 2 head, n, d)
    return wide.transpose(1, 2).contiguous().transpose(1, 2)[:, : t.shape[1]]


def test_q_k_and_v_strided_as_a_projections_give_the_same_statistics(monkeypatch):
    """The fused pass reads q, k and v through their strides (values whose rows are not ``d_v`` apart are copied per
    head first): the statistics of the strided call equal those of the contiguous one, on the fused pass."""
    call, diag = _larger_call(causal=False, lse=True, keys=700, mask="window+padding")
    strided = replace(call, q=_strided(call.q), k=_strided(call.k), v=_strided(call.v))
    assert strided.v is not None and strided.v.stride(2) != strided.v.shape[-1]
    want = attention_stats(call, diag_offset=diag)
    _only(monkeypatch, fused=True)
    _native_gives(strided, diag, want)


def _runs_here(march: str) -> bool:
    """Whether this machine runs code built with ``-march=march`` (an x86-64 level)."""
    import platform

    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    needs = {"x86-64-v2": {"sse4_2", "popcnt"}, "x86-64-v3": {"avx2", "fma", "bmi2"}}[march]
    return needs <= flags


@pytest.mark.parametrize("march", ["x86-64-v3", "x86-64-v2"], ids=["avx2", "sse"])
def test_the_fused_pass_built_for_narrower_vectors_gives_torchs_statistics(march, monkeypatch, tmp_path):
    """The C is written in vectors of one register of the target (16 floats with AVX-512, 8 with AVX2, 4 with SSE):
    built for AVX2 and for SSE (on this machine, where it runs them), the library passes its self-check and the fused
    pass gives torch's statistics on masks of every form, with v's columns in every step (45: vectors of 2 and 1
    registers and a scalar tail at each width). Built with AVX-512's 64-byte vectors for AVX2, the pass had been 14-24
    times slower (benchmarks: docs/benchmarks.md). A compiler that does not know the level skips it."""
    if not _runs_here(march):
        pytest.skip(f"this machine does not run {march} code")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    flags = tuple(f"-march={march}" if f == "-march=native" else f for f in native_rows._FLAGS)
    monkeypatch.setattr(native_rows, "_FLAGS", flags)
    native_rows._library.cache_clear()
    try:
        why = native_rows.why_unavailable() or ""
        if "could not build" in why:
            pytest.skip(f"the C compiler does not build for {march}: {why}")
        assert native_rows.available(), why
        _only(monkeypatch, fused=True)
        for mask in ("causal", "window+padding", "documents"):
            call, diag = _larger_call(causal=mask == "causal", lse=True, keys=300, mask=mask, d_v=45)
            _native_gives(call, diag, attention_stats(call, diag_offset=diag))
    finally:
        native_rows._library.cache_clear()


def _compiler_refusing(tmp_path: Path, refused: tuple[str, ...]) -> str:
    """gcc behind a script that refuses ``refused`` as Apple's clang refuses ``-fopenmp``, and that has no
    ``omp.h`` (as Apple's clang has none)."""
    script, headers = tmp_path / "cc", tmp_path / "include"
    headers.mkdir()
    (headers / "omp.h").write_text('#error "this compiler has no omp.h"\n')
    words = " ".join(refused)
    script.write_text(
        "#!/bin/sh\n"
        f'for a in "$@"; do case " {words} " in *" $a "*) echo "cc: error: unsupported option $a" >&2; exit 1;; esac; '
        "done\n"
        f'exec gcc -I{headers} "$@"\n'
    )
    script.chmod(0o755)
    return str(script)


@pytest.mark.parametrize(
    "refused",
    [("-fopenmp",), ("-fopenmp", "-march=native"), ("-fopenmp", "-march=native", "-mcpu=native")],
    ids=["openmp", "openmp+march", "openmp+march+mcpu"],
)
def test_a_compiler_that_refuses_openmp_or_native_tuning_builds_the_library_without(refused, monkeypatch, tmp_path):
    """Apple's clang has no ``-fopenmp`` and AArch64 compilers may refuse ``-march=native``: the library is built
    without them (OpenMP's simd pragmas kept, then ``-mcpu=native``, then no tuning), says it runs on one thread
    (``threaded()``), and the fused pass gives torch's statistics while torch runs on two."""
    import shutil

    if not shutil.which("gcc") or not shutil.which("sh"):
        pytest.skip("needs gcc and sh")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", _compiler_refusing(tmp_path, refused))
    native_rows._library.cache_clear()
    previous = torch.get_num_threads()
    try:
        assert native_rows.available(), native_rows.why_unavailable()
        assert not native_rows.threaded()
        _only(monkeypatch, fused=True)
        torch.set_num_threads(2)
        for mask in ("causal", "window+padding"):
            call, diag = _larger_call(causal=mask == "causal", lse=True, keys=300, mask=mask)
            _native_gives(call, diag, attention_stats(call, diag_offset=diag))
    finally:
        torch.set_num_threads(previous)
        native_rows._library.cache_clear()
