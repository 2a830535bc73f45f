"""`qfuse chat [MODEL]`: an interactive conversation with a model."""

from __future__ import annotations

from . import flags


def add_parser(sub) -> None:
    p = sub.add_parser("chat", help="an interactive loop")
    p.add_argument("model", nargs="?", default=None,
                   help="checkpoint folder (default: the bundled model)")
    p.add_argument("--system-prompt", default=None,
                   help="a system message opening the conversation")
    flags.add_generation_args(p)


def run(args) -> int:
    flags.chosen_model(args)
    with flags.chosen_tier(args):
        from ..chat import run_chat

        return run_chat(args)
