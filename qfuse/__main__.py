"""`python -m qfuse` is the `qfuse` command."""

from .console import main

raise SystemExit(main())
