"""The `moe-replay` command line: one module per subcommand (`demo`, `drift`, `train`), wired up in `main`."""

from .main import main

__all__ = ["main"]
