"""Instance-level method replacements that undo themselves: how the hub hooks a model without touching its class."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

from torch import nn

MARKER = "_moe_replay_hub"  # set on every wrapper: which hub installed it


class Patches:
    """Replace `module.<attr>` on the instance by a wrapper; `undo()` restores every one, in reverse order.

    Example:
        >>> patches = Patches(owner=hub)  # doctest: +SKIP
        >>> patches.patch(model, "forward", lambda inner: lambda *a, **k: inner(*a, **k))
        >>> patches.undo()  # model.forward is the class's method again
    """

    def __init__(self, owner: object) -> None:
        self.owner = owner
        self._undo: list[Callable[[], None]] = []

    def __len__(self) -> int:
        return len(self._undo)

    def patch(self, module: nn.Module, attr: str, make: Callable[[Any], Any]) -> None:
        """Set `module.<attr>` to `make(current method)`, marked with the owner; restored by `undo`."""
        had_own = attr in module.__dict__
        previous = module.__dict__.get(attr)
        inner = getattr(module, attr)
        wrapper = functools.wraps(inner)(make(inner))
        setattr(wrapper, MARKER, self.owner)
        module.__dict__[attr] = wrapper

        def undo() -> None:
            if had_own:
                module.__dict__[attr] = previous
            else:
                module.__dict__.pop(attr, None)

        self._undo.append(undo)

    def undo(self) -> None:
        """Remove every patch, last first (idempotent)."""
        while self._undo:
            self._undo.pop()()


def patched_by(method: Any) -> object | None:
    """The owner of the patch `method` is, or None for a method that is not one of ours."""
    return getattr(method, MARKER, None)
