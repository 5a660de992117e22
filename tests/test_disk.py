"""Captures on disk: cap.save / attnprobe.load / capture(store=) round-trip everything, memory-map, never unpickle."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
import textwrap
from dataclasses import fields
from pathlib import Path

import pytest
import torch
from hf_helpers import build, inputs
from reports_helpers import Stack, cross_capture, generation_capture, stack_capture, words
from torch_helpers import Head

import attnprobe
from attnprobe.probe.outputs import disk


def assert_same_record(a, b):
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.dtype == y.dtype and x.shape == y.shape, f.name
            assert torch.equal(x, y), f.name
        elif f.name == "meta":
            assert dict(x) == dict(y)
        else:
            assert x == y and type(x) is type(y), (f.name, x, y)


def html_of(cap, **kwargs):
    html = attnprobe.reports.to_html(cap, **kwargs)
    return re.sub(r"in [0-9.]+ s\.", "in _ s.", html)  # the footer says how long the report took


def assert_same_capture(a, b, *, tokens=None, key_tokens=None, **declared):
    assert len(a) == len(b) and dict(a.info) == dict(b.info)
    for x, y in zip(a, b):
        assert_same_record(x, y)
    assert str(attnprobe.check(a, **declared)) == str(attnprobe.check(b, **declared))
    assert attnprobe.check(a, **declared).violations == attnprobe.check(b, **declared).violations
    import pandas.testing

    if any(r.weights is not None or r.scores is not None for r in a):
        pandas.testing.assert_frame_equal(a.to_frame(tokens, key_tokens), b.to_frame(tokens, key_tokens))
        pandas.testing.assert_frame_equal(a.summary(), b.summary())
    assert html_of(a, tokens=tokens, key_tokens=key_tokens) == html_of(b, tokens=tokens, key_tokens=key_tokens)


def tensors_are_file_mapped(record, folder: Path) -> bool:
    """Every tensor of ``record`` lies in a memory mapping of a file under ``folder`` (Linux /proc/self/maps)."""
    maps = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        parts = line.split(maxsplit=5)
        lo, hi = (int(x, 16) for x in parts[0].split("-"))
        maps.append((lo, hi, parts[5] if len(parts) > 5 else ""))
    for f in ("q", "k", "v", "scores", "weights", "output", "allowed", "query_padding"):
        t = getattr(record, f)
        if t is None or not t.numel():
            continue
        p = t.data_ptr()
        if not any(lo <= p < hi and path.startswith(str(folder.parent)) for lo, hi, path in maps):
            return False
    return True


needs_proc = pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="reads /proc/self/maps (Linux)")


# ------------------------------------------------------------------------------------------ round trips
def test_own_modules_with_padding_round_trip(assert_no_hooks, tmp_path):
    cap = stack_capture(assert_no_hooks)
    mask = torch.ones(2, 7, dtype=torch.long)
    mask[0, :2] = 0
    loaded = attnprobe.load(cap.save(tmp_path / "cap"))
    assert_same_capture(cap, loaded, tokens=words(7), causal=True, attention_mask=mask)


def test_cross_attention_and_generation_steps_round_trip(assert_no_hooks, tmp_path):
    cap = cross_capture(assert_no_hooks)
    assert_same_capture(cap, attnprobe.load(cap.save(tmp_path / "cross")), tokens=words(5), key_tokens=words(9, "k"))
    steps, _ = generation_capture(assert_no_hooks)
    loaded = attnprobe.load(steps.save(tmp_path / "steps"))
    assert [r.step for r in loaded] == [r.step for r in steps] and {r.query_offset for r in loaded} == {0, 4, 5, 6, 7}
    assert_same_capture(steps, loaded, tokens=words(8))


def test_selected_heads_and_dtypes_round_trip(assert_no_hooks, tmp_path):
    model = Stack().eval()
    _, cap = attnprobe.run(
        model, torch.randn(2, 7, 12), heads={0: [2, 0], 2: None}, dtype=torch.bfloat16, keep=["weights", "q"]
    )
    loaded = attnprobe.load(cap.save(tmp_path / "c"))
    assert loaded[0].heads == (2, 0) and loaded[0].weights.dtype == torch.bfloat16 and loaded[0].k is None
    assert_same_capture(cap, loaded, tokens=words(7))
    assert loaded.select(heads=[0])[0].weights.shape[1] == 1


def test_hugging_face_gqa_sliding_window_sinks_round_trip(tmp_path):
    model = build("gpt_oss")  # grouped-query attention, a sliding window, attention sinks
    batch = inputs("gpt_oss", padding="left")
    _, cap = attnprobe.run(model, batch)
    assert cap[0].sinks is not None and cap[0].num_kv_heads == 2
    loaded = attnprobe.load(cap.save(tmp_path / "hf"))
    assert_same_capture(cap, loaded, causal=True, attention_mask=batch["attention_mask"])


def test_violations_in_record_meta_round_trip(tmp_path):
    model = Head(bug="same_kv").eval()
    with pytest.warns(attnprobe.AttnprobeWarning):
        with attnprobe.capture(model, modules=[model]) as cap:
            model(torch.randn(2, 6, 16))
    (lint,) = cap[0].meta["lint"]
    loaded = attnprobe.load(cap.save(tmp_path / "lint"))
    assert loaded[0].meta["lint"] == (lint,) and isinstance(loaded[0].meta["lint"][0], attnprobe.Violation)
    assert_same_capture(cap, loaded)


def test_store_writes_what_an_in_memory_capture_holds(assert_no_hooks, tmp_path):
    model = Stack().eval()
    memory = stack_capture(assert_no_hooks, seed=3, model=model)
    stored = stack_capture(assert_no_hooks, seed=3, model=model, store=tmp_path / "run")
    assert (tmp_path / "run" / "index.json").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["run"]  # no staging folder left
    assert_same_capture(memory, stored, tokens=words(7), causal=True)
    assert_same_capture(stored, attnprobe.load(tmp_path / "run"), tokens=words(7), causal=True)


# ------------------------------------------------------------------------------------------ memory
@needs_proc
def test_loaded_tensors_are_memory_mapped_not_read(assert_no_hooks, tmp_path):
    cap = stack_capture(assert_no_hooks)
    loaded = attnprobe.load(cap.save(tmp_path / "cap"))
    assert all(tensors_are_file_mapped(r, tmp_path / "cap") for r in loaded)
    assert not tensors_are_file_mapped(cap[0], tmp_path / "cap")  # the test can fail: in-memory tensors are not


@needs_proc
def test_store_keeps_at_most_one_record_in_memory(tmp_path):
    seen = []

    class Watched(torch.nn.Module):  # after every layer: is every record made so far already on disk?
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([attnprobe.MultiHeadAttention(12, num_heads=3) for _ in range(4)])

        def forward(self, x):
            for layer in self.layers:
                x = x + layer(x)
                seen.append([tensors_are_file_mapped(r, tmp_path / "run") for r in cap])
            return x

    model = Watched().eval()
    with attnprobe.capture(model, store=tmp_path / "run") as cap:
        model(torch.randn(2, 5, 12))
    assert seen == [[True] * n for n in range(1, 5)]
    assert all(tensors_are_file_mapped(r, tmp_path / "run") for r in cap)


@needs_proc
def test_store_peak_memory_is_one_record_not_the_capture(tmp_path):
    """Peak RSS of a store= capture stays within what the forward itself used; an in-memory capture holds all
    its records (anonymous memory, swapped out or not, so a loaded machine cannot hide them)."""
    script = textwrap.dedent("""
        import resource, sys, torch, attnprobe

        def anonymous():  # MiB of anonymous memory, resident or swapped
            status = dict(line.split(":", 1) for line in open("/proc/self/status"))
            return sum(int(status[k].split()[0]) for k in ("RssAnon", "VmSwap")) / 1024

        torch.manual_seed(0)
        layers = torch.nn.ModuleList([attnprobe.MultiHeadAttention(8, num_heads=8) for _ in range(8)])
        x = torch.randn(1, 1024, 8)  # one record: q, k, v, output + 2 x (1, 8, 1024, 1024) float32 = 64 MiB
        with torch.no_grad():
            for layer in layers:  # warm up: the forward's own peak
                layer(x)
            peak, anon = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, anonymous()
            store = sys.argv[1] if sys.argv[1] != "-" else None
            caps = []
            for layer in layers:
                with attnprobe.capture(layer, store=None if store is None else store + str(len(caps))) as cap:
                    layer(x)
                caps.append(cap)
        print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - peak, anonymous() - anon)
    """)
    growth = {}
    for mode, arg in (("disk", str(tmp_path / "r")), ("memory", "-")):
        out = subprocess.run([sys.executable, "-c", script, arg], capture_output=True, text=True, check=True)
        growth[mode] = [float(v) for v in out.stdout.split()]
    record = 64 + 2  # MiB
    assert growth["memory"][1] > 7 * record, growth  # the test can fail: the eight records stay in memory
    assert growth["disk"][1] < record, growth  # the records are file-backed once written
    assert growth["disk"][0] < record, growth  # the record being written fits in what the forward itself used


# ------------------------------------------------------------------------------------------ safety
def test_loading_never_unpickles(assert_no_hooks, tmp_path, monkeypatch):
    cap = stack_capture(assert_no_hooks)
    cap.save(tmp_path / "cap")

    def refuse(*args, **kwargs):
        raise AssertionError("unpickling during load")

    monkeypatch.setattr(pickle, "loads", refuse)
    monkeypatch.setattr(pickle, "load", refuse)
    monkeypatch.setattr(pickle, "Unpickler", refuse)
    monkeypatch.setattr(torch, "load", refuse)
    loaded = attnprobe.load(tmp_path / "cap")
    assert float(sum(r.weights.sum() for r in loaded)) == pytest.approx(float(sum(r.weights.sum() for r in cap)))
    files = sorted(p.relative_to(tmp_path / "cap").as_posix() for p in (tmp_path / "cap").rglob("*") if p.is_file())
    assert files == ["index.json"] + [f"records/{i:06d}.safetensors" for i in range(3)]


def test_existing_paths_are_replaced_only_with_overwrite(assert_no_hooks, tmp_path):
    cap = stack_capture(assert_no_hooks)
    small = cap.select(layers=[0])
    target = tmp_path / "cap"
    cap.save(target)
    with pytest.raises(FileExistsError, match="already holds a capture; pass overwrite=True"):
        small.save(target)
    with pytest.raises(FileExistsError, match="already holds a capture"):
        with attnprobe.capture(Stack(), store=target):  # refused before the model runs
            raise AssertionError("not reached")
    assert len(attnprobe.load(target)) == 3
    small.save(target, overwrite=True)
    assert len(attnprobe.load(target)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cap"]  # the old folder is gone, no staging left

    other = tmp_path / "mine"
    other.mkdir()
    (other / "notes.txt").write_text("keep me")
    for overwrite in (False, True):
        with pytest.raises(FileExistsError, match="folder of other files"):
            cap.save(other, overwrite=overwrite)
    assert (other / "notes.txt").read_text() == "keep me"
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="is a file"):
        cap.save(tmp_path / "file", overwrite=True)

    empty = tmp_path / "empty"
    empty.mkdir()
    assert len(attnprobe.load(cap.save(empty))) == 3  # an empty folder made for it is used

    link = tmp_path / "link"
    link.symlink_to(tmp_path / "nowhere")  # dangling
    with pytest.raises(FileExistsError, match="symlink"):
        cap.save(link)
    assert not (tmp_path / "nowhere").exists()
    cap.save(link, overwrite=True)
    assert link.is_dir() and not link.is_symlink() and not (tmp_path / "nowhere").exists()


def test_a_failed_write_leaves_the_old_capture_and_no_partial_folder(assert_no_hooks, tmp_path, monkeypatch):
    cap = stack_capture(assert_no_hooks)
    target = tmp_path / "cap"
    cap.select(layers=[0]).save(target)
    before = (target / "index.json").read_text()
    import safetensors.torch

    real, calls = safetensors.torch.save_file, []

    def disk_full(tensors, filename, metadata=None):
        calls.append(filename)
        if len(calls) == 2:
            raise OSError(28, "No space left on device")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(safetensors.torch, "save_file", disk_full)
    with pytest.raises(OSError, match="No space left"):
        cap.save(target, overwrite=True)
    assert (target / "index.json").read_text() == before and len(attnprobe.load(target)) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cap"]


def test_a_forward_that_raises_leaves_nothing_on_disk(tmp_path):
    model = Stack().eval()
    with pytest.raises(RuntimeError, match="boom"):  # noqa: PT012  (an error raised through the capture's exit)
        with attnprobe.capture(model, store=tmp_path / "run") as cap:
            model(torch.randn(1, 4, 12))
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    assert len(cap) == 3 and cap[0].weights.sum() > 0  # the records stay usable (and can be saved)
    assert len(attnprobe.load(cap.save(tmp_path / "kept"))) == 3


def test_bad_directories_give_one_line_errors(assert_no_hooks, tmp_path):
    with pytest.raises(FileNotFoundError, match="is not a directory"):
        attnprobe.load(tmp_path / "missing")
    (tmp_path / "plain").mkdir()
    with pytest.raises(disk.CaptureFileError, match=r"no index\.json: not an attnprobe capture"):
        attnprobe.load(tmp_path / "plain")
    cap = stack_capture(assert_no_hooks)
    folder = cap.save(tmp_path / "cap")
    index = json.loads((folder / "index.json").read_text())

    def broken(change, match):
        bad = json.loads(json.dumps(index))
        change(bad)
        (folder / "index.json").write_text(json.dumps(bad))
        with pytest.raises(disk.CaptureFileError, match=match) as info:
            attnprobe.load(folder)
        assert "\n" not in str(info.value)

    broken(lambda i: i.update(version=99), "format version 99")
    broken(lambda i: i.update(format="other"), "not an attnprobe capture index")
    broken(lambda i: i["records"][0].update(file="../../etc/passwd"), "malformed")
    broken(lambda i: i["records"][0]["fields"].update(q={"__pickle__": "x"}), "unknown entry '__pickle__'")
    broken(lambda i: i["records"][0]["fields"].update(future=1), r"fields \['future'\] are unknown")
    broken(lambda i: i["records"][0]["fields"].update(q={"__tensor__": "nope"}), "tensor 'nope' is missing")
    (folder / "index.json").write_text(json.dumps(index))
    (folder / "records" / "000001.safetensors").unlink()
    with pytest.raises(disk.CaptureFileError, match="missing: the capture directory is incomplete"):
        attnprobe.load(folder)
    (folder / "index.json").write_text("{")
    with pytest.raises(disk.CaptureFileError, match="not valid JSON"):
        attnprobe.load(folder)


def test_unsavable_values_are_named(assert_no_hooks, tmp_path):
    from dataclasses import replace

    cap = stack_capture(assert_no_hooks, layers=1)
    odd = attnprobe.Capture([replace(cap[0], meta={"fn": print})], cap.info)
    with pytest.raises(disk.CaptureFileError, match=r"meta\.fn of type builtin_function_or_method"):
        odd.save(tmp_path / "odd")
    assert list(tmp_path.iterdir()) == []


def test_a_capture_that_appeared_meanwhile_is_not_replaced(assert_no_hooks, tmp_path):
    cap = stack_capture(assert_no_hooks)
    model = Stack().eval()
    # why PT012 is off here: the capture's exit raises, after both writes in its block
    with pytest.raises(FileExistsError, match=r"already holds a capture; .* the complete capture is kept in"):  # noqa: PT012
        with attnprobe.capture(model, store=tmp_path / "run"):
            model(torch.randn(1, 4, 12))
            cap.save(tmp_path / "run")  # another writer got there first
    assert len(attnprobe.load(tmp_path / "run")) == 3 and attnprobe.load(tmp_path / "run")[0].query_len == 7
    (kept,) = [p for p in tmp_path.iterdir() if p.name != "run"]
    assert len(attnprobe.load(kept)) == 3 and attnprobe.load(kept)[0].query_len == 4


def test_folders_get_the_permissions_of_any_new_folder(assert_no_hooks, tmp_path):
    cap = stack_capture(assert_no_hooks, layers=1)
    (tmp_path / "plain").mkdir()
    assert cap.save(tmp_path / "cap").stat().st_mode == (tmp_path / "plain").stat().st_mode
