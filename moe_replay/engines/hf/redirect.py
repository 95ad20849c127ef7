"""Intercept only a router's selecting `torch.topk`, not every torch function of its forward.

A `TorchFunctionMode` sends every op of the router (the gate's linear, softmax, casts, the top-k, the normalisation)
through Python: tens of microseconds per router call on the host. Most routers select their experts with one
`torch.topk(...)` written in their own `forward`, and group-limited ones (DeepSeek-style) pick the groups by another.
For those, the hub runs a copy of that forward whose module-level name `torch` is a proxy: every attribute is
torch's own, except `topk`, which hands the call to the selectors. Which routers qualify is learned from a call under
the mode (`topk_sites`): every top-k over each token's scores (the only ones a selector acts on) is a `torch.topk`
call whose frame is the class's own undecorated `forward`. Other top-k calls (a group's best two scores, ranked over
[tokens, groups, experts per group]) then run as they are. Any other router keeps the mode.
"""

from __future__ import annotations

import sys
import types
from collections.abc import Callable, Sequence
from operator import attrgetter, itemgetter
from typing import Any

import torch
from torch import nn

_TORCH_DIR = torch.__file__.rpartition("/")[0] + "/"


def caller_code() -> types.CodeType | None:
    """The code object of the innermost frame outside torch (and outside this package's interception), i.e. the
    function that called the torch function being intercepted.

    Example:
        >>> caller_code() is not None  # called from a doctest frame
        True
    """
    frame = sys._getframe(1)
    while frame is not None and (
        frame.f_code.co_filename.startswith(_TORCH_DIR) or frame.f_globals.get("__name__", "").startswith(__package__)
    ):
        frame = frame.f_back
    return None if frame is None else frame.f_code


def redirectable(router: nn.Module, sites: list[tuple[Any, types.CodeType | None, bool]]) -> int:
    """How many top-k calls over each token's scores `router` made in one call, if each is a `torch.topk` written
    in its class's own `forward` (whose module-level `torch` the proxy can replace); else 0. `sites`: (torch function,
    caller code, whether it ranked each token's scores) per top-k call seen.

    Example:
        >>> redirectable(router, [(torch.topk, type(router).forward.__code__, True)])  # doctest: +SKIP
        1
    """
    forward = type(router).forward
    ranked = [(func, code) for func, code, per_token in sites if per_token]
    if not ranked or not isinstance(forward, types.FunctionType) or not _torch_names(forward):
        return 0
    return len(ranked) if all(f is torch.topk and c is forward.__code__ for f, c in ranked) else 0


def _torch_names(func: types.FunctionType) -> list[str]:
    """The module-level names through which `func` reaches the torch module (usually just "torch")."""
    return [n for n in _global_names(func.__code__) if func.__globals__.get(n) is torch]


class TorchProxy:
    """torch, as the redirected forward sees it: `topk` is whatever the hub sets for the running call (torch's own
    otherwise); every other attribute is torch's own (those the forward names are set up front, so reading them costs
    a plain attribute lookup)."""

    def __init__(self, names: tuple[str, ...]) -> None:
        for name in names:
            if hasattr(torch, name):
                setattr(self, name, getattr(torch, name))
        self.topk = torch.topk

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _global_names(code: types.CodeType) -> tuple[str, ...]:
    """The names `code` and the code nested in it (comprehensions, lambdas) may read as globals."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names.update(_global_names(const))
    return tuple(sorted(names))


def redirected_forward(forward: types.FunctionType) -> types.FunctionType:
    """A copy of a router class's `forward` whose module-level `torch` is a `TorchProxy` (the copy's `torch_proxy`):
    its `torch.topk` calls go to whatever `torch_proxy.topk` is when they run (call it as `copy(router, ...)`). Its
    module's globals are copied as they are now: `refresh` copies them again.

    Example:
        >>> fast = redirected_forward(type(router).forward)  # doctest: +SKIP
        >>> run_redirected(fast, my_topk, router, (hidden_states,), {})  # its torch.topk runs my_topk  # doctest: +SKIP
    """
    names = _global_names(forward.__code__)
    proxy = TorchProxy(names)
    scope = dict(forward.__globals__)
    for name in _torch_names(forward):
        scope[name] = proxy
    copy = types.FunctionType(forward.__code__, scope, forward.__name__, forward.__defaults__, forward.__closure__)
    copy.__kwdefaults__ = forward.__kwdefaults__
    copy.torch_proxy = proxy
    copy.global_names = names  # (`refresh`)
    copy.torch_names = tuple(n for n in names if n != "topk" and n in proxy.__dict__)
    return copy


def refresh(copy: types.FunctionType, forward: types.FunctionType) -> None:
    """Copy again into the redirected `copy` of `forward` the module globals and torch attributes its code reads, so
    that it runs what `forward` would run now (a kernel library or a user may patch its module between contexts).
    Nothing is copied when they are all what the last refresh copied (told by two C loops: this runs per context).

    Example:
        >>> refresh(fast, type(router).forward)  # doctest: +SKIP
    """
    scope, source, proxy = copy.__globals__, forward.__globals__, copy.torch_proxy
    kept = copy.__dict__.get("refreshed")  # (read globals, their values, names read from builtins, torch's values)
    if kept is not None:
        read, values, builtin, read_torch, torch_values = kept
        try:  # (values compared by identity first: `==` runs only for a value that changed, and may raise)
            if (
                read(source) == values
                and not any(map(source.__contains__, builtin))
                and read_torch(torch) == torch_values
            ):
                return
        except Exception:  # noqa: BLE001 (a changed value whose == raises: copied again)
            pass
    missing, present, builtin = object(), [], []
    for name in copy.global_names:
        value = source.get(name, missing)
        if value is missing:
            scope.pop(name, None)  # (read from builtins, as by `forward`)
            builtin.append(name)
            continue
        scope[name] = proxy if value is torch else value
        present.append(name)
    for name in copy.torch_names:
        setattr(proxy, name, getattr(torch, name))
    read, read_torch = _getter(itemgetter, present), _getter(attrgetter, copy.torch_names)
    copy.refreshed = (read, read(source), tuple(builtin), read_torch, read_torch(torch))


def _getter(make: Callable[..., Any], names: Sequence[str]) -> Callable[[Any], tuple]:
    """`make(*names)` (`itemgetter` or `attrgetter`) that always returns a tuple (the first name read twice: one name
    alone would return the bare value, whose `==` may not be a bool)."""
    return make(*names, names[0]) if names else _nothing


def _nothing(_: object) -> tuple:
    return ()


def run_redirected(
    forward: types.FunctionType, topk: Callable[..., Any], router: nn.Module, args: tuple, kwargs: dict
) -> Any:
    """Run the redirected `forward` of `router` (`redirected_forward`), its `torch.topk(...)` calls going to
    `topk(...)`.

    Example:
        >>> out = run_redirected(fast, my_topk, router, (hidden_states,), {})  # doctest: +SKIP
    """
    proxy = forward.torch_proxy
    previous, proxy.topk = proxy.topk, topk
    try:
        return forward(router, *args, **kwargs)
    finally:
        proxy.topk = previous


class Redirects:
    """One hub's redirected router forwards, per router class forward."""

    def __init__(self) -> None:
        self._forwards: dict[types.FunctionType, types.FunctionType] = {}

    def forward(self, router: nn.Module, inner: Any) -> types.FunctionType | None:
        """The redirected copy of `router`'s class forward, or None if `inner` (what the router's forward is now)
        is not that forward bound to `router`: redirecting would bypass another wrapper."""
        forward = type(router).forward
        if getattr(inner, "__func__", None) is not forward or getattr(inner, "__self__", None) is not router:
            return None
        if not isinstance(forward, types.FunctionType):  # (a compiled or C method has no code to copy)
            return None
        found = self._forwards.get(forward)
        if found is None:
            found = self._forwards[forward] = redirected_forward(forward)
        return found

    def refresh(self) -> None:
        """Copy each redirected forward's globals again (`refresh`): run once per stretch of open contexts."""
        for forward, copy in self._forwards.items():
            refresh(copy, forward)
