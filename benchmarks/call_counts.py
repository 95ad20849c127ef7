"""Counters for `host_cost.py --calls`: the Python and C calls, and the torch functions, that one piece of work makes.

>>> import torch
>>> with TorchCalls() as mode:
...     _ = torch.ones(2).sum()
>>> mode.seen["sum"]
1
"""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Callable

from torch.overrides import TorchFunctionMode


class TorchCalls(TorchFunctionMode):
    """Counts the torch functions called while it is active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter[str] = Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        self.seen[getattr(func, "__name__", str(func))] += 1
        return func(*args, **(kwargs or {}))


def python_calls(fn: Callable[[], object]) -> Counter[str]:
    """Calls made while `fn()` runs, by 'file:function' (C functions as 'file:C:name', file being the caller's)."""
    seen: Counter[str] = Counter()

    def profile(frame, event, arg) -> None:  # noqa: ANN001
        if event == "call":
            seen[f"{frame.f_code.co_filename.rpartition('/')[2]}:{frame.f_code.co_name}"] += 1
        elif event == "c_call":
            seen[f"{frame.f_code.co_filename.rpartition('/')[2]}:C:{getattr(arg, '__qualname__', arg)}"] += 1

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return seen
