"""Every exception moe-replay raises on bad input, shared by all engines. Each is a `ValueError`.

Example:
    >>> from moe_replay.errors import ReplayError
    >>> issubclass(ReplayError, ValueError)
    True
"""

from __future__ import annotations


class ReplayError(ValueError):
    """Routes could not be recorded or applied on this model or this forward (a replay is never a silent no-op)."""


class NestedContextError(ReplayError, RuntimeError):
    """A context cannot open because another open context already holds the same routers (also a RuntimeError)."""


class ForeignThreadError(ReplayError, RuntimeError):
    """A hooked model ran a forward, or a context opened on it, in another thread than the one whose open context
    hooked it: its router calls would land in that thread's steps (also a RuntimeError)."""


class UnsupportedModelError(ValueError):
    """The model has no router moe-replay can find, or its routing (family, configuration) cannot be recorded or
    replayed."""


class UnsupportedGenerationError(ValueError):
    """A generation mode whose routes cannot be placed on the output sequences (beam search, assisted decoding)."""


class RoutesFileError(ValueError):
    """A routes file that is truncated, foreign, or of an unknown format version."""


__all__ = [
    "ForeignThreadError",
    "NestedContextError",
    "ReplayError",
    "RoutesFileError",
    "UnsupportedGenerationError",
    "UnsupportedModelError",
]
