"""The error a user can fix: the CLI prints it as one line, `qfuse: error: ...`.

Raise `UserError` for anything the user asked for that cannot be done (a missing
folder, a corrupt shard, a bad flag value, a destination that is the source);
bugs stay ordinary exceptions, so they keep their tracebacks.

The exit code says which kind of error ended a command (`exit_code`): 2 for a
mistake in the request, 1 for an error of the environment, 130 after Ctrl-C
(`exit_on_interrupt`: at once, without a traceback). Nothing here imports torch: the
console script and the CLI read this module before they import anything heavy.
"""

from __future__ import annotations

import errno
import os
import signal
import sys

# The exit codes of `qfuse`, one per kind of error (README, "Using it").
USER_MISTAKE = 2  # argparse's code for a bad command line
ENVIRONMENT = 1  # the machine refused: permission denied, a full disk, out of memory
INTERRUPTED = 130  # 128 + SIGINT

# A path that names nothing usable is the request's mistake, whichever check meets it.
_MISSING = (errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ENAMETOOLONG)


class UserError(Exception):
    """A mistake in the user's request; its message alone says what is wrong."""


class RequestError(UserError, ValueError):
    """A generation request that cannot be served. A ValueError too, for callers
    that caught ValueError before it existed."""


def exit_code(e: BaseException) -> int:
    """The exit code of an error printed as one line: USER_MISTAKE for a UserError or
    a path that names nothing (missing, not a folder, a symbolic link loop), else
    ENVIRONMENT (permission denied, a full disk, an I/O error, out of memory)."""
    if isinstance(e, UserError):
        return USER_MISTAKE
    if isinstance(e, OSError) and e.errno in _MISSING:
        return USER_MISTAKE
    return ENVIRONMENT


def utf8_problem(text: str) -> str | None:
    """Why ``text`` is not valid UTF-8 text, or None when it is. Python hands bytes that
    are not UTF-8 over as lone surrogates (argv and, in a C locale, standard input decode
    with surrogateescape), which no tokenizer takes: the byte and where it is."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        char = ord(text[e.start])
        byte = f"byte 0x{char - 0xDC00:02x}" if 0xDC80 <= char <= 0xDCFF else f"U+{char:04X}"
        return f"is not valid UTF-8 ({byte} at character {e.start})"
    return None


def exit_on_interrupt() -> None:
    """From now on SIGINT ends the process with INTERRUPTED at once (os._exit: no
    exception, so no traceback), after a newline (the terminal's ^C left the cursor
    mid-line) and flushing what was printed."""
    def leave(signum, frame):
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError, RuntimeError):  # RuntimeError: a reentrant flush
                pass
        os.write(2, b"\n")
        os._exit(INTERRUPTED)

    signal.signal(signal.SIGINT, leave)
