"""One hooked router of a model (`Router`): what it is, what declared.py declares of it, its state while contexts
are open, and the `Action` each call of its forward takes (hooks.py runs it): INSIDE a call already open (its MoE
block opened it: the call intercepts already); READ, the indices a declared class returns, when the open contexts
only record, inside a forward, not in a backward's recompute; else OPEN a `RouterCall`. A declared router's block is
not wrapped (its top-k runs inside the router); any other router's block opens the call and intercepts the whole
block, the general path (DBRX takes the top-k in the block).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from operator import is_
from typing import Any

import torch
from torch import nn

from ...errors import ReplayError
from ..recompute_queue import RecomputeQueue
from .call import RouterCall
from .discover import RouterSite
from .recompute import recompute_queue
from .selectors import Selector
from .steps import Step

_graph_task = torch._C._current_graph_task_id  # -1 outside a backward (as `autograd.in_backward` reads it)


class Action(enum.Enum):
    """What one call of a router's forward does (the module docstring says when)."""

    INSIDE = "inside"
    READ = "read"
    OPEN = "open"


@dataclass(slots=True, eq=False)
class Router:
    """One router of a hooked model: its site, its selectors (rules.py), what declared.py declares of it, and its
    state while contexts are open (the call running now, its runs in the running forward, the replayed calls a
    backward will recompute). `declared`: its top-k runs inside it (its block is not wrapped); `indices_at`: where
    its output holds the top-k's indices (None: never read); both hold for its and its block's classes (`cls`,
    `block_cls`) while their namespaces and their bases' are `code`. `block_hook`: the forward the hub set on its
    block (None: declared, none set)."""

    index: int
    site: RouterSite
    selectors: tuple[type[Selector], ...]
    declared: bool
    indices_at: int | None
    cls: type
    block_cls: type
    code: tuple[tuple[type, tuple[str, ...], tuple[Any, ...]], ...]
    block_hook: Any = None
    call: RouterCall | None = None
    ran_in: Step | None = None  # the step it last ran in
    runs: int = 0  # its extra runs in that step (`layer`)
    pending: RecomputeQueue | None = None

    def layer(self, step: Step) -> str:
        """Its layer name in `step`: run again in the same forward (looped layers), it is another layer, `name#n`."""
        if self.ran_in is not step:
            self.ran_in, self.runs = step, 0
            return self.site.name
        self.runs += 1
        return f"{self.site.name}#{self.runs}"

    def queue(self) -> RecomputeQueue:
        """Its replayed calls that the backward will recompute (recompute.py), made at the first one queued."""
        if self.pending is None:
            self.pending = recompute_queue(self.site.name)
        return self.pending

    def action(self, replaying: bool, step: Step | None) -> Action:
        """The `Action` of a call of its forward now (the module docstring says when), in forward `step` (None: none
        running) of contexts that replay (`replaying`) or only record."""
        if self.call is not None:
            return Action.INSIDE
        router, block = self.site.router, self.site.scope
        if block.__dict__.get("forward") is not self.block_hook or (
            self.declared
            and (
                type(router) is not self.cls
                or type(block) is not self.block_cls
                or not all(_unchanged(klass, names, values) for klass, names, values in self.code)
            )
        ):
            raise ReplayError(
                f"router {self.site.name!r}'s class or a method of it, or its MoE block's class or forward, changed "
                f"while a moe-replay context was open (now {type(router).__name__} in {type(block).__name__}): its "
                "hooks were set for the code that ran then; change the model before opening its contexts"
            )
        if not self.declared:
            return Action.OPEN
        if self.indices_at is None or replaying or step is None or _graph_task() != -1:
            return Action.OPEN
        return Action.READ


def _unchanged(klass: type, names: tuple[str, ...], values: tuple[Any, ...]) -> bool:
    """Whether `klass`'s namespace still binds `names` to the very `values` (by identity: an `==` may be anything)."""
    space = vars(klass)
    return tuple(space) == names and all(map(is_, space.values(), values))


def make_router(i: int, site: RouterSite, selectors: tuple[type[Selector], ...], at: int | None | object) -> Router:
    """Router `i` at `site`, with `at` from `declared.declared` (its `NOT_DECLARED` or where its indices are).

    Example:
        >>> at = declared(site.router, site.scope, declarations())  # doctest: +SKIP
        >>> r = make_router(0, site, selectors_for(site.router), at)  # doctest: +SKIP
    """
    is_declared = at is None or isinstance(at, int)
    indices_at = at if isinstance(at, int) else None
    cls, block_cls = type(site.router), type(site.scope)
    classes = dict.fromkeys(k for c in (cls, block_cls) for k in c.__mro__[: c.__mro__.index(nn.Module)])
    code = tuple((k, tuple(vars(k)), tuple(vars(k).values())) for k in classes) if is_declared else ()
    return Router(i, site, selectors, is_declared, indices_at, cls, block_cls, code)
