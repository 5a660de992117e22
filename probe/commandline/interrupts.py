"""Ctrl-C on the command line: every interrupt ends the command with exit code 130 and one line on stderr.

click's standalone mode would print "Aborted!" and exit 1, the code of "violations found"; a Ctrl-C that lands
while Python runs a finalizer would be printed as "Exception ignored in ..." and the command would go on.
``Commands``, the command group's class, handles both; files being written are left as they were (every writer
writes through ``probe.files``).
"""

from __future__ import annotations

import sys
import threading
from collections.abc import Callable
from typing import Any

import click


class InterruptAgain:
    """An unraisable-exception hook for the length of a command. A Ctrl-C that lands while Python runs a finalizer
    (a generator being closed, a weakref callback) cannot propagate: Python prints "Exception ignored in ..." with
    a traceback, and the command would go on as if nothing had been pressed. Here it is delivered again to the main
    thread, so the command stops with exit code 130 like any other Ctrl-C; every other exception goes to
    ``previous``. Delivered from another thread a moment later: delivered at once, it would land in this hook,
    still inside the finalizer (and one that lands in a finalizer again comes back here). ``pending`` holds the
    deliveries, so that the command's end can cancel one that has not happened yet (``cancel``)."""

    def __init__(self, previous: Callable[[Any], object]) -> None:
        self.previous = previous
        self.pending: list[threading.Timer] = []

    def __call__(self, unraisable: Any) -> None:
        if isinstance(unraisable.exc_value, KeyboardInterrupt):
            import _thread

            later = threading.Timer(0.01, _thread.interrupt_main)
            later.daemon = True
            self.pending.append(later)
            later.start()
            return
        self.previous(unraisable)

    def cancel(self) -> None:
        """The command has ended: nothing is left to interrupt."""
        for later in self.pending:
            later.cancel()


class Commands(click.Group):
    """The command group: Ctrl-C anywhere in a command exits 130 (click would say "Aborted!" and exit 1,
    the code of "violations found")."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except KeyboardInterrupt:
            click.echo("attnprobe: interrupted; files being written were left as they were", err=True)
            raise click.exceptions.Exit(130) from None

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        previous = sys.unraisablehook
        sys.unraisablehook = hook = InterruptAgain(previous)
        try:
            self._standalone(args, prog_name, complete_var, **extra)
        finally:
            sys.unraisablehook = previous
            hook.cancel()

    def _standalone(self, args, prog_name, complete_var, **extra) -> None:
        try:  # click's standalone mode says "Aborted!" and exits 1 for a Ctrl-C outside a command
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except click.exceptions.Abort as exc:
            if isinstance(exc.__cause__, KeyboardInterrupt):
                click.echo("attnprobe: interrupted", err=True)
                sys.exit(130)
            click.echo("Aborted!", err=True)
            sys.exit(1)
        except click.ClickException as exc:
            exc.show()
            sys.exit(exc.exit_code)
        except KeyboardInterrupt:
            sys.exit(130)
        sys.exit(code if isinstance(code, int) else 0)
