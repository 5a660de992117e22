"""Where the command line writes: ``--out`` checked before any work (a name too long, an existing file without
``--overwrite``, a device, a folder that cannot be written), and what ``report`` writes for each ``--format``.

Every refusal is an ``InputError`` (one line, exit code 2); files themselves are written through ``probe.files``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from ..files import OutputError, check_file_name, target_path
from .bad_input import InputError


def report_format(out: str | None, fmt: str | None) -> str:
    """--format, or when it is not given the one --out names: .png -> png, anything else -> html."""
    if fmt is not None:
        return fmt
    if out is not None and not out.endswith(("/", os.sep)) and Path(out).suffix.lower() == ".png":
        return "png"
    return "html"


def report_targets(out: str | None, fmt: str, overwrite: bool) -> dict[str, Path]:
    """Where ``report`` writes: {"html": file, "grid": file, "summary": file}, checked up front."""
    if out is None:
        out = "attnprobe-report.html" if fmt == "html" else "attnprobe-report"
    if not out.strip():
        raise InputError("--out is empty: give a .html file, a .png file or a folder")
    path = checked_name(out)
    suffix = "" if out.endswith(("/", os.sep)) else path.suffix.lower()  # "x.html/" asks for a folder
    if suffix == ".html":
        if fmt not in ("html",):
            raise InputError(f"--out {out!r} is an HTML file but --format {fmt} asks for PNGs: give a folder")
        targets = {"html": path}
    elif suffix == ".png":
        if fmt != "png":
            raise InputError(
                f"--out {out!r} is a PNG file but --format {fmt} asks for HTML: leave --format out, or give a folder"
            )
        targets = {"grid": path}
    elif suffix:
        raise InputError(f"--out {out!r}: give a .html file, a .png file or a folder")
    else:
        if path.exists() and not path.is_dir():
            raise InputError(f"--out {out!r} exists and is not a folder")
        targets = {}
        if fmt in ("html", "all"):
            targets["html"] = path / "report.html"
        if fmt in ("png", "all"):
            targets["grid"] = path / "heads.png"
            targets["summary"] = path / "summary.png"
    for target in targets.values():
        check_output(target, overwrite)
    return targets


def checked_name(out: str) -> Path:
    """--out as a Path, refused in one line (``OutputError``) when a name in it is longer than file systems
    allow."""
    return check_file_name(out)


def check_output(target: Path, overwrite: bool) -> None:
    """Refuse an existing path (a symlink too, unless --overwrite), a device, a name too long, or a folder we
    cannot write, before any work."""
    folder = target.parent
    try:
        while not folder.exists() and folder != folder.parent:
            folder = folder.parent  # the folders below will be created
        if not folder.is_dir():
            raise InputError(f"cannot write {target}: {folder} is not a folder")
        if folder == target.parent:
            target_path(target, overwrite=True)  # a folder, a device or pipe, a name too long: refused
            if not overwrite and os.path.lexists(target):
                link = " (a symbolic link)" if target.is_symlink() else ""
                raise InputError(f"{target} already exists{link}; pass --overwrite to replace it")
        else:  # nothing exists below `folder` yet: only the name can be wrong
            check_file_name(target)
    except (InputError, IsADirectoryError, FileNotFoundError, OutputError):
        raise  # each says in one line what was wrong
    except OSError as exc:
        raise InputError(f"cannot write {target}: {exc.strerror or exc}") from None
    try:  # os.access says yes to root everywhere: creating a file is the real test
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as exc:
        raise InputError(f"cannot write into {folder}: {exc.strerror or exc}") from None
