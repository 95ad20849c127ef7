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
    shared: Any  # the class's attribute of that name when set (what a wrapper of the class's method wraps)
    cls: type  # the module's class when set
    wraps: bool = False  # a wrapper of the module's method (`Patches.patch`), valid while that method is unchanged

    def apply(self) -> None:
        self.module.__dict__[self.attr] = self.value


def remove(entries: list[_Entry]) -> None:
    """Remove the attributes `entries` set, last first: each module's own value before it, or none."""
    for e in reversed(entries):
        own = e.module.__dict__
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
        self._undone: list[_Entry] = []  # what the last `undo` removed, in the order it was set (see `redo`)
        self._copyable: set[int] = set()  # ids of the modules given a copy hook
        self._undone_copyable: set[int] = set()  # those of `_undone`

    def __len__(self) -> int:
        return len(self._entries)

    def set(self, module: nn.Module, attr: str, value: Any, wraps: bool = False) -> None:
        """Set `module.<attr>` to `value` on the instance until `undo` (`wraps`: the value wraps the method it
        replaces)."""
        own = module.__dict__
        cls = type(module)
        entry = _Entry(module, attr, value, attr in own, own.get(attr), getattr(cls, attr, None), cls, wraps)
        entry.apply()
        self._entries.append(entry)
        if id(module) not in self._copyable:
            self._copyable.add(id(module))
            self.set(module, "__deepcopy__", functools.partial(self._deepcopy, module))
            self.set(module, "__reduce_ex__", functools.partial(self._reduce, module))

    def patch(self, module: nn.Module, attr: str, make: Callable[[Any], Any], kept: dict | None = None) -> None:
        """Set `module.<attr>` to `make(current method)`, marked with the owner; restored by `undo`. With `kept`
        (a dict the owner keeps), the wrapper made for the same module and the same method is reused."""
        own, shared = module.__dict__.get(attr), getattr(type(module), attr, None)
        found = kept.get((id(module), attr)) if kept is not None else None
        if found is not None and found[0] is module and found[1] is own and found[2] is shared:
            self.set(module, attr, found[3], wraps=True)  # it wraps what it wrapped: the module's own or class method
            return
        inner = getattr(module, attr)
        wrapper = make(inner)
        # what functools.wraps would copy that anything reads (inspect.signature follows __wrapped__), set directly:
        # wraps costs more than the rest of a patch, and a context patches about ten methods
        wrapper.__wrapped__, wrapper.__doc__ = inner, getattr(inner, "__doc__", None)
        wrapper.__name__ = wrapper.__qualname__ = getattr(inner, "__name__", attr)
        setattr(wrapper, MARKER, self.owner)
        if kept is not None:
            kept[id(module), attr] = (module, own, shared, wrapper)
        self.set(module, attr, wrapper, wraps=True)

    def undo(self) -> None:
        """Remove every attribute, last first (idempotent)."""
        entries, self._entries = self._entries, []
        remove(entries)
        if entries:
            self._undone, self._undone_copyable = entries, self._copyable
        self._copyable = set()

    def close(self) -> None:
        """Done with these patches (after `undo`): drop what `redo` would set again and the owner, which refer back to
        the owner's wrappers and the owner."""
        self._undone, self._undone_copyable, self.owner = [], set(), None

    def redo(self) -> bool:
        """Set again every attribute the last `undo` removed, if nothing is set now and every module still has, on
        itself and on its class, what it had when the attribute was first set, and a wrapped method's module the same
        class (so every wrapper still wraps what is there); else set nothing. Returns whether it did: a context per
        minibatch then costs one loop, not a patch per method.
        """
        entries = self._undone
        if self._entries or not entries:
            return False
        for e in entries:  # plain loop, as few calls as can be: this runs per context
            own = e.module.__dict__
            if e.attr in own:
                if not e.had_own or own[e.attr] is not e.previous:
                    return False
            elif e.had_own:
                return False
            if e.wraps and (type(e.module) is not e.cls or getattr(e.cls, e.attr, None) is not e.shared):
                return False  # (a class swapped in place, even one that keeps the method, may differ elsewhere)
        for e in entries:
            e.module.__dict__[e.attr] = e.value
        self._entries, self._undone = entries, []
        self._copyable = self._undone_copyable
        return True

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
        is the one the module has under these patches (another `Patches`' below them, a `keep_warm` scope's, leaves
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


def forgotten() -> None:
    """What a pickled hub loads as (a hub holds closures over a live model: it is never saved)."""
    return None


def drop_stale(model: nn.Module, owner: object) -> None:
    """Remove what an owner that is not this model's (a shallow copy shares the original's instance attributes) left
    in `model.__dict__`: its marker, patched methods and copy hook."""
    for attr, value in list(model.__dict__.items()):
        if attr in (MARKER, "__deepcopy__", "__reduce_ex__") or patched_by(value) is owner:
            del model.__dict__[attr]
