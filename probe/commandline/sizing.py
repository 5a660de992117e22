"""Texts sized before they are read whole: ``--text`` and ``--file`` as a number of inputs and the longest one.

The command line turns its texts into one padded batch. Before anything is tokenized it knows how many inputs there
are and which is the longest (``sized_texts``: one bounded pass over ``--file``, ``probe.textlines.measure``), and
before the rest is tokenized, how many tokens the longest has (``tokens_at_least``). The memory plan is decided from
these (the ``plan`` callback of ``encode_texts``); a refusal comes before the work. What passes is tokenized a batch
of lines at a time (``TOKENIZE_CHARS`` characters), the plan checked again as the padded length grows, and padded at
the end: the tokenizer never holds the whole file, and never sees a line longer than ``line_limit`` characters.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from ..reading import TEXT_FILE_LIMIT
from ..textlines import LineShape, measure, read_lines
from .bad_input import InputError

#: Characters given to the tokenizer in one call (a batch of lines, or one window of a long line): its memory is
#: about 150 bytes a character, so about 40 MB.
TOKENIZE_CHARS = 1 << 18
#: Characters a line may hold per position of the model (``line_limit``): no tokenizer's tokens are that long on
#: average, so a longer line cannot fit; it is refused before it is tokenized.
CHARS_PER_POSITION = 64
#: The line limit when the model does not say how many positions it takes.
DEFAULT_LINE_LIMIT = 1 << 20

#: ``plan(rows, length, exact)``: raises when ``rows`` inputs padded to ``length`` tokens cannot be captured;
#: ``exact`` is False while ``length`` is only a lower bound of the padded length.
PlanCheck = Callable[[int, int, bool], None]


@dataclass
class TextInputs:
    """The texts of a command: ``given`` (``--text``, in memory already) then the inputs of ``file`` (non-blank
    lines), known by ``shape`` (their number, the longest) without being held."""

    given: list[str] = field(default_factory=list)
    file: str | None = None
    shape: LineShape | None = None

    @property
    def rows(self) -> int:
        return len(self.given) + (self.shape.inputs if self.shape is not None else 0)

    @property
    def longest(self) -> int:
        """Characters of the longest input."""
        file_longest = self.shape.longest if self.shape is not None else 0
        return max([len(t) for t in self.given] + [file_longest])

    def where_longest(self) -> str:
        """The longest input, in words: ``line 7 of FILE`` or ``--text number 2``."""
        file_longest = self.shape.longest if self.shape is not None else -1
        if self.shape is not None and file_longest >= max((len(t) for t in self.given), default=0):
            return f"line {self.shape.longest_line:,} of {self.file!r}"
        index = max(range(len(self.given)), key=lambda i: len(self.given[i]))
        return f"--text number {index + 1}"

    def longest_text(self) -> str:
        """The text of the longest input (read from the file where it starts)."""
        if self.shape is not None and self.file is not None and self.shape.longest >= max(map(len, self.given or [""])):
            start = self.shape.longest_offset
            return next(read_lines(self.file, limit=TEXT_FILE_LIMIT, start=start, count=1), "")
        return max(self.given, key=len)

    def __iter__(self) -> Iterator[str]:
        yield from self.given
        if self.file is not None:
            yield from read_lines(self.file, limit=TEXT_FILE_LIMIT)

    def __len__(self) -> int:
        return self.rows

    def __bool__(self) -> bool:
        return self.rows > 0


def sized_texts(texts: tuple[str, ...] | list[str], file: str | None) -> TextInputs:
    """``--text`` and ``--file`` as ``TextInputs``: the file checked (a regular file of at most ``TEXT_FILE_LIMIT``
    bytes, UTF-8 text) and measured in one bounded pass; an empty input refused."""
    given = list(texts)
    shape = None
    if file is not None:
        shape = measure(file, limit=TEXT_FILE_LIMIT, what="input file")
        if shape.inputs == 0:
            raise InputError(
                f"input file {file!r} has no text (it is empty or has only blank lines); write one input per line"
            )
    for t in given:
        if not t.strip():
            raise InputError("an input text is empty; give at least one token of text")
    return TextInputs(given=given, file=file, shape=shape)


def line_limit(max_positions: int | None) -> int:
    """The longest input, in characters, the command line tokenizes for a model of ``max_positions`` positions."""
    return DEFAULT_LINE_LIMIT if max_positions is None else max(CHARS_PER_POSITION * max_positions, 4096)


def tokens_at_least(tokenizer: Any, text: str, stop: int | None = None) -> tuple[int, bool]:
    """(how many tokens ``text`` has at least, its special tokens included; whether that is exact), tokenized
    ``TOKENIZE_CHARS`` characters at a time: exact for a text that short; a longer one is cut at white space where it
    can be (pre-tokenizers split there, so the pieces' counts add up), and each cut made inside a word counts one
    token less. Stops counting once ``stop`` tokens are reached."""
    if len(text) <= TOKENIZE_CHARS:
        return len(tokenizer(text)["input_ids"]), True
    count = tokenizer.num_special_tokens_to_add(pair=False)
    start = 0
    while start < len(text) and (stop is None or count < stop):
        end = min(start + TOKENIZE_CHARS, len(text))
        cut = end
        if end < len(text):
            space = max(text.rfind(" ", start, end), text.rfind("\n", start, end), text.rfind("\t", start, end))
            cut = space if space > start else end
        piece = len(tokenizer(text[start:cut], add_special_tokens=False)["input_ids"])
        count += max(piece - (1 if cut == end and end < len(text) else 0), 0)
        start = cut
    return count, False


def _batches(texts: TextInputs) -> Iterator[list[str]]:
    """The texts in batches of about ``TOKENIZE_CHARS`` characters."""
    batch: list[str] = []
    chars = 0
    for text in texts:
        batch.append(text)
        chars += len(text)
        if chars >= TOKENIZE_CHARS:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def encode_texts(
    tokenizer: Any,
    texts: TextInputs,
    *,
    max_positions: tuple[int, str] | None,
    plan: PlanCheck | None = None,
) -> tuple[Any, list[str]]:
    """(the tokenizer's padded batch of ``texts`` as tensors, the texts): the longest input refused when it is over
    ``line_limit`` characters or has more tokens than the model's positions (``max_positions``: (positions, the
    config field)), the plan checked with its token count before the rest is tokenized, then the texts tokenized a
    batch at a time, the plan checked as the padded length grows, and padded at the end (``tokenizer.pad``)."""
    positions = None if max_positions is None else max_positions[0]
    limit = line_limit(positions)
    if texts.longest > limit:
        why = (
            f"more than the model's {positions:,} positions can hold (at most {CHARS_PER_POSITION} a position: "
            f"{limit:,})"
            if positions is not None
            else f"more than the command line takes ({limit:,})"
        )
        raise InputError(
            f"{texts.where_longest()} is {texts.longest:,} characters long, {why}; give shorter inputs, one per line"
        )
    length, exact = tokens_at_least(tokenizer, texts.longest_text(), stop=None if positions is None else positions + 1)
    _fits_positions(length, max_positions, texts.where_longest(), exact=exact)
    if plan is not None:
        plan(texts.rows, length, False)
    columns: dict[str, list] = {}
    kept: list[str] = []
    for batch in _batches(texts):
        encoded = tokenizer(batch)
        sizes = [len(ids) for ids in encoded["input_ids"]]
        if max(sizes) > length:  # the padded length grows: ask again
            length = max(sizes)
            _fits_positions(length, max_positions, f"input number {len(kept) + sizes.index(length) + 1:,}", exact=True)
            if plan is not None:
                plan(texts.rows, length, len(kept) + len(batch) == texts.rows)
        for key, values in encoded.items():
            columns.setdefault(key, []).extend(values)
        kept.extend(batch)
    return tokenizer.pad(columns, padding=True, return_tensors="pt"), kept


def _fits_positions(length: int, max_positions: tuple[int, str] | None, where: str, *, exact: bool) -> None:
    if max_positions is not None and length > max_positions[0]:
        raise InputError(
            f"{where} has {'' if exact else 'at least '}{length:,} tokens but the model takes at most "
            f"{max_positions[0]:,} positions (config.{max_positions[1]}); give a shorter input"
        )
