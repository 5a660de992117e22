"""The command line never loses a file: Ctrl-C, a full disk, symlinks, devices and odd names."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from click.testing import CliRunner

from attnprobe.cli import main
from attnprobe.probe import files

TESTS = Path(__file__).resolve().parent
TINY = "cli_factories:tiny"
IDS = ["--ids", "1 2 3 4", "--ids", "5 6"]
OLD = "<html>the old report</html>"


def env():
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")])}


def default_sigint():
    """In the child, before exec: Ctrl-C does what it does in a terminal, also where the test runner was started
    with SIGINT ignored (a background job of a non-interactive shell, as CI may be); Python then installs its own
    handler at start-up."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(files.TEMP_PREFIX))


@pytest.fixture
def cli(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return lambda *args: CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def one_line_error(result, code: int = 2) -> str:
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in result.output, result.output
    return lines[0]


# ------------------------------------------------------------------------------------------- Ctrl-C
# The report is written up to its last byte, then the process stops before the file is moved into
# place (fsync parked); a real SIGINT arrives there, the worst moment for the old file.
PARKED_WRITE = """
import os, sys, time
from pathlib import Path
READY = Path(sys.argv[1])
def parked(fd):
    READY.write_text("writing")
    time.sleep(60)
os.fsync = parked
from attnprobe.cli import main
sys.argv = ["attnprobe"] + sys.argv[2:]
main()
"""


def test_sigint_while_writing_keeps_the_old_report_and_exits_130(tmp_path):
    (tmp_path / "report.html").write_text(OLD)
    ready = tmp_path / "ready"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            PARKED_WRITE,
            str(ready),
            "report",
            TINY,
            *IDS,
            "--out",
            "report.html",
            "--overwrite",
            "-q",
        ],
        cwd=tmp_path,
        env=env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=default_sigint,
    )
    deadline = time.monotonic() + 240
    while not ready.exists() and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert ready.exists(), proc.communicate()
    partial = leftovers(tmp_path)
    assert len(partial) == 1 and (tmp_path / partial[0]).stat().st_size > 1000  # the new report, all but moved
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 130, (out, err)
    assert "Traceback" not in err and err.strip().splitlines() == [
        "attnprobe: interrupted; files being written were left as they were"
    ]
    assert (tmp_path / "report.html").read_text() == OLD
    assert leftovers(tmp_path) == []


def test_sigint_inside_a_finalizer_still_stops_the_command_with_130(tmp_path):
    """Python cannot raise a Ctrl-C that lands in a finalizer: it prints "Exception ignored in ..." with a traceback
    and goes on. The CLI delivers it again, so the command stops like for any other Ctrl-C."""
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "attnprobe.cli",
            "report",
            "cli_factories:interrupted_in_a_finalizer",
            *IDS,
            "--out",
            "report.html",
            "-q",
        ],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        preexec_fn=default_sigint,
        timeout=240,
    )
    assert done.returncode == 130, (done.returncode, done.stderr)
    assert done.stderr.strip().splitlines() == ["attnprobe: interrupted; files being written were left as they were"]
    assert not (tmp_path / "report.html").exists() and leftovers(tmp_path) == []


STARTED = """
import sys, time
from pathlib import Path
import click
from attnprobe.cli import main
args = sys.argv[2:]
warm_up = [a if a != "report.html" else "warm-up.html" for a in args]
try:  # once to the side: every lazy import done (torch, transformers, numpy, jinja2), so the signal lands in the work
    main(warm_up)
except SystemExit as exc:
    assert exc.code == 0, exc.code
def slow_down(frame, event, arg, sleep=time.sleep):  # the work takes ~20 ms; spread it over a second, evenly
    if event == "call":                                # across its Python calls
        sleep(0.00005)
inner = click.Group.main  # what attnprobe's Commands.main calls inside its try
def guarded(self, *args, **kwargs):  # the moments count from inside attnprobe's handling, and only the command is
    Path(sys.argv[1]).write_text("started")  # slowed: a Ctrl-C in the interpreter's own start or exit, before any
    sys.setprofile(slow_down)                # program can catch it, is Python's traceback in every program
    try:
        return inner(self, *args, **kwargs)
    finally:
        sys.setprofile(None)
click.Group.main = guarded
main(args)
"""


def test_sigint_at_random_moments_leaves_old_or_new_never_partial(tmp_path):
    """Ctrl-C as the command starts, a little later, and late: each run leaves the old report or the whole new one.
    The moments count from the start of a second run in the same process, after a first one has done every lazy
    import: a signal landing inside a third-party import (torch's CUDA build on a loaded machine took seconds) is
    not what this test is about, and some libraries swallow it there. They count from inside attnprobe's Ctrl-C
    handling: the oldest-release CI once sent the signal between the marker and the call of the entry point, a
    window every Python program has (a KeyboardInterrupt traceback), which the slowed calls had widened."""
    (tmp_path / "report.html").write_text(OLD)
    codes = []
    for delay in (0.0, 0.5, 1.5):
        started = tmp_path / "started"
        started.unlink(missing_ok=True)
        proc = subprocess.Popen(
            [
                sys.executable,
                "-c",
                STARTED,
                str(started),
                "report",
                TINY,
                *IDS,
                "--out",
                "report.html",
                "--overwrite",
                "-q",
            ],
            cwd=tmp_path,
            env=env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            preexec_fn=default_sigint,
        )
        deadline = time.monotonic() + 240
        while not started.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert started.exists(), proc.communicate()
        time.sleep(delay)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=240)
        codes.append(proc.returncode)
        # 130 from attnprobe; 0 when the command had finished; -SIGINT when it lands while Python shuts down
        assert proc.returncode in (0, 130, -signal.SIGINT), (proc.returncode, err)
        assert "Traceback" not in err, err
        text = (tmp_path / "report.html").read_text()
        assert text == OLD or (text.startswith("<!doctype html>") and text.rstrip().endswith("</html>"))
        assert leftovers(tmp_path) == []
    assert codes[0] == 130, codes  # a signal during the command is always answered with 130


# ---------------------------------------------------------------------------------------- full disk
def test_full_disk_keeps_the_old_file_exit_2(tmp_path):
    """The kernel's file size limit (RLIMIT_FSIZE) fails the write midway, as a full disk does."""
    (tmp_path / "report.html").write_text(OLD)

    def small_files():
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of a kill
        resource.setrlimit(resource.RLIMIT_FSIZE, (20_000, resource.RLIM_INFINITY))

    done = subprocess.run(
        [sys.executable, "-m", "attnprobe.cli", "report", TINY, *IDS, "--out", "report.html", "--overwrite", "-q"],
        cwd=tmp_path,
        env=env(),
        capture_output=True,
        text=True,
        preexec_fn=small_files,
        timeout=240,
    )
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [
        "attnprobe: error: cannot write report.html: the file size limit is reached; nothing was written there"
    ]
    assert (tmp_path / "report.html").read_text() == OLD and leftovers(tmp_path) == []


# ------------------------------------------------------------------------------------- odd targets
@pytest.mark.parametrize("dangling", [True, False])
def test_out_symlink_needs_overwrite_and_is_never_followed(cli, tmp_path, dangling):
    outside = tmp_path / "elsewhere"
    outside.mkdir()
    target = outside / "victim.html"
    if not dangling:
        target.write_text("theirs")
    (tmp_path / "link.html").symlink_to(target)
    line = one_line_error(cli("report", TINY, *IDS, "--out", "link.html"))
    assert line == "attnprobe: error: link.html already exists (a symbolic link); pass --overwrite to replace it"
    assert cli("report", TINY, *IDS, "--out", "link.html", "--overwrite").exit_code == 0
    assert not (tmp_path / "link.html").is_symlink() and "<html" in (tmp_path / "link.html").read_text()
    assert (not target.exists()) if dangling else target.read_text() == "theirs"


def test_long_name_device_and_read_only_place_are_one_line_exit_2(cli, tmp_path):
    name = "r" * 295 + ".html"
    line = one_line_error(cli("report", TINY, *IDS, "--out", name))
    assert "the name is 300 bytes long; most file systems allow 255" in line
    line = one_line_error(cli("export", TINY, *IDS, "--out", "x" * 296 + ".csv"))
    assert "300 bytes long" in line
    line = one_line_error(cli("export", TINY, *IDS, "--out", "sub/" + "x" * 296 + ".csv"))  # folder still to make
    assert "300 bytes long" in line
    for out in ("d" * 300, "d" * 300 + "/x.html", "d" * 300 + "/"):  # a folder name too long
        assert "300 bytes long" in one_line_error(cli("report", TINY, *IDS, "--format", "all", "--out", out))
    if Path("/dev/full").is_char_device():  # a link to a device: the link is replaced, the device never opened
        os.symlink("/dev/full", tmp_path / "full.csv")
        assert "symbolic link" in one_line_error(cli("export", TINY, *IDS, "--out", "full.csv"))
        assert cli("export", TINY, *IDS, "--out", "full.csv", "--overwrite").exit_code == 0
        assert (tmp_path / "full.csv").is_file() and Path("/dev/full").is_char_device()
    fifo = tmp_path / "pipe.csv"
    os.mkfifo(fifo)
    line = one_line_error(cli("export", TINY, *IDS, "--out", fifo, "--overwrite"))
    assert "exists and is not a regular file" in line
    if Path("/proc/self").is_dir():
        line = one_line_error(cli("export", TINY, *IDS, "--out", "/proc/attnprobe.csv"))
        assert line.startswith("attnprobe: error: cannot write") and "/proc" in line


def test_an_os_error_about_the_place_is_the_users_exit_2(cli, tmp_path, monkeypatch):
    import errno

    import attnprobe.probe.outputs.frames as frames

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device", "frame.csv")

    monkeypatch.setattr(frames, "write_frame", full)
    line = one_line_error(cli("export", TINY, *IDS, "--out", "frame.csv"))
    assert line == "attnprobe: error: cannot use frame.csv: No space left on device"
    monkeypatch.setattr(frames, "write_frame", lambda *a, **k: (_ for _ in ()).throw(OSError(errno.EIO, "I/O error")))
    assert (
        one_line_error(cli("export", TINY, *IDS, "--out", "frame.csv"))
        == "attnprobe: error: the system refused: I/O error"
    )


def test_ctrl_c_outside_a_command_also_exits_130(monkeypatch):
    import click

    def interrupted(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(click.Group, "parse_args", interrupted)  # Ctrl-C while the arguments are read
    with pytest.raises(SystemExit) as info:
        main(["info"])
    assert info.value.code == 130
