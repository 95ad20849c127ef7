"""The `moe-replay` command line: parses the arguments and hands them to the subcommand's module."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from .. import __version__
from . import demo, drift, train


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `moe-replay` command line; returns the exit status.

    Example:
        $ moe-replay demo
        >>> main(["demo", "--seed", "1"])  # doctest: +SKIP
        0
    """
    parser = argparse.ArgumentParser(prog="moe-replay", description="Routing Replay for RL on Mixture-of-Experts LMs.")
    parser.add_argument("--version", action="version", version=f"moe-replay {__version__}")
    sub = parser.add_subparsers(dest="command")
    demo.add_parser(sub)
    drift.add_parser(sub)
    train.add_parser(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "demo":
            demo.run(seed=args.seed, lr=args.lr)
            return 0
        if args.command == "drift":
            return drift.run(args)
        if args.command == "train":
            return train.run(args)
    except (OSError, ValueError) as e:  # bad input (a missing file, a setting that does not fit): said, no traceback
        parser.exit(2, f"moe-replay {args.command}: error: {e}\n")
    parser.print_help()
    return 0
