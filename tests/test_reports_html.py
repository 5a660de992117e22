"""The HTML report as a document: self-contained, escaped, exact data, files never overwritten, clear errors."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from dataclasses import replace
from html.parser import HTMLParser

import numpy as np
import pytest
import torch
from reports_helpers import cross_capture, generation_capture, stack_capture, words

import attnprobe
from attnprobe import AttnprobeError, CheckResult, Violation
from attnprobe.reports import to_html
from attnprobe.reports._common import display_token
from attnprobe.reports.encoding import decode_floats


class Elements(HTMLParser):
    """Every start tag with its attributes, and the text of each script element."""

    def __init__(self):
        super().__init__()
        self.tags: list[tuple[str, dict]] = []
        self.scripts: list[tuple[dict, str]] = []
        self._in_script: dict | None = None

    def handle_starttag(self, tag, attrs):
        self.tags.append((tag, dict(attrs)))
        if tag == "script":
            self._in_script = dict(attrs)
            self.scripts.append((self._in_script, ""))

    def handle_data(self, data):
        if self._in_script is not None:
            attrs, text = self.scripts[-1]
            self.scripts[-1] = (attrs, text + data)

    def handle_endtag(self, tag):
        if tag == "script":
            self._in_script = None


def parse(document: str) -> Elements:
    p = Elements()
    p.feed(document)
    p.close()
    return p


def strict_loads(text: str):
    """JSON as the browser's JSON.parse reads it (no NaN/Infinity tokens), with the page's reviver."""

    def refuse(token):
        raise ValueError(f"not strict JSON: {token}")

    def revive(obj):
        return float(obj["$float"].replace("Infinity", "inf")) if set(obj) == {"$float"} else obj

    return json.loads(text, parse_constant=refuse, object_hook=revive)


def report_meta(document: str) -> tuple[dict, dict[str, str]]:
    p = parse(document)
    meta = next(strict_loads(text) for attrs, text in p.scripts if attrs.get("id") == "attnprobe-meta")
    blobs = {attrs["id"]: text for attrs, text in p.scripts if attrs.get("type") == "application/x-attnprobe-blob"}
    return meta, blobs


def test_returns_the_document_or_writes_one_file_and_never_overwrites(tmp_path, assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=2, heads=2, length=5)
    document = to_html(cap, tokens=words(5))
    assert isinstance(document, str) and document.startswith("<!doctype html>")
    path = to_html(cap, tmp_path / "r.html", tokens=words(5))
    assert path == tmp_path / "r.html" and path.read_text(encoding="utf-8").startswith("<!doctype html>")
    before = path.read_bytes()
    with pytest.raises(FileExistsError, match="overwrite=True"):
        to_html(cap, path)
    assert path.read_bytes() == before
    assert to_html(cap, path, overwrite=True, title="again") == path
    assert "again" in path.read_text(encoding="utf-8")
    with pytest.raises(FileNotFoundError, match="does not exist; create it first"):
        to_html(cap, tmp_path / "nope" / "r.html")
    with pytest.raises(IsADirectoryError):
        to_html(cap, tmp_path)


def test_document_is_self_contained(assert_no_hooks):
    document = to_html(stack_capture(assert_no_hooks, layers=1, heads=2, length=5))
    p = parse(document)
    for tag, attrs in p.tags:
        assert "src" not in attrs, (tag, attrs)
        assert not attrs.get("href", "#").split("#")[0], (tag, attrs)  # only in-page links
        assert tag not in ("link", "iframe", "object", "embed", "img", "base", "form")
    assert "@import" not in document and not re.search(r"url\((?!data:)", document)
    # a Content-Security-Policy allows exactly the one inline program, by its hash
    csp = next(attrs["content"] for tag, attrs in p.tags if attrs.get("http-equiv") == "Content-Security-Policy")
    programs = [text for attrs, text in p.scripts if not attrs.get("type")]
    assert len(programs) == 1
    digest = base64.b64encode(hashlib.sha256(programs[0].encode()).digest()).decode()
    assert f"script-src 'sha256-{digest}'" in csp and "default-src 'none'" in csp


def test_hostile_text_cannot_leave_its_element(assert_no_hooks):
    hostile = ["</script><script>alert(1)</script>", "<!--", '"><img src=x onerror=alert(2)>', "\u2028", "&lt;"]
    cap = stack_capture(assert_no_hooks, layers=1, heads=1, length=len(hostile), batch=1, padded=False)
    checks = CheckResult(
        (Violation("causal", "error", "layers.0", 0, head=0, message="<img src=y onerror=alert(3)>"),), ("causal",), 1
    )
    document = to_html(cap, tokens=hostile, title="<script>alert(4)</script>", checks=checks)
    p = parse(document)
    assert [t for t, _ in p.tags].count("img") == 0
    assert len(p.scripts) == document.count("</script>")  # no script element was closed early or added
    meta, _ = report_meta(document)
    assert meta["tokens"] == [[display_token(t) for t in hostile]]  # as drawn: U+2028 written \u2028
    json_text = next(text for attrs, text in p.scripts if attrs.get("id") == "attnprobe-meta")
    assert "<" not in json_text and ">" not in json_text and "&" not in json_text


def test_blobs_hold_the_exact_float32_values(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=2, heads=3, length=6, batch=2)
    meta, blobs = report_meta(to_html(cap, batch=1))
    rec = cap[1]
    r = meta["records"][1]
    assert (r["layer"], r["heads"], r["tq"], r["tk"]) == (1, [0, 1, 2], 6, 6)
    src = r["sources"][0]
    for i in range(3):
        weights = decode_floats(blobs[src["weights"][i]], 36, "exact").reshape(6, 6)
        np.testing.assert_array_equal(weights.view(np.uint32), rec.weights[1, i].numpy().view(np.uint32))
        scores = decode_floats(blobs[src["scores"][i]], 36, "exact").reshape(6, 6)
        allowed = rec.allowed[1, 0].numpy()
        np.testing.assert_array_equal(scores[allowed], rec.scores[1, i].numpy()[allowed])
        assert np.isnan(scores[~allowed]).all()  # masked scores are not stored by default


def test_masked_scores_and_bfloat16_options(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=1, heads=1, length=6, batch=1, padded=False)
    meta, blobs = report_meta(to_html(cap, masked_scores=True))
    scores = decode_floats(blobs[meta["records"][0]["sources"][0]["scores"][0]], 36, "exact").reshape(6, 6)
    np.testing.assert_array_equal(scores, cap[0].scores[0, 0].numpy())
    assert meta["maskedScores"] is True

    document = to_html(cap, precision="bfloat16")
    meta, blobs = report_meta(document)
    weights = decode_floats(blobs[meta["records"][0]["sources"][0]["weights"][0]], 36, "bfloat16").reshape(6, 6)
    np.testing.assert_array_equal(weights, cap[0].weights[0, 0].to(torch.bfloat16).float().numpy())
    assert meta["precision"] == "bfloat16" and "rounded to bfloat16" in document
    with pytest.raises(AttnprobeError, match="precision must be one of"):
        to_html(cap, precision="float8")


def test_sixteen_bit_captures_are_stored_exactly(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=1, heads=2, length=5, batch=1, dtype=torch.float16)
    meta, blobs = report_meta(to_html(cap))
    src = meta["records"][0]["sources"][0]
    assert src["storedDtype"] == "float16"
    weights = decode_floats(blobs[src["weights"][1]], 25, "exact").reshape(5, 5)
    np.testing.assert_array_equal(weights, cap[0].weights[0, 1].float().numpy())


def test_overview_describes_model_input_and_records(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=2, heads=3, length=5, batch=2)
    document = to_html(cap, tokens=[words(5, "a"), words(5, "b")], batch=1)
    assert "Stack" in document and "layers.0, layers.1" in document
    assert "2 rows; this report shows row 1" in document
    meta, _ = report_meta(document)
    assert meta["tokens"] == [words(5, "b")] and meta["batch"] == 1
    assert "a0" not in document.split("attnprobe-meta")[0]  # only the shown row's tokens
    # row 0 is left-padded by two: its token chips and the calls table say so
    row0 = to_html(cap, tokens=words(5), batch=0)
    assert '<span class="tok pad" title="position 1 (padding)">w1</span>' in row0
    assert '<span class="tok" title="position 2">w2</span>' in row0
    assert "<td>2</td></tr>" in row0 and "<td>2</td></tr>" in document  # padded query rows, all batch rows


def test_summary_table_matches_capture_summary(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=2, heads=2, length=5)
    meta, _ = report_meta(to_html(cap))
    frame = cap.summary()
    for row in frame.itertuples():
        assert meta["summary"][f"{row.layer}-{row.head}"]["entropy"] == pytest.approx(row.entropy, rel=1e-6)


def test_checks_panel_lists_violations_and_flags_heads(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=2, heads=2, length=5, batch=2)
    checks = CheckResult(
        (
            Violation(
                "causal",
                "error",
                "layers.1",
                1,
                head=1,
                batch=0,
                queries=(2,),
                keys=(4,),
                count=1,
                worst=0.5,
                message="weight on a future key",
            ),
            Violation(
                "padding",
                "error",
                "layers.0",
                0,
                head=None,
                batch=1,
                queries=(0,),
                count=1,
                message="record-level finding in another batch row",
            ),
        ),
        ("causal", "padding"),
        2,
        skipped=("output_match: no output captured",),
    )
    document = to_html(cap, checks=checks, batch=0)
    meta, _ = report_meta(document)
    assert meta["flags"]["1-1"]["errors"] == 1 and meta["flags"]["1-1"]["marks"] == [
        {"check": "causal", "queries": [2], "keys": [4]}
    ]
    assert set(meta["flags"]) == {"1-1", "0-0", "0-1"}  # a head-less violation flags every head of its record
    assert meta["flags"]["0-0"]["marks"] == []  # batch row 1 is not shown: nothing to mark
    assert 'href="#head-1-1"' in document and "(batch row 1, not shown here)" in document
    assert "output_match: no output captured" in document
    assert "Checks were not run" in to_html(cap, checks=False)
    with pytest.raises(TypeError, match=r"checks must be an attnprobe\.CheckResult"):
        to_html(cap, checks=[])


def test_checks_panel_counts_more_positions_only_when_the_list_was_cut(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=1, heads=1, length=6, batch=1, padded=False)
    cells = Violation(
        "padding",
        "error",
        "layers.0",
        0,
        head=0,
        batch=0,
        queries=(0, 1),
        keys=(4, 5),
        count=4,
        query_count=2,
        key_count=2,
        message="weight on 4 padded key(s)",
    )
    cut = replace(cells, check="mask", queries=(0, 1), keys=(2,), query_count=5, key_count=3, count=9)
    document = to_html(cap, checks=CheckResult((cells, cut), ("padding", "mask"), 1))
    rows = {}
    for tr in re.findall(r'<tr class="sev-error">(.*?)</tr>', document, re.S):
        texts = [re.sub(r"<[^>]+>", "", c).strip() for c in re.findall(r"<td[^>]*>(.*?)</td>", tr, re.S)]
        rows[texts[0]] = texts
    # 4 offending cells over 2 queries: every query is listed, no "(+2)" claiming more
    assert rows["padding"][3:6] == ["0, 1", "4, 5", "4"]
    assert rows["mask"][3:6] == ["0, 1 (+3 more)", "2 (+2 more)", "9"]


def test_scores_only_and_cross_and_generation_captures(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=1, heads=2, length=5, batch=1, keep=["scores"])
    meta, _ = report_meta(to_html(cap))
    assert meta["records"][0]["sources"][0]["weights"] is None

    cross = cross_capture(assert_no_hooks, queries=5, keys=9)
    meta, _ = report_meta(to_html(cross, tokens=words(5, "q"), key_tokens=words(9, "k")))
    kinds = [(r["kind"], r["tq"], r["tk"]) for r in meta["records"]]
    assert kinds == [("self", 9, 9), ("self", 5, 5), ("cross", 5, 9)]
    labels = [(meta["tokens"][r["qTokens"]][0], meta["tokens"][r["kTokens"]][0]) for r in meta["records"]]
    assert labels == [("k0", "k0"), ("q0", "q0"), ("q0", "k0")]  # the encoder layer runs over the keys' tokens

    steps, full = generation_capture(assert_no_hooks, length=7, prefill=3)
    meta, blobs = report_meta(to_html(steps))
    assert [(r["layer"], r["stitched"], r["tq"]) for r in meta["records"]] == [(0, 5, 7), (1, 5, 7)]
    weights = decode_floats(blobs[meta["records"][1]["sources"][0]["weights"][0]], 49, "exact").reshape(7, 7)
    np.testing.assert_array_equal(weights, full[1].weights[0, 0].numpy())


def test_embedded_json_is_strict_and_keeps_nan_and_infinities(assert_no_hooks):
    from attnprobe.reports.html import script_json, sort_value

    text = script_json({"a": float("inf"), "b": [float("-inf"), float("nan"), 1.5], "c": np.float32("nan"), "t": "NaN"})
    assert "NaN" not in text.replace('"NaN"', "") and "Infinity" not in text.replace('"Infinity"', "").replace(
        '"-Infinity"', ""
    )
    back = strict_loads(text)
    assert (
        back["a"] == float("inf") and back["b"][0] == float("-inf") and np.isnan(back["b"][1]) and back["b"][2] == 1.5
    )
    assert np.isnan(back["c"]) and back["t"] == "NaN"  # a token that reads NaN stays a string
    assert (sort_value(float("inf")), sort_value(float("-inf")), sort_value(0.5)) == ("Infinity", "-Infinity", "0.5")
    # a head whose weights hold NaN: its summary says so instead of failing or going blank
    cap = stack_capture(assert_no_hooks, layers=1, heads=2, length=5, batch=1, padded=False)
    weights = cap[0].weights.clone()
    weights[0, 1, 3, 0] = float("nan")
    meta, _ = report_meta(to_html(attnprobe.Capture([replace(cap[0], weights=weights)], cap.info), checks=False))
    assert meta["records"][0]["sources"][0]["stats"][1]["nonfinite"] == 1
    assert any(isinstance(v, float) and not np.isfinite(v) for v in meta["summary"]["0-1"].values())


def test_a_scores_only_capture_says_why_and_draws_scores(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=2, heads=2, length=5, batch=1, keep=["scores"])
    document = to_html(cap)
    text = re.sub(r"\s+", " ", document)
    assert (
        "Weights (post-softmax) not captured in 2 record(s) (layers 0, 1): weights were not asked for "
        "(keep=[&#39;scores&#39;])"
    ) in text
    assert "The grid and the head views show the pre-softmax scores instead" in text
    assert "thumbnails: pre-softmax scores (no weights captured)" in text
    meta, blobs = report_meta(document)
    src = meta["records"][0]["sources"][0]
    assert src["weights"] is None and len(src["scores"]) == 2
    allowed = cap[0].allowed[0, 0].numpy()
    scores = decode_floats(blobs[src["scores"][1]], 25, "exact").reshape(5, 5)
    np.testing.assert_array_equal(scores[allowed], cap[0].scores[0, 1].numpy()[allowed])
    full = stack_capture(assert_no_hooks, layers=2, heads=2, length=5, batch=1)
    assert "not captured in" not in to_html(full)
    # weights missing because the backend has none: the message says that, not "not asked for"
    bare = attnprobe.Capture([replace(r, weights=None) for r in full], full.info)
    with pytest.warns(attnprobe.AttnprobeWarning, match="came without them"):  # the checks say it too
        text = re.sub(r"\s+", " ", to_html(bare))
    assert "the attention code (backend: attnprobe) computes none" in text and "not asked for" not in text


def test_bad_input_gets_clear_errors(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=1, heads=2, length=5, batch=2)
    with pytest.raises(TypeError, match=r"expected an attnprobe\.Capture"):
        to_html(list(cap))
    with pytest.raises(AttnprobeError, match=r"batch row 3 does not exist .* batch size 2"):
        to_html(cap, batch=3)
    with pytest.raises(AttnprobeError, match=r"tokens has 4 entries but layer 0 .* 5 query positions"):
        to_html(cap, tokens=words(4))
    with pytest.raises(AttnprobeError, match="tokens has 3 rows but the capture has batch size 2"):
        to_html(cap, tokens=[words(5)] * 3)
    with pytest.raises(AttnprobeError, match="not one string"):
        to_html(cap, tokens="hello world")
    with pytest.raises(AttnprobeError, match=r"must hold strings, got 1 \(int\)"):
        to_html(cap, tokens=[words(5), [1, 2, 3, 4, 5]])
    with pytest.raises(AttnprobeError, match=r"100 values .* more than max_values=10.*precision='bfloat16'"):
        to_html(cap, max_values=10)
    qkv_only = stack_capture(assert_no_hooks, layers=1, heads=1, length=4, batch=1, keep=["q", "k"])
    with pytest.raises(AttnprobeError, match="no record has weights or scores"):
        to_html(qkv_only)


def test_a_record_without_a_mask_is_drawn_as_all_allowed_and_says_so(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=1, heads=1, length=4, batch=1)
    bare = attnprobe.Capture([replace(cap[0], allowed=None, query_padding=None)], cap.info)
    meta, blobs = report_meta(to_html(bare))
    src = meta["records"][0]["sources"][0]
    assert src["maskKnown"] is False and src["padding"] == []
    scores = decode_floats(blobs[src["scores"][0]], 16, "exact")
    np.testing.assert_array_equal(scores, cap[0].scores[0, 0].numpy().reshape(-1))  # nothing treated as masked


def test_weight_on_masked_cells_is_counted_not_hidden(assert_no_hooks):
    cap = stack_capture(assert_no_hooks, layers=1, heads=1, length=5, batch=1, padded=False)
    leaky = cap[0].weights.clone()
    leaky[0, 0, 0, 4] = 0.125
    meta, blobs = report_meta(to_html(attnprobe.Capture([replace(cap[0], weights=leaky)], cap.info)))
    src = meta["records"][0]["sources"][0]
    assert src["stats"][0]["leaks"] == 1
    assert decode_floats(blobs[src["weights"][0]], 25, "exact")[4] == np.float32(0.125)


def test_report_runs_the_checks_by_default():
    from checks_helpers import BuggyAttention

    attn = BuggyAttention(8, num_heads=2, causal=True, bug="mask_not_applied")
    with attnprobe.capture(attn) as cap:
        attn(torch.randn(1, 5, 8))
    meta, _ = report_meta(to_html(cap))
    assert meta["flags"] and all(flag["errors"] for flag in meta["flags"].values())  # every head leaks
    clean = attnprobe.MultiHeadAttention(8, num_heads=2, causal=True)
    with attnprobe.capture(clean) as ok:
        clean(torch.randn(1, 5, 8))
    document = to_html(ok)
    assert report_meta(document)[0]["flags"] == {} and "0 error(s)" in document


def test_blob_queue_is_bounded_so_matrices_are_not_all_held_at_once():
    import threading
    import time
    import zlib

    from attnprobe.reports.encoding import Blobs

    lock = threading.Lock()
    queued = {"now": 0, "most": 0}

    def job(i):
        def make():
            time.sleep(0.005)  # slower than the producer, like zlib on a large head
            with lock:
                queued["now"] -= 1
            return bytes([i]) * 100

        return make

    blobs = Blobs(workers=2, pending=3)
    for i in range(20):
        with lock:
            queued["now"] += 1
            queued["most"] = max(queued["most"], queued["now"])
        blobs.add(job(i))
    results = blobs.results()
    assert queued["most"] <= 4  # the bound (3), plus the one being added
    assert [ident for ident, _ in results] == [f"b{i}" for i in range(20)]
    assert zlib.decompress(base64.b64decode(results[7][1])) == bytes([7]) * 100
