"""Atomic file writes: every file attnprobe writes appears complete or not at all.

A writer fills a temporary file in the target's own folder and moves it into place at the end. After
a crash, a full disk or Ctrl-C the old file (if any) is intact and no partial file remains. An
existing path, a symlink included (dangling or not), is replaced only with ``overwrite=True``, and
then the link itself is replaced by a regular file: nothing is ever written where a link points.

    >>> import tempfile, pathlib
    >>> folder = pathlib.Path(tempfile.mkdtemp())
    >>> with atomic_open(folder / "a.txt", "w") as f:
    ...     _ = f.write("hello")
    >>> (folder / "a.txt").read_text()
    'hello'
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path
from typing import IO, Iterator

from .errors import AttnprobeError

#: Temporary files start with this (hidden, short: a target name near the 255-byte limit still fits).
TEMP_PREFIX = ".attnprobe-"
TEMP_SUFFIX = ".part"


class OutputError(AttnprobeError, OSError):
    """A file could not be written (full disk, no permission, name too long, ...); nothing was replaced.
    ``errno`` is the system's error number; the message names the file and the reason."""

    def __str__(self) -> str:
        return self.strerror or super().__str__()


def check_file_name(path) -> Path:
    """``path`` as a Path, refused when the name of the file or of a folder on the way is longer than file
    systems allow (255 bytes)."""
    p = Path(os.fspath(path))
    for part in p.parts:
        size = len(os.fsencode(part))
        if size > 255:
            shown = part[:40] + "..." + Path(part).suffix
            raise OutputError(errno.ENAMETOOLONG, f"cannot write {shown}: the name is {size} bytes long; "
                                                  "most file systems allow 255: give a shorter name")
    return p


def target_path(path, *, overwrite: bool) -> Path:
    """``path`` as a Path that may be written: a folder, a device or pipe and a missing parent folder are
    refused, an existing path (also a symlink, dangling or not) unless ``overwrite``; raised before any work."""
    p = check_file_name(path)
    try:
        exists = os.path.lexists(p)
        link = p.is_symlink()
        if exists and not link and p.is_dir():
            raise IsADirectoryError(f"{p} is a folder; give a file name")
        if exists and not link and not p.is_file():
            raise OutputError(errno.EEXIST, f"{p} exists and is not a regular file (a device, pipe or socket); "
                                            "give the name of a file to write")
        if exists and not overwrite:
            what = " (a symbolic link)" if link else ""
            raise FileExistsError(f"{p} already exists{what}; pass overwrite=True (--overwrite) to replace it")
        if not p.parent.is_dir():
            raise FileNotFoundError(f"folder {p.parent} does not exist; create it first")
    except (AttnprobeError, FileExistsError, FileNotFoundError, IsADirectoryError):
        raise
    except OSError as exc:
        raise _explain(exc, p) from None
    return p


def _explain(exc: OSError, target: Path) -> OutputError:
    reasons = {
        errno.ENOSPC: "the disk is full",
        errno.EDQUOT: "the disk quota is exceeded",
        errno.EFBIG: "the file size limit is reached",
        errno.EROFS: "the file system is read-only",
        errno.ENAMETOOLONG: "the file name is too long",
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
    }
    reason = reasons.get(exc.errno, exc.strerror or str(exc))
    return OutputError(exc.errno, f"cannot write {target}: {reason}; nothing was written there")


def _create_temp(folder: Path) -> tuple[int, Path]:
    for _ in range(100):
        temp = folder / f"{TEMP_PREFIX}{secrets.token_hex(6)}{TEMP_SUFFIX}"
        try:  # 0o666 and the umask, as for any new file (mkstemp would make it private: 0o600)
            return os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666), temp
        except FileExistsError:
            continue
    raise FileExistsError(f"could not create a temporary file in {folder}")  # pragma: no cover


def _move_into_place(temp: Path, target: Path, overwrite: bool) -> None:
    if overwrite:
        os.replace(temp, target)  # atomic; replaces a symlink itself, never its target
        return
    try:  # a hard link fails if the target appeared since the check: no-clobber without a race
        os.link(temp, target, follow_symlinks=False)
    except FileExistsError:
        raise FileExistsError(f"{target} appeared while writing; pass overwrite=True (--overwrite) to replace it") from None
    except OSError:  # a file system without hard links (FAT, some network shares): check, then rename
        if os.path.lexists(target):
            raise FileExistsError(f"{target} already exists; pass overwrite=True (--overwrite) to replace it") from None
        os.replace(temp, target)
        return
    os.unlink(temp)


@contextlib.contextmanager
def atomic_open(path, mode: str = "wb", *, overwrite: bool = False, encoding: str | None = None,
                errors: str | None = None, newline: str | None = None) -> Iterator[IO]:
    """Open a temporary file next to ``path`` for writing; on a clean exit move it to ``path``.

    ``mode`` is ``"w"`` (text) or ``"wb"`` (bytes). On any exception, KeyboardInterrupt included,
    the temporary file is removed, ``path`` is untouched and the exception propagates; OS errors
    (full disk, permission, name too long) become an ``OutputError`` naming the file and the reason.
    """
    if mode not in ("w", "wb"):
        raise ValueError(f"atomic_open writes only: mode 'w' or 'wb', not {mode!r}")
    target = target_path(path, overwrite=overwrite)
    try:
        fd, temp = _create_temp(target.parent)
    except OSError as exc:
        raise _explain(exc, target) from None
    try:
        text = "b" not in mode
        with os.fdopen(fd, mode, encoding=encoding if text else None, errors=errors if text else None,
                       newline=newline if text else None) as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # the data is on disk before the name points at it
        _move_into_place(temp, target, overwrite)
    except BaseException as exc:
        with contextlib.suppress(OSError):
            os.unlink(temp)
        if isinstance(exc, OSError) and not isinstance(exc, (AttnprobeError, FileExistsError)):
            raise _explain(exc, target) from exc
        raise


def write_atomic(path, data: str | bytes, *, overwrite: bool = False, encoding: str = "utf-8") -> Path:
    """Write ``data`` (text or bytes) to ``path`` atomically; returns the path."""
    if isinstance(data, str):
        with atomic_open(path, "w", overwrite=overwrite, encoding=encoding, newline="") as f:
            f.write(data)
    else:
        with atomic_open(path, "wb", overwrite=overwrite) as f:
            f.write(data)
    return Path(os.fspath(path))
