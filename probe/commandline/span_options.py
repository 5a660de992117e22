"""``attnprobe report --spans``: declared spans from the command line.

``--spans sentences``: the sentences of each input text (through the tokenizer's character offsets);
``--spans "question=0:12,document=12:300"``: token ranges ``NAME=START:STOP`` (stop excluded), the same for every
batch row. Every refusal is an ``InputError`` (one line, exit code 2).
"""

from __future__ import annotations

import re

from ..analyses import spans as declared
from ..errors import AttnprobeError
from .loading import InputError, Workload

_RANGE = re.compile(r"\s*([^=,]+?)\s*=\s*(\d+)\s*:\s*(\d+)\s*")


def parse_spans(spec: str | None, work: Workload) -> declared.SpanSet | None:
    """The spans ``--spans`` declares for ``work`` (None without the option).

    Example::

        >>> from attnprobe.probe.commandline.loading import Workload
        >>> import torch
        >>> parse_spans("q=0:2, doc=2:5", Workload(model=torch.nn.Identity(), source="x")).labels
        ('q', 'doc')
    """
    if spec is None:
        return None
    if spec.strip() == "sentences":
        if not work.texts or work.tokenizer is None:
            raise InputError(
                "--spans sentences splits the input texts: give --text or --file to a model with a tokenizer"
            )
        if not getattr(work.tokenizer, "is_fast", False):
            raise InputError(
                "--spans sentences maps tokens to sentences by their character offsets, which only a fast tokenizer "
                "gives: declare token ranges instead, e.g. --spans 'question=0:12,answer=12:40'"
            )
        return declared.sentences(work.texts, work.tokenizer)
    parts = [p for p in spec.split(",") if p.strip()]
    matches = [_RANGE.fullmatch(p) for p in parts]
    if not parts or any(m is None for m in matches):
        raise InputError(
            f"--spans {spec!r}: give 'sentences' or token ranges NAME=START:STOP separated by commas, "
            "e.g. --spans 'question=0:12,document=12:300'"
        )
    try:
        return declared.ranges([(m.group(1), int(m.group(2)), int(m.group(3))) for m in matches if m is not None])
    except AttnprobeError as exc:
        raise InputError(f"--spans {spec!r}: {exc}") from None
