"""One module per `qfuse` command, each owning its parser: `add_parser(sub)` adds the
subcommand and its flags, `run(args)` does the work (importing the modules that hold it
only then, so `qfuse --help` stays quick). `qfuse/cli.py` routes; `flags.py` holds the
flags and helpers several commands share."""
