"""`python -m qfuse` is the `qfuse` command."""

from .cli import main

raise SystemExit(main())
