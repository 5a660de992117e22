"""``python -m attnprobe``: the command line (also under ``accelerate launch -m attnprobe`` and ``torchrun -m``)."""

from .cli import main

main()
