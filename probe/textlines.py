"""Text files of one input per line, sized before they are read whole.

``measure(path)`` makes one pass over the file in blocks of ``BLOCK`` bytes and keeps no line: it gives the number
of inputs (non-blank lines), the longest one (characters, bytes, line number, where it starts) and, on request, where
every ``mark_every``-th input starts, so that a reader can go straight to a chunk (``read_lines``). Memory stays at
one block whatever the file holds, also for a file of one endless line. The same pass refuses what is not text, with
the place: a NUL byte (a binary file) or bytes that are not UTF-8. A byte-order mark at the start is not part of the
first input.

Two ways to split lines: ``"all"``, every line boundary ``str.splitlines`` knows (``--file``), and ``"universal"``,
``\\n``, ``\\r\\n`` and ``\\r`` only (``scan --data``: a JSON line may hold U+2028 inside a string).
"""

from __future__ import annotations

import codecs
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import BinaryIO

from .reading import InputFileError, open_regular

#: Bytes read at a time.
BLOCK = 1 << 20

_BOM = codecs.BOM_UTF8
_UNIVERSAL = re.compile(r"[^\r\n]*(?:\r\n|\r|\n)|[^\r\n]+")


@dataclass(frozen=True)
class LineShape:
    """What ``measure`` found: ``inputs`` non-blank lines, the longest ``longest`` characters on line
    ``longest_line`` (1-based, blank lines counted) of ``longest_bytes`` bytes, starting at byte ``longest_offset``;
    ``marks``: the byte offset of input 0, ``mark_every``, 2 x ``mark_every``, ... (empty unless asked)."""

    path: str
    inputs: int
    longest: int
    longest_bytes: int
    longest_line: int
    longest_offset: int
    mark_every: int | None = None
    marks: tuple[int, ...] = field(default=(), repr=False)


@dataclass
class _Line:
    number: int
    offset: int
    chars: int = 0
    nbytes: int = 0
    nonblank: bool = False
    parts: list[str] | None = field(default_factory=list)

    def add(self, body: str, keep: int | None) -> None:
        self.chars += len(body)
        self.nbytes += len(body.encode("utf-8", "surrogatepass"))
        self.nonblank = self.nonblank or bool(body.strip())
        if self.parts is not None and (keep is None or self.chars <= keep):
            self.parts.append(body)
        else:
            self.parts = None  # longer than the reader keeps: only its size is known

    @property
    def text(self) -> str | None:
        return None if self.parts is None else "".join(self.parts)


def _split(text: str, breaks: str) -> list[str]:
    return text.splitlines(keepends=True) if breaks == "all" else _UNIVERSAL.findall(text)


def _body(piece: str, breaks: str) -> str:
    """``piece`` without its line break (the whole piece when it has none)."""
    if breaks == "all":
        lines = piece.splitlines()
        return lines[0] if lines else ""
    return piece.rstrip("\r\n")


def _decoded(f: BinaryIO, path: str, what: str, offset: int) -> Iterator[str]:
    """The text of ``f`` from byte ``offset`` on, block by block, refusing NUL bytes and bytes that are not UTF-8; a
    line break ``\\r`` at a block's end waits for the next block (it may be the first half of ``\\r\\n``)."""
    decoder = codecs.getincrementaldecoder("utf-8")()
    held = ""
    while True:
        block = f.read(BLOCK)
        nul = block.find(b"\x00")
        if nul >= 0:
            raise InputFileError(
                f"{what} {path!r} holds a NUL byte (byte {offset + nul:,}): it is binary, not text; give a UTF-8 "
                "text file with one input per line",
                path=path,
                kind="binary",
            )
        try:
            text = held + decoder.decode(block, final=not block)
        except UnicodeDecodeError as exc:
            raise InputFileError(
                f"{what} {path!r} is not UTF-8 text (near byte {offset + max(exc.start, 0):,}: {exc.reason}); "
                "save it as UTF-8",
                path=path,
                kind="not UTF-8",
            ) from None
        held = ""
        if block and text.endswith("\r"):
            text, held = text[:-1], "\r"
        yield text
        offset += len(block)
        if not block:
            return


def _lines(f: BinaryIO, path: str, what: str, *, breaks: str, keep: int | None, start: int = 0) -> Iterator[_Line]:
    """Every line of ``f`` from byte ``start`` (a line's start), as a ``_Line`` with its text when it is at most
    ``keep`` characters long (None: always)."""
    number, offset = 0, start
    if start == 0 and f.read(len(_BOM)) == _BOM:  # a byte-order mark is not part of the first line
        offset = len(_BOM)
    f.seek(offset)
    line: _Line | None = None
    for text in _decoded(f, path, what, offset):
        for piece in _split(text, breaks):
            if line is None:
                number += 1
                line = _Line(number=number, offset=offset)
            body = _body(piece, breaks)
            line.add(body, keep)
            size = len(piece.encode("utf-8", "surrogatepass"))
            offset += size
            if len(body) < len(piece):  # a complete line (its size leaves the break out)
                yield line
                line = None
    if line is not None:
        yield line


def measure(
    path: str | os.PathLike,
    *,
    limit: int,
    what: str = "input file",
    breaks: str = "all",
    mark_every: int | None = None,
    parse: Callable[[int, str], int] | None = None,
    line_chars: int | None = None,
    most: int | None = None,
) -> LineShape:
    """One pass over the text file ``path`` (a regular file of at most ``limit`` bytes: ``reading.open_regular``):
    the number of inputs and the longest one, keeping no line (see the module's docstring). ``parse(line number,
    text)``, when given, reads each input's line (a line over ``line_chars`` characters is refused) and returns the
    input's length in characters, which ``longest`` then counts (a JSON line's text field). ``most``: stop after that
    many inputs."""
    shown = os.fspath(path)
    inputs, marks = 0, []
    longest, size = None, 0
    with open_regular(path, what=what, limit=limit) as f:
        for line in _lines(f, shown, what, breaks=breaks, keep=0 if parse is None else line_chars):
            if not line.nonblank:
                continue
            if mark_every is not None and inputs % mark_every == 0:
                marks.append(line.offset)
            inputs += 1
            chars = line.chars if parse is None else parse(line.number, _whole(line, shown, what, line_chars))
            if longest is None or chars > longest[0]:
                longest, size = (chars, line), line.nbytes
            if most is not None and inputs >= most:
                break
    if longest is None:
        return LineShape(shown, 0, 0, 0, 0, 0, mark_every, ())
    chars, line = longest
    return LineShape(shown, inputs, chars, size, line.number, line.offset, mark_every, tuple(marks))


def _whole(line: _Line, path: str, what: str, line_chars: int | None) -> str:
    text = line.text
    if text is None:
        raise InputFileError(
            f"{what} {path!r}: line {line.number:,} is {line.chars:,} characters long, over attnprobe's limit of "
            f"{line_chars:,} for one line",
            path=path,
            size=line.nbytes,
            limit=line_chars,
        )
    return text


def read_lines(
    path: str | os.PathLike,
    *,
    limit: int,
    what: str = "input file",
    breaks: str = "all",
    start: int = 0,
    count: int | None = None,
) -> Iterator[str]:
    """The inputs (non-blank lines) of ``path`` from byte ``start`` (where a line starts: 0, or an offset
    ``measure`` gave), at most ``count`` of them; the same checks as ``measure``."""
    if count is not None and count <= 0:
        return
    shown, given = os.fspath(path), 0
    with open_regular(path, what=what, limit=limit) as f:
        f.seek(start)
        for line in _lines(f, shown, what, breaks=breaks, keep=None, start=start):
            if not line.nonblank:
                continue
            yield line.text or ""
            given += 1
            if count is not None and given >= count:
                return
