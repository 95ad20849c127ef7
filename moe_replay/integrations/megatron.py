"""Shim: moved to `moe_replay.engines.megatron` (megatron-core is an engine, not an integration); kept so that
`moe_replay.integrations.megatron` imports keep working."""

from ..engines.megatron import *  # noqa: F403
from ..engines.megatron import __all__  # noqa: F401
