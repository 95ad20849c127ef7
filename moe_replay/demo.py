"""The `moe-replay demo` tour: `tiny_moe` and `run`, re-exported from `moe_replay.cli.demo`."""

# shim: moved to moe_replay.cli.demo
from .cli.demo import run, tiny_moe

__all__ = ["run", "tiny_moe"]
