"""Ranks that agree on an error and stop together.

A step that can fail on one rank alone (loading its shard, rank 0's prompt or port)
is run with `attempt`, then every rank calls `agree_on_failure`: if any failed, all
stop; rank 0 raises the failure and the others leave quietly (`QuietStop`), since
rank 0 speaks for all. `finish` and `raise_after_shutdown` then end the process after
the process group's teardown, at once when that teardown hung.
"""

from __future__ import annotations

import sys

import torch

from ..errors import UserError
from .comm import Comm, ParallelError, hard_exit, one_line, shutdown


def agree_on_failure(comm: Comm, error: BaseException | None) -> None:
    """All ranks stop together if any failed; rank 0 raises the first failure."""
    failures = comm.agree(None if error is None else one_line(error))
    if not failures:
        return
    if comm.rank == 0:
        if error is not None:
            raise error
        rank, message = failures[0]
        raise ParallelError(f"rank {rank}: {message}")
    raise QuietStop(2)


class QuietStop(Exception):
    """A rank other than 0 stopping with this exit code; rank 0 says why."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def attempt(fn):
    """(fn(), None), or (None, the UserError/OSError/OOM it raised)."""
    try:
        return fn(), None
    except (UserError, OSError, torch.OutOfMemoryError) as e:
        return None, e


def raise_after_shutdown(comm: Comm, e: BaseException) -> None:
    """Shut down, then let ``e`` go on to the CLI; if the teardown hung, print it as the
    CLI would and leave now (the hung thread would hold the interpreter's exit)."""
    if not shutdown():
        who = f"rank {comm.rank}: " if comm.rank else ""
        print(f"qfuse: error: {who}{one_line(e)}", file=sys.stderr)
        hard_exit(2 if isinstance(e, UserError) else 1)
    raise e


def finish(code: int, clean: bool, quiet: bool = False) -> None:
    """Leave with ``code`` now when teardown hung (os._exit), else return normally
    through the CLI (a non-zero code without a traceback)."""
    if not clean:
        hard_exit(code)
    if code:
        raise SystemExit(code)
