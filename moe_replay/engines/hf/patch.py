"""Instance-level attributes that undo themselves: how the hub hooks a model without touching its class.

Every patched module also gets an instance `__deepcopy__` and `__reduce_ex__` that copy or pickle it with the
patches suspended, so that `copy.deepcopy`, `copy.copy` or `torch.save` of a model (or of a part of it) while a
context is open gives a clean, independent model: no patched methods that still call the original, no hub.
"""

from __future__ import annotations

import copy
import functools
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from torch import nn

MARKER = "_moe_replay_hub"  # set on every wrapper (and on the hooked model): which hub installed it


@dataclass(slots=True)
class _Entry:
    module: nn.Module
    attr: str
    value: Any
    had_own: bool
    previous: Any

    def apply(self) -> None:
        self.module.__dict__[self.attr] = self.value


def remove(entries: list[_Entry]) -> None:
    """Remove the attributes `entries` set, last first: each module's own value before it, or none. One set again by
    someone else since is theirs: left as it is."""
    for e in reversed(entries):
        own = e.module.__dict__
        if own.get(e.attr, e) is not e.value:
            continue
        if e.had_own:
            own[e.attr] = e.previous
        elif e.attr in own:
            del own[e.attr]


class Patches:
    """Set attributes on module instances; `undo()` restores every one, in reverse order.

    Example:
        >>> patches = Patches(owner=hub)  # doctest: +SKIP
        >>> patches.patch(model, "forward", lambda inner: lambda *a, **k: inner(*a, **k))
        >>> patches.undo()  # model.forward is the class's method again
    """

    def __init__(self, owner: object) -> None:
        self.owner = owner
        self._entries: list[_Entry] = []
        self._copyable: set[int] = set()  # ids of the modules given a copy hook

    def __len__(self) -> int:
        return len(self._entries)

    def set(self, module: nn.Module, attr: str, value: Any) -> None:
        """Set `module.<attr>` to `value` on the instance until `undo`."""
        own = module.__dict__
        entry = _Entry(module, attr, value, attr in own, own.get(attr))
        entry.apply()
        self._entries.append(entry)
        if id(module) not in self._copyable:
            self._copyable.add(id(module))
            self.set(module, "__deepcopy__", functools.partial(self._deepcopy, module))
            self.set(module, "__reduce_ex__", functools.partial(self._reduce, module))

    def patch(self, module: nn.Module, attr: str, make: Callable[[Any], Any]) -> None:
        """Set `module.<attr>` to `make(current method)`, marked with the owner; restored by `undo`."""
        inner = getattr(module, attr)
        wrapper = make(inner)
        # what functools.wraps would copy that anything reads (inspect.signature follows __wrapped__)
        wrapper.__wrapped__, wrapper.__doc__ = inner, getattr(inner, "__doc__", None)
        wrapper.__name__ = wrapper.__qualname__ = getattr(inner, "__name__", attr)
        setattr(wrapper, MARKER, self.owner)
        self.set(module, attr, wrapper)

    def undo(self) -> None:
        """Remove every attribute, last first (idempotent), and let go of the owner."""
        entries, self._entries = self._entries, []
        remove(entries)
        self._copyable = set()
        self.owner = None

    @contextmanager
    def suspended(self) -> Iterator[None]:
        """Remove every attribute for the duration of the block, then set them again."""
        remove(self._entries)
        try:
            yield
        finally:
            for entry in self._entries:
                entry.apply()

    def _deepcopy(self, module: nn.Module, memo: dict[int, Any]) -> nn.Module:
        with self.suspended():
            return copy.deepcopy(module, memo)

    def _reduce(self, module: nn.Module, protocol: int) -> Any:
        """`module.__reduce_ex__` (pickling, `torch.save`, `copy.copy`): its reduction with the patches suspended, its
        state copied as it is then, so that a saved or copied model holds no patched method and no hub. The reduction
        is the one the module has under these patches (another `Patches`' below them leaves
        its own out in turn), else its class's."""
        with self.suspended():
            below = module.__dict__.get("__reduce_ex__")
            reduced = below(protocol) if below is not None else type(module).__reduce_ex__(module, protocol)
            if isinstance(reduced, tuple) and len(reduced) > 2 and reduced[2] is module.__dict__:
                reduced = (*reduced[:2], dict(module.__dict__), *reduced[3:])
        return reduced


def patched_by(method: Any) -> object | None:
    """The owner of the patch `method` is, or None for a method that is not one of ours."""
    return getattr(method, MARKER, None)


def drop_stale(model: nn.Module, owner: object) -> None:
    """Remove what an owner that is not this model's (a shallow copy shares the original's instance attributes) left
    in `model.__dict__`: its marker, patched methods and copy hook."""
    for attr, value in list(model.__dict__.items()):
        if attr in (MARKER, "__deepcopy__", "__reduce_ex__") or patched_by(value) is owner:
            del model.__dict__[attr]
