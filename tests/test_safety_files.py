"""Atomic writes (probe/files.py): complete or nothing, the old file intact, links never followed."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from attnprobe.probe import files
from attnprobe.probe.files import OutputError, atomic_open, write_atomic


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(files.TEMP_PREFIX))


def test_writes_text_and_bytes(tmp_path):
    assert write_atomic(tmp_path / "a.txt", "héllo\r\n") == tmp_path / "a.txt"
    assert (tmp_path / "a.txt").read_bytes() == "héllo\r\n".encode()
    write_atomic(tmp_path / "b.bin", b"\x00\x01")
    assert (tmp_path / "b.bin").read_bytes() == b"\x00\x01"
    assert leftovers(tmp_path) == []


def test_new_file_gets_the_usual_permissions(tmp_path):
    old = os.umask(0o022)
    try:
        write_atomic(tmp_path / "a.txt", "x")
    finally:
        os.umask(old)
    assert (tmp_path / "a.txt").stat().st_mode & 0o777 == 0o644  # not mkstemp's private 0o600


def test_existing_file_is_refused_without_overwrite(tmp_path):
    (tmp_path / "a.txt").write_text("old")
    with pytest.raises(FileExistsError, match="overwrite"):
        write_atomic(tmp_path / "a.txt", "new")
    assert (tmp_path / "a.txt").read_text() == "old"
    write_atomic(tmp_path / "a.txt", "new", overwrite=True)
    assert (tmp_path / "a.txt").read_text() == "new"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("dangling", [True, False])
def test_symlink_is_an_existing_path(tmp_path, dangling):
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / "target.html"
    if not dangling:
        target.write_text("theirs")
    folder = tmp_path / "out"
    folder.mkdir()
    (folder / "report.html").symlink_to(target)
    with pytest.raises(FileExistsError, match="symbolic link"):
        write_atomic(folder / "report.html", "mine")
    assert target.exists() is not dangling
    # with overwrite the link itself is replaced; nothing is written where it pointed
    write_atomic(folder / "report.html", "mine", overwrite=True)
    assert not (folder / "report.html").is_symlink()
    assert (folder / "report.html").read_text() == "mine"
    assert (not target.exists()) if dangling else target.read_text() == "theirs"


def test_file_appearing_during_the_write_is_not_replaced(tmp_path):
    with pytest.raises(FileExistsError, match="appeared"):  # noqa: PT012  (raised by atomic_open's exit)
        with atomic_open(tmp_path / "a.txt", "w") as f:
            f.write("mine")
            (tmp_path / "a.txt").write_text("theirs")
    assert (tmp_path / "a.txt").read_text() == "theirs"
    assert leftovers(tmp_path) == []


@pytest.mark.parametrize("failure", [KeyboardInterrupt, RuntimeError])
def test_failure_midway_keeps_the_old_file(tmp_path, failure):
    (tmp_path / "a.txt").write_text("old")
    with pytest.raises(failure):  # noqa: PT012  (an error raised through atomic_open's exit)
        with atomic_open(tmp_path / "a.txt", "w", overwrite=True) as f:
            f.write("half")
            raise failure()
    assert (tmp_path / "a.txt").read_text() == "old"
    assert leftovers(tmp_path) == []


class FillsUp:
    """A file object whose disk is full after ``room`` bytes: what ENOSPC looks like to a writer."""

    def __init__(self, f, room):
        self.f, self.room = f, room

    def write(self, data):
        if len(data) > self.room:
            self.f.write(data[: self.room])
            self.f.flush()
            raise OSError(errno.ENOSPC, "No space left on device")
        self.room -= len(data)
        return self.f.write(data)

    def __getattr__(self, name):
        return getattr(self.f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.f.close()


def test_full_disk_is_one_clear_error_and_keeps_the_old_file(tmp_path, monkeypatch):
    (tmp_path / "a.bin").write_bytes(b"old")
    real_fdopen = os.fdopen
    monkeypatch.setattr(os, "fdopen", lambda *a, **k: FillsUp(real_fdopen(*a, **k), 10))
    with pytest.raises(OutputError, match="disk is full; nothing was written") as info:
        with atomic_open(tmp_path / "a.bin", "wb", overwrite=True) as f:
            f.write(b"x" * 100)
    monkeypatch.undo()
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    assert (tmp_path / "a.bin").read_bytes() == b"old"
    assert leftovers(tmp_path) == []


def test_fsync_failure_keeps_the_old_file(tmp_path, monkeypatch):
    (tmp_path / "a.bin").write_bytes(b"old")

    def failing_fsync(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fsync", failing_fsync)
    with pytest.raises(OutputError, match="Input/output error"):
        write_atomic(tmp_path / "a.bin", b"new", overwrite=True)
    monkeypatch.undo()
    assert (tmp_path / "a.bin").read_bytes() == b"old" and leftovers(tmp_path) == []


def test_long_name_and_missing_folder_are_clear(tmp_path):
    with pytest.raises(OutputError, match="300 bytes long; most file systems allow 255"):
        write_atomic(tmp_path / ("x" * 296 + ".csv"), "x")
    with pytest.raises(FileNotFoundError, match="does not exist; create it first"):
        write_atomic(tmp_path / "nope" / "a.csv", "x")
    with pytest.raises(IsADirectoryError, match="is a folder"):
        write_atomic(tmp_path, "x")


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write anywhere")
def test_unwritable_folder_is_clear(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        with pytest.raises(OutputError, match="permission denied"):
            write_atomic(folder / "a.csv", "x")
    finally:
        folder.chmod(0o700)


def test_device_or_pipe_is_never_replaced(tmp_path):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match="not a regular file"):
        write_atomic(fifo, "x", overwrite=True)
    assert fifo.is_fifo()
    if Path("/dev/null").exists():
        with pytest.raises(OutputError, match="not a regular file"):
            write_atomic("/dev/null", "x", overwrite=True)


def test_ctrl_c_just_after_the_temporary_file_is_made_leaves_nothing(tmp_path, monkeypatch):
    """A signal can land right after ``os.open`` returned, before anyone holds the new file's descriptor."""
    (tmp_path / "a.txt").write_text("old")
    real_open = os.open

    def interrupted_open(*args, **kwargs):
        real_open(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "open", interrupted_open)
    with pytest.raises(KeyboardInterrupt):
        with atomic_open(tmp_path / "a.txt", "w", overwrite=True) as f:
            f.write("new")
    monkeypatch.undo()
    assert (tmp_path / "a.txt").read_text() == "old"
    assert leftovers(tmp_path) == []
