"""The ``attnprobe`` command: a thin click layer over the Python API."""

from __future__ import annotations

import click

from . import __version__


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="attnprobe")
def main() -> None:
    """Capture, check and report attention in PyTorch and Hugging Face models."""


if __name__ == "__main__":  # pragma: no cover
    main()
