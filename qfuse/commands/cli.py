"""The `qfuse` command line: a router over the commands of this package (info, bench,
generate, chat, quantize, train, serve, gate), each owning its parser.

A mistake the user can fix is one line on stderr, `qfuse: error: ...`, never a
traceback (`qfuse --debug ...` shows it); Ctrl-C exits 130 without one, also while
the package is still importing. QFUSE_* variables are checked once, before the command
runs (`levers.check_environment`). That is why this module imports nothing heavy: torch
and the command modules come in inside `main`, where Ctrl-C is handled, and only the
command that runs defines its flags, so `qfuse --help` and `--version` import no torch.
"""

from __future__ import annotations

import argparse
import importlib
import os
import signal
import sys
import traceback

from .. import __version__, levers
from ..errors import UserError, exit_code, exit_on_interrupt

# In `qfuse --help` order: each command and its line there, which is also the help its
# module's `add_parser` gives (tests/test_cli_startup.py checks they agree). Listing
# them here lets `qfuse --help` name every command without importing any.
COMMANDS = {
    "info": "versions, device, kernels; with a model, its decode plan",
    "bench": "GPU benchmarks (JSON + PNG in bench/results/)",
    "generate": "stream a continuation of a prompt",
    "chat": "an interactive loop",
    "quantize": "write an MLX-layout quantized checkpoint",
    "train": "train a small Gemma 3 text model on the stdlib corpus",
    "serve": "an OpenAI-compatible HTTP server (continuous batching)",
    "gate": "compare a tier with compat on frozen trajectories",
}


def command_module(name: str):
    """The module of command ``name`` (`qfuse.commands.<name>`), imported now."""
    return importlib.import_module(f"{__package__}.{name}")


class _Parser(argparse.ArgumentParser):
    """argparse whose complaints are UserErrors, so they print as the one-line
    `qfuse: error: ...` that every other mistake prints (still exit 2)."""

    def error(self, message: str):
        raise UserError(f"{message} (see `{self.prog} --help`)")


class _Help(argparse.ArgumentDefaultsHelpFormatter):
    """Each option's default in its help, unless the help already says it or there is
    none to say (an unset value, an off switch)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if "default" in text or action.default is None or action.default is False \
                or action.default == []:
            return text
        return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> int:
    """Run `qfuse ARGV` (the process's own arguments when None: the `qfuse` script);
    return the exit code.

    0 on success; 2 for a mistake in the request (argparse's code for a bad
    command line; a path that names nothing too), 1 for an environment error
    (permission denied, a full disk, out of memory), each printed as one line
    (`errors.exit_code`); 130 (128 + SIGINT) after Ctrl-C."""
    # The `qfuse` process itself (not a caller's main(argv)), with Python's Ctrl-C
    # handler (one that ignores SIGINT, as a shell's background job may, is kept).
    own_sigint = argv is None and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    argv = sys.argv[1:] if argv is None else list(argv)
    # Read before parsing, so that even an error while parsing can be traced.
    debug = "--debug" in (argv[: argv.index("--")] if "--" in argv else argv)
    try:
        if own_sigint:
            # Until the command starts, Ctrl-C leaves at once: there is nothing to
            # clean up yet, and a KeyboardInterrupt raised inside an extension's import
            # (torch, numpy) can be swallowed there and resurface as another error.
            exit_on_interrupt()
        command, args = _parse(argv)
        # A bad QFUSE_* variable is one line now, not a failure after loading or per request.
        levers.check_environment()
        if own_sigint:  # the command's own Ctrl-C handling (stats, cleanup) from here
            signal.signal(signal.SIGINT, signal.default_int_handler)
        return command.run(args)
    except KeyboardInterrupt:
        if own_sigint:
            # The process is leaving: a second Ctrl-C (people press it more than once)
            # ends it at once instead of raising in this handler or in the
            # interpreter's shutdown, where it would print a traceback.
            exit_on_interrupt()
        if debug:
            traceback.print_exc()
        print(file=sys.stderr)  # the terminal's ^C left the cursor mid-line
        return 130
    except BrokenPipeError:
        # `qfuse generate ... | head`: the reader left; that is not an error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the exit-time flush does not fail again
        return 0
    except Exception as e:
        if not isinstance(e, (UserError, OSError)) and not _out_of_memory(e):
            raise  # a bug: its traceback is what a report needs
        if debug:
            traceback.print_exc()
        rank = _follower_rank()
        if rank is None:
            print(f"qfuse: error: {_message(e)}", file=sys.stderr)
        elif _own_error(e):
            print(f"qfuse: error: rank {rank}: {_message(e)}", file=sys.stderr)
        return exit_code(e)  # 2: the request's mistake, 1: the environment's


def _out_of_memory(e: BaseException) -> bool:
    """Whether ``e`` is torch's out-of-memory error (torch not imported yet: nothing
    ran on a device, so it is not)."""
    torch = sys.modules.get("torch")
    oom = getattr(torch, "OutOfMemoryError", None)
    return oom is not None and isinstance(e, oom)


def _follower_rank() -> str | None:
    """RANK in a torchrun job's ranks other than 0, else None."""
    if os.environ.get("WORLD_SIZE", "1") not in ("", "1") and \
            os.environ.get("RANK", "0") not in ("", "0"):
        return os.environ["RANK"]
    return None


def _own_error(e: BaseException) -> bool:
    """Whether a rank other than 0 must print ``e`` itself: under torchrun rank 0 speaks
    for all (qfuse.parallel) about the checks every rank makes alike before the process
    group starts, and about a ParallelError (agreed on, or rank 0's own collective
    failing); anything else after the start may be this rank's alone."""
    from ..parallel import comm

    return comm.started() and not isinstance(e, comm.ParallelError)


def _message(e: BaseException) -> str:
    """The error as one line; OSErrors name their file."""
    if _out_of_memory(e):
        return ("out of memory on the device (a smaller --max-kv-size, --max-tokens or "
                "--kv-bits 4 needs less)")
    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        return f"{e.filename}: {e.strerror}"
    return " ".join(str(e).split("\n")).strip() or type(e).__name__


def _chosen_command(argv: list[str]) -> str | None:
    """The command ``argv`` names: its first word that is not an option (the top-level
    options take no value), or the word after ``--``; None without one."""
    for i, word in enumerate(argv):
        if word == "--":
            return argv[i + 1] if i + 1 < len(argv) else None
        if not word.startswith("-"):
            return word
    return None


def _parse(argv: list[str]):
    """The module of the command ``argv`` names and its parsed arguments."""
    parser = _Parser(prog="qfuse", description="Generate, chat, serve, quantize, train and gate "
                                               "quantized LLMs with fused GPU kernels.")
    parser.add_argument("-V", "--version", action="version", version=f"qfuse {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error, not just its one line")
    sub = parser.add_subparsers(dest="command", required=True)
    chosen = _chosen_command(argv)
    for name, line in COMMANDS.items():
        if name == chosen:
            command_module(name).add_parser(sub)
        else:  # listed in `qfuse --help` only: nothing of it runs
            sub.add_parser(name, help=line)
    for p in [parser, *sub.choices.values()]:
        p.formatter_class = _Help
        if p is not parser:  # also after the subcommand; SUPPRESS keeps the top-level value
            p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                           help="show the full traceback of an error")
    args = parser.parse_args(argv)
    from . import flags

    if flags.world_size() > 1 and args.command not in ("generate", "gate", "serve") and not (
            args.command == "bench" and args.name == "e2e_tp"):
        raise UserError(f"`qfuse {args.command}` does not run tensor parallel; under torchrun "
                        "run `generate`, `serve`, `gate` or `bench e2e_tp`")
    return command_module(args.command), args
