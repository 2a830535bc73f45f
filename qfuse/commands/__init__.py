"""The `qfuse` command: the console script (`console.py`, Ctrl-C quiet from its first
line), the router (`cli.py`), and one module per command, each owning its parser:
`add_parser(sub)` adds the subcommand and its flags, `run(args)` does the work (importing
the modules that hold it only then). `cli.py` lists every command with its help line,
imports only the module of the command that runs (so `qfuse --help` and `--version`
import no torch) and lets Ctrl-C during those imports exit 130 at once; `flags.py` holds
the flags and helpers several commands share. Nothing here may import Triton at module
level (tests/test_no_triton.py)."""
