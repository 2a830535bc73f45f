"""The `qfuse` console script: Ctrl-C ends it quietly from its first line on.

The script's own import of the command line (argparse, the error types) comes before
`cli.main` can take SIGINT over, and a Ctrl-C there used to print Python's traceback.
This module imports only `errors` (the standard library's signal handling), takes
SIGINT first, then imports `cli` and hands over to `cli.main`, which keeps the same rule
until the command starts. Only the interpreter's own start-up, before any qfuse code
runs, is left to Python.
"""

from __future__ import annotations

import signal

from ..errors import exit_on_interrupt


def main() -> int:
    """The `qfuse` command (`cli.main` over sys.argv)."""
    # A shell's background job may start with SIGINT ignored: that choice is kept.
    python_handler = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if python_handler:
        exit_on_interrupt()
    from .cli import main as cli_main

    if python_handler:  # as Python left it, so that cli.main sees its own process
        signal.signal(signal.SIGINT, signal.default_int_handler)
    return cli_main()
