"""Files attnprobe reads: regular files of a bounded size, checked before they are opened and opened without blocking.

A path given as input (``--file``, ``--data``) or found in a model folder (``config.json``, the tokenizer's files)
may be anything a file system holds: a link to ``/dev/zero`` (endless), a named pipe (an ``open`` that waits for a
writer forever), a socket, a file of many gigabytes. ``regular_file`` refuses all of these from ``os.stat`` alone,
before anything is opened; ``open_regular`` then opens with ``O_NONBLOCK`` (a pipe swapped in after the check does
not block the open) and checks the opened descriptor again with ``os.fstat``, which closes the race between the
check and the open; ``read_regular`` reads at most the limit (a file that grows meanwhile is refused, not read on).

The limits (``LIMITS``) are documented in docs/cli.md; each is far above what a real file of its kind holds.
"""

from __future__ import annotations

import os
import stat
from typing import BinaryIO

from .errors import AttnprobeError
from .selection import format_bytes

MiB = 2**20
GiB = 2**30

#: ``config.json`` and the other small files of a model folder (``generation_config.json``,
#: ``tokenizer_config.json``, ``special_tokens_map.json``, a weights index, a chat template, shipped code).
CONFIG_LIMIT = 16 * MiB
#: A tokenizer's vocabulary files (``tokenizer.json``, ``vocab.txt``/``vocab.json``, ``merges.txt``, a
#: sentencepiece ``*.model``); the largest published ones are about 35 MB.
TOKENIZER_LIMIT = 512 * MiB
#: ``--file`` of ``check``, ``report`` and ``export``: its lines become one padded batch.
TEXT_FILE_LIMIT = 64 * MiB
#: ``scan --data``: read in chunks, never whole.
DATA_FILE_LIMIT = 16 * GiB
#: ``report --image``: a picture file (PIL's own limit on pixels guards what it decodes to).
IMAGE_FILE_LIMIT = 256 * MiB

LIMITS = {
    "config": CONFIG_LIMIT,
    "tokenizer": TOKENIZER_LIMIT,
    "text file": TEXT_FILE_LIMIT,
    "data file": DATA_FILE_LIMIT,
    "image": IMAGE_FILE_LIMIT,
}

#: The tokenizer files of a model folder (``TOKENIZER_LIMIT``).
TOKENIZER_FILES = ("tokenizer.json", "vocab.txt", "vocab.json", "merges.txt", "spiece.model", "tokenizer.model")
TOKENIZER_SUFFIXES = (".model", ".tiktoken", ".bpe")
#: The small files of a model folder that transformers reads (``CONFIG_LIMIT``), and shipped code (``*.py``).
CONFIG_FILES = (
    "config.json",
    "generation_config.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "preprocessor_config.json",
    "processor_config.json",
    "chat_template.json",
    "chat_template.jinja",
    "adapter_config.json",
)
CONFIG_SUFFIXES = (".index.json", ".py")


class InputFileError(AttnprobeError, ValueError):
    """A file to read that is not a regular file of a bounded size (a pipe, a device, a socket, a folder, a file over
    its limit). ``path``: the file; ``kind``: what it is instead, in words (None when it is a regular file that is
    too large); ``size`` and ``limit``: its size and the limit in bytes (None where they do not apply)."""

    path: str | None = None
    kind: str | None = None
    size: int | None = None
    limit: int | None = None

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        kind: str | None = None,
        size: int | None = None,
        limit: int | None = None,
    ) -> None:
        super().__init__(message, problem=message)
        self.path, self.kind, self.size, self.limit = path, kind, size, limit


def file_kind(mode: int) -> str | None:
    """What a file of ``mode`` (``st_mode``) is, in words, when it is not a regular file; None for a regular file."""
    if stat.S_ISREG(mode):
        return None
    kinds = (
        (stat.S_ISFIFO, "a named pipe (FIFO)"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISDIR, "a folder"),
    )
    return next((name for test, name in kinds if test(mode)), "not a regular file")


def _check(info: os.stat_result, path: str, what: str, limit: int | None) -> None:
    kind = file_kind(info.st_mode)
    if kind is not None:
        raise InputFileError(
            f"{what} {path!r} is {kind}, not a regular file: give a file (attnprobe never reads pipes, devices or "
            "sockets, also not through a link)",
            path=path,
            kind=kind,
        )
    if limit is not None and info.st_size > limit:
        raise InputFileError(
            f"{what} {path!r} is {format_bytes(info.st_size)}, over attnprobe's limit of {format_bytes(limit)} for "
            f"a {what}: give a smaller file",
            path=path,
            size=info.st_size,
            limit=limit,
        )


def regular_file(path: str | os.PathLike, *, what: str, limit: int | None) -> os.stat_result:
    """``os.stat`` of ``path`` (links followed: a link to ``/dev/zero`` is a character device), refused with an
    ``InputFileError`` when it is not a regular file or is larger than ``limit`` bytes (None: any size). Opens
    nothing. ``what`` names the file in the message (``"input file"``, ``"config.json of the model folder"``)."""
    shown = os.fspath(path)
    try:
        info = os.stat(path)
    except FileNotFoundError:
        broken = os.path.islink(path)
        raise InputFileError(
            f"{what} {shown!r} " + ("is a link to nothing (its target does not exist)" if broken else "does not exist"),
            path=str(shown),
            kind="a broken link" if broken else None,
        ) from None
    _check(info, str(shown), what, limit)
    return info


def open_regular(path: str | os.PathLike, *, what: str, limit: int | None) -> BinaryIO:
    """``path`` opened for reading in binary, once ``regular_file`` allows it: opened without blocking (a pipe put
    there since the check opens at once instead of waiting for a writer) and refused when the opened descriptor is
    not a regular file of at most ``limit`` bytes (``os.fstat``: what was opened, not what the name points to now)."""
    regular_file(path, what=what, limit=limit)
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    fd = os.open(path, flags | getattr(os, "O_BINARY", 0))
    try:
        _check(os.fstat(fd), os.fspath(path), what, limit)
        if hasattr(os, "set_blocking"):
            os.set_blocking(fd, True)  # a regular file: reads never wait anyway; buffered reads expect blocking
        return os.fdopen(fd, "rb")
    except BaseException:
        os.close(fd)
        raise


def read_regular(path: str | os.PathLike, *, what: str, limit: int) -> bytes:
    """The bytes of ``path`` (``open_regular``), at most ``limit`` of them: a file that grew past the limit since
    it was checked is refused, not read on."""
    with open_regular(path, what=what, limit=limit) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise InputFileError(
            f"{what} {os.fspath(path)!r} grew past attnprobe's limit of {format_bytes(limit)} while it was read",
            path=os.fspath(path),
            size=len(data),
            limit=limit,
        )
    return data


def model_file_limit(name: str) -> int | None:
    """The size limit of a model folder's file ``name``: ``TOKENIZER_LIMIT`` for vocabularies, ``CONFIG_LIMIT`` for
    the configs transformers reads, a weights index and shipped code, None (any size) for weights and for files
    transformers does not read (a README, a training log)."""
    lower = name.lower()
    if lower in TOKENIZER_FILES or lower.endswith(TOKENIZER_SUFFIXES):
        return TOKENIZER_LIMIT
    if lower in CONFIG_FILES or lower.endswith(CONFIG_SUFFIXES):
        return CONFIG_LIMIT
    return None


def check_model_folder(folder: str | os.PathLike) -> None:
    """Every file at the top of a model folder (where transformers reads the config, the tokenizer and the
    weights) is a regular file, and the configs and tokenizer files are within their limits (``model_file_limit``);
    a link to nothing named like a file transformers reads is refused too. Nothing is opened."""
    with os.scandir(os.fspath(folder)) as entries:
        names = sorted(str(entry.name) for entry in entries)
    for name in names:
        path = os.path.join(folder, name)
        limit = model_file_limit(name)
        try:
            info = os.stat(path)
        except FileNotFoundError:  # a broken link: only what transformers would read matters
            if limit is not None or name.endswith((".safetensors", ".bin")):
                regular_file(path, what="model file", limit=limit)
            continue
        if stat.S_ISDIR(info.st_mode):
            continue
        _check(info, path, "model file", limit)
