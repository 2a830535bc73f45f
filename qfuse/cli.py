"""The `qfuse` command line: a router over the commands of `qfuse/commands/` (info,
bench, generate, chat, quantize, train, serve, gate), each owning its parser.

A mistake the user can fix is one line on stderr, `qfuse: error: ...`, never a
traceback (`qfuse --debug ...` shows it); Ctrl-C exits 130 without one.
"""

from __future__ import annotations

import argparse
import os
import sys
import traceback

import torch

from . import __version__
from .commands import bench, chat, flags, gate, generate, info, quantize, serve, train
from .errors import UserError

# In `qfuse --help` order.
COMMANDS = {"info": info, "bench": bench, "generate": generate, "chat": chat,
            "quantize": quantize, "train": train, "serve": serve, "gate": gate}


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
    """Run `qfuse ARGV`; return the exit code.

    0 on success; 2 for a mistake in the request (argparse's code for a bad
    command line), 1 for an environment error (a file system or out-of-memory
    error), each printed as one line; 130 (128 + SIGINT) after Ctrl-C."""
    argv = sys.argv[1:] if argv is None else list(argv)
    # Read before parsing, so that even an error while parsing can be traced.
    debug = "--debug" in (argv[: argv.index("--")] if "--" in argv else argv)
    try:
        return _main(argv)
    except KeyboardInterrupt:
        if debug:
            traceback.print_exc()
        print(file=sys.stderr)  # the terminal's ^C left the cursor mid-line
        return 130
    except BrokenPipeError:
        # `qfuse generate ... | head`: the reader left; that is not an error.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())  # so the exit-time flush does not fail again
        return 0
    except (UserError, OSError, torch.OutOfMemoryError) as e:
        if debug:
            traceback.print_exc()
        rank = _follower_rank()
        if rank is None:
            print(f"qfuse: error: {_message(e)}", file=sys.stderr)
        elif _own_error(e):
            print(f"qfuse: error: rank {rank}: {_message(e)}", file=sys.stderr)
        return 2 if isinstance(e, UserError) else 1


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
    from .parallel import comm

    return comm.started() and not isinstance(e, comm.ParallelError)


def _message(e: BaseException) -> str:
    """The error as one line; OSErrors name their file."""
    if isinstance(e, torch.OutOfMemoryError):
        return ("out of memory on the device (a smaller --max-kv-size, --max-tokens or "
                "--kv-bits 4 needs less)")
    if isinstance(e, OSError) and e.strerror and e.filename is not None:
        return f"{e.filename}: {e.strerror}"
    return " ".join(str(e).split("\n")).strip() or type(e).__name__


def _main(argv: list[str]) -> int:
    parser = _Parser(prog="qfuse", description="Generate, chat, serve, quantize, train and gate "
                                               "quantized LLMs with fused GPU kernels.")
    parser.add_argument("--version", action="version", version=f"qfuse {__version__}")
    parser.add_argument("--debug", action="store_true",
                        help="show the full traceback of an error, not just its one line")
    sub = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS.values():
        command.add_parser(sub)
    for p in [parser, *sub.choices.values()]:
        p.formatter_class = _Help
        if p is not parser:  # also after the subcommand; SUPPRESS keeps the top-level value
            p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                           help="show the full traceback of an error")
    args = parser.parse_args(argv)
    if flags.world_size() > 1 and args.command not in ("generate", "gate", "serve") and not (
            args.command == "bench" and args.name == "e2e_tp"):
        raise UserError(f"`qfuse {args.command}` does not run tensor parallel; under torchrun "
                        "run `generate`, `serve`, `gate` or `bench e2e_tp`")
    return COMMANDS[args.command].run(args)
