"""How fast, and in how much memory, the hostile inputs of issue 39 are refused.

Run: python benchmarks/bench_hostile.py
Each case of the issue (a 5.2 MB file of 65,000 lines of 80 characters; a model folder whose config.json is a link
to /dev/zero, or a named pipe; a malicious pickle) runs twice:

- as a fresh ``attnprobe`` process under a 6 GiB address-space limit (the whole cost a user waits for: Python,
  torch and transformers start-up included), wall time and peak resident memory (``ru_maxrss`` of the child);
- in one process, under the same limit, that has imported torch and transformers already (``tests/hostile_driver.py``):
  the command's own time and its peak resident memory over the memory before it.

Beside them the start-up alone: ``python -c "import torch, transformers, attnprobe.cli"`` (the interpreter's
baseline), and the smallest real command (``attnprobe check --text hi``). This machine is shared: compare the rows
of one run, not runs of different days.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
sys.path.insert(0, str(TESTS))

from test_safety_hostile import bundled_copy, malicious_weights  # noqa: E402  (the cases the tests build)

LIMIT = 6 << 30


def limited() -> None:
    """The child's address space: ``LIMIT`` (the memory plan sees it; without it, on a machine with more memory free,
    the 65,000 lines are not refused but run, for minutes and tens of GiB)."""
    resource.setrlimit(resource.RLIMIT_AS, (LIMIT, LIMIT))


def fresh(args: list[str], cwd: Path) -> tuple[float, float, int, int]:
    """(wall seconds, peak MiB, exit code, stderr lines) of ``args`` as a new process under ``LIMIT``."""
    start = time.monotonic()
    child = subprocess.Popen(args, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, preexec_fn=limited)
    err = child.stderr.read() if child.stderr else b""
    _, status, usage = os.wait4(child.pid, 0)
    child.returncode = os.waitstatus_to_exitcode(status)
    return time.monotonic() - start, usage.ru_maxrss / 1024, child.returncode, len(err.decode().strip().splitlines())


def build(folder: Path) -> dict[str, list[str]]:
    lines = [f"line {i} " + "the quick brown fox jumps over the lazy dog " * 2 for i in range(65_000)]
    (folder / "lines.txt").write_text("\n".join(line[:80].ljust(80) for line in lines) + "\n")
    zero = bundled_copy(folder, "zero")
    (zero / "config.json").unlink()
    (zero / "config.json").symlink_to("/dev/zero")
    fifo = bundled_copy(folder, "fifo")
    (fifo / "config.json").unlink()
    os.mkfifo(fifo / "config.json")
    malicious_weights(bundled_copy(folder, "evil"), folder / "RAN")
    return {
        "check --text hi (a real command)": ["check", "--text", "hi", "-q"],
        "65,000 lines": ["check", "--file", "lines.txt", "-q"],
        "config.json -> /dev/zero": ["check", "./zero", "-q"],
        "config.json a FIFO": ["check", "./fifo", "-q"],
        "malicious pickle": ["check", "./evil", "-q"],
    }


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        cases = build(folder)
        exe = [sys.executable, "-m", "attnprobe.cli"]
        wall, peak, _, _ = fresh([sys.executable, "-c", "import torch, transformers, attnprobe.cli"], folder)
        print(f"{'case':38} {'fresh s':>8} {'fresh MiB':>10} {'exit':>5} {'lines':>6} {'own s':>7} {'own +MiB':>9}")
        print(f"{'start-up: import torch, transformers':38} {wall:8.1f} {peak:10.0f}")
        (folder / "runs.json").write_text(json.dumps(list(cases.values())))
        env = {**os.environ, "PYTHONPATH": str(TESTS), "MALLOC_ARENA_MAX": "2"}
        driver = [sys.executable, str(TESTS / "hostile_driver.py"), "runs.json", "out.json"]
        subprocess.run(driver, cwd=folder, env=env, preexec_fn=limited, check=True)
        own = json.loads((folder / "out.json").read_text())
        for (name, args), run in zip(cases.items(), own):
            wall, peak, code, lines = fresh([*exe, *args], folder)
            grown = (run["peak_kb"] - run["baseline_kb"]) / 1024
            print(f"{name:38} {wall:8.1f} {peak:10.0f} {code:5} {lines:6} {run['seconds']:7.2f} {grown:9.0f}")
    print(f"load average now: {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs")


if __name__ == "__main__":
    main()
