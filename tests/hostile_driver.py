"""Runs the ``attnprobe`` command in-process over a list of argument lists, measuring each run: the test of hostile
inputs starts this script in a subprocess with a memory limit (RLIMIT_AS), so that torch and transformers are
imported once for many runs.

    python hostile_driver.py RUNS.json RESULTS.json

RUNS.json: a list of argument lists (``["check", "--file", "x.txt", "-q"]``). RESULTS.json: one object per run:
``code`` (the exit code; ``"hang"`` past ``RUN_SECONDS``; ``"raised"`` when an exception left the command, as
``--debug`` lets it), ``stdout``, ``stderr`` (everything written to the file
descriptors 1 and 2, C libraries included), ``seconds``, ``baseline_kb`` (resident memory before the run, after
the imports) and ``peak_kb`` (the peak while it ran: VmHWM, reset before each run where Linux allows, else the
process's peak so far, which can only be larger).
"""

from __future__ import annotations

import json
import os
import signal
import sys
import tempfile
import time
import traceback

import torch  # noqa: F401  (imported before the baseline is read: the runs are measured, not the imports)
import transformers  # noqa: F401
from transformers import AutoModel, AutoTokenizer  # noqa: F401

from attnprobe.cli import main

RUN_SECONDS = 60


class Hang(Exception):
    pass


def _status_kb(field: str) -> int:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise LookupError(field)


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")  # VmHWM := the current resident size (Linux 4.0+)
    except OSError:
        pass


def _on_alarm(signum, frame):
    raise Hang()


def run_one(args: list[str]) -> dict:
    """One command in this process, its file descriptors 1 and 2 caught in files."""
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        saved = [os.dup(1), os.dup(2)]
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(out.fileno(), 1)
        os.dup2(err.fileno(), 2)
        try:
            code, seconds, baseline = _measured(args)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
            os.close(saved[0])
            os.close(saved[1])
        peak = _status_kb("VmHWM")
        texts = [_read(f) for f in (out, err)]
    return {
        "args": args,
        "code": code,
        "stdout": texts[0],
        "stderr": texts[1],
        "seconds": seconds,
        "baseline_kb": baseline,
        "peak_kb": peak,
    }


def _measured(args: list[str]) -> tuple[int | str, float, int]:
    """(exit code, seconds, resident kB before) of ``attnprobe ARGS`` run here, the peak reset before it."""
    _reset_peak()
    baseline = _status_kb("VmRSS")
    start = time.monotonic()
    signal.alarm(RUN_SECONDS)
    try:
        main(args, prog_name="attnprobe")
        code: int | str = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 0 if exc.code is None else 1
    except Hang:
        code = "hang"
    except Exception:  # --debug lets the error through: Python would print it and exit 1
        traceback.print_exc()
        code = "raised"
    finally:
        signal.alarm(0)
    return code, time.monotonic() - start, baseline


def _read(f) -> str:
    f.seek(0)
    return f.read().decode("utf-8", "replace")


if __name__ == "__main__":
    signal.signal(signal.SIGALRM, _on_alarm)
    with open(sys.argv[1], encoding="utf-8") as f:
        runs = json.load(f)
    results = [run_one(args) for args in runs]
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(results, f)
