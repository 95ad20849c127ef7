"""Deprecated: megatron-core is an engine, `moe_replay.engines.megatron`. A name read here warns and is that module's.

Example:
    >>> import warnings
    >>> from moe_replay.integrations import megatron
    >>> with warnings.catch_warnings(record=True):
    ...     megatron.replay_routes is __import__("moe_replay.engines.megatron").engines.megatron.replay_routes
    True
"""

from __future__ import annotations

import warnings
from typing import Any


def __getattr__(name: str) -> Any:
    from ..engines import megatron

    if name.startswith("__"):
        raise AttributeError(name)
    warnings.warn(
        f"moe_replay.integrations.megatron.{name} moved to moe_replay.engines.megatron.{name}",
        DeprecationWarning,
        stacklevel=2,
    )
    return getattr(megatron, name)
