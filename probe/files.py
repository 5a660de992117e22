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
from typing import IO

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
            raise OutputError(
                errno.ENAMETOOLONG,
                f"cannot write {shown}: the name is {size} bytes long; "
                "most file systems allow 255: give a shorter name",
            )
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
            raise OutputError(
                errno.EEXIST,
                f"{p} exists and is not a regular file (a device, pipe or socket); give the name of a file to write",
            )
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
    reasons: dict[int | None, str] = {
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


def _move_into_place(temp: Path, target: Path, overwrite: bool) -> None:
    if overwrite:
        os.replace(temp, target)  # atomic; replaces a symlink itself, never its target
        return
    try:  # a hard link fails if the target appeared since the check: no-clobber without a race
        os.link(temp, target, follow_symlinks=False)
    except FileExistsError:
        raise FileExistsError(
            f"{target} appeared while writing; pass overwrite=True (--overwrite) to replace it"
        ) from None
    except OSError:  # a file system without hard links (FAT, some network shares): check, then rename
        if os.path.lexists(target):
            raise FileExistsError(f"{target} already exists; pass overwrite=True (--overwrite) to replace it") from None
        os.replace(temp, target)
        return
    os.unlink(temp)


class atomic_open:
    """Open a temporary file next to ``path`` for writing; on a clean exit move it to ``path``.

    ``mode`` is ``"w"`` (text) or ``"wb"`` (bytes). On any exception, KeyboardInterrupt included,
    the temporary file is removed, ``path`` is untouched and the exception propagates; OS errors
    (full disk, permission, name too long) become an ``OutputError`` naming the file and the reason.

    A class, not a generator: a Ctrl-C that lands inside ``contextlib``'s ``__enter__``, after the temporary
    file is made and before the ``with`` block starts, would skip the generator's cleanup and leave the file
    behind. Here the name is chosen before the file is made, and ``__enter__`` removes it on any exception,
    including one that lands just after ``os.open`` returned.
    """

    def __init__(
        self,
        path,
        mode: str = "wb",
        *,
        overwrite: bool = False,
        encoding: str | None = None,
        errors: str | None = None,
        newline: str | None = None,
    ) -> None:
        if mode not in ("w", "wb"):
            raise ValueError(f"atomic_open writes only: mode 'w' or 'wb', not {mode!r}")
        self.path, self.mode, self.overwrite = path, mode, overwrite
        text = "b" not in mode  # a binary file takes no encoding, errors or newline: they stay None
        self.encoding, self.errors, self.newline = (encoding, errors, newline) if text else (None, None, None)
        self.temp: Path | None = None  # the temporary file, from the moment its name is chosen
        self.file: IO | None = None

    def __enter__(self) -> IO:
        self.target = target_path(self.path, overwrite=self.overwrite)
        try:
            fd = self._create()
            self.file = os.fdopen(fd, self.mode, encoding=self.encoding, errors=self.errors, newline=self.newline)
            return self.file
        except BaseException as exc:
            self._fail(exc)
            raise

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None:
            self._fail(exc)
            return  # the exception propagates as it is
        file, temp = self.file, self.temp
        if file is None or temp is None:
            raise RuntimeError("atomic_open: __exit__ without a successful __enter__")
        try:
            file.flush()
            os.fsync(file.fileno())  # the data is on disk before the name points at it
            file.close()
            _move_into_place(temp, self.target, self.overwrite)
        except BaseException as exc:
            self._fail(exc)
            raise

    def _create(self) -> int:
        folder = self.target.parent
        for _ in range(100):
            self.temp = folder / f"{TEMP_PREFIX}{secrets.token_hex(6)}{TEMP_SUFFIX}"
            try:  # 0o666 and the umask, as for any new file (mkstemp would make it private: 0o600)
                return os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
            except FileExistsError:
                self.temp = None  # another's file: never removed
        raise FileExistsError(f"could not create a temporary file in {folder}")  # pragma: no cover

    def _discard(self) -> None:
        """Close and remove the temporary file (gone already once it was moved into place)."""
        if self.file is not None:
            with contextlib.suppress(OSError):
                self.file.close()
        if self.temp is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.temp)

    def _fail(self, exc: BaseException) -> None:
        """Remove the temporary file; an OS error (full disk, permission, ...) is raised again as an ``OutputError``
        naming the file and the reason, anything else is left for the caller to raise as it is."""
        self._discard()
        if isinstance(exc, OSError) and not isinstance(exc, (AttnprobeError, FileExistsError)):
            raise _explain(exc, self.target) from exc


def write_atomic(path, data: str | bytes, *, overwrite: bool = False, encoding: str = "utf-8") -> Path:
    """Write ``data`` (text or bytes) to ``path`` atomically; returns the path."""
    if isinstance(data, str):
        with atomic_open(path, "w", overwrite=overwrite, encoding=encoding, newline="") as f:
            f.write(data)
    else:
        with atomic_open(path, "wb", overwrite=overwrite) as f:
            f.write(data)
    return Path(os.fspath(path))
