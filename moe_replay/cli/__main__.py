"""`python -m moe_replay.cli` runs the `moe-replay` command line."""

from .main import main

raise SystemExit(main())
