"""`python -m qfuse` is the `qfuse` command."""

from .commands.console import main

raise SystemExit(main())
