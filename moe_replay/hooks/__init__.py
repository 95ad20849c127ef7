"""Shim: moved to `moe_replay.engines.hf` (kept so that `moe_replay.hooks` imports keep working)."""

from ..engines.hf import *  # noqa: F403
from ..engines.hf import __all__  # noqa: F401
