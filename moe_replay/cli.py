"""The `moe-replay` command line."""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from . import __version__, cli_drift, cli_train


def main(argv: Sequence[str] | None = None) -> int:
    """Run the `moe-replay` command line.

    Example:
        $ moe-replay demo
    """
    parser = argparse.ArgumentParser(prog="moe-replay", description="Routing Replay for RL on Mixture-of-Experts LMs.")
    parser.add_argument("--version", action="version", version=f"moe-replay {__version__}")
    sub = parser.add_subparsers(dest="command")
    demo = sub.add_parser("demo", help="record routes while sampling from a tiny MoE, update it, replay them")
    demo.add_argument("--seed", type=int, default=0)
    demo.add_argument("--lr", type=float, default=1e-4, help="learning rate of the one Adam step (default 1e-4)")
    cli_drift.add_parser(sub)
    cli_train.add_parser(sub)
    args = parser.parse_args(argv)
    if args.command == "demo":
        from .demo import run

        run(seed=args.seed, lr=args.lr)
        return 0
    if args.command == "drift":
        return cli_drift.run(args)
    if args.command == "train":
        return cli_train.run(args)
    parser.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
