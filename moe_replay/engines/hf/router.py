"""One hooked router (`Router`: what it is, what was declared of it, its state in the open contexts) and the two
wrappers that run each of its calls: the router's forward, and, on the general path, its MoE block's.

Each router call takes one `Action`:

    situation                                                                         action
    ------------------------------------------------------------------------------  ------------------------------
    a call of the router is open (its MoE block opened it, or the block runs it       INSIDE (run as is: the call
      twice)                                                                                  intercepts already)
    the open contexts only record, inside a forward (not a backward's recompute),     READ   (`read`: record the
      and the router's class is declared to return its top-k's indices (declared.py)          indices it returns)
    anything else                                                                     OPEN   (`run_call`: open a
                                                                                              `RouterCall`, call.py)

A declared router's block is not wrapped (its top-k runs inside the router); any other router's block opens the call
and intercepts the whole block, the general path (DBRX takes the top-k in the block).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ...errors import ReplayError, UnsupportedModelError
from ..recompute_queue import RecomputeQueue
from .call import InterceptMode, RouterCall, begin_call, end_call, num_scores, outputs
from .discover import RouterSite
from .recompute import at_router, recompute_queue
from .selectors import Selector
from .steps import Step
from .stream import hold

if TYPE_CHECKING:
    from .session import Session

_graph_task = torch._C._current_graph_task_id  # -1 outside a backward (as `autograd.in_backward` reads it)


class Action(enum.Enum):
    """What one call of a router's forward does (the module docstring's table)."""

    INSIDE = "inside"
    READ = "read"
    OPEN = "open"


@dataclass(slots=True, eq=False)
class Router:
    """One router of a hooked model: its site, its selectors (rules.py), what declared.py declares of it, and its
    state while contexts are open (the call running now, the layer names of its runs in the running forward, the
    replayed calls a backward will recompute).

    - `declared`: its top-k runs inside it (its block is not wrapped); `indices_at`: where its output holds the
      top-k's indices (None: unknown, never read); both hold for `cls` and `block_cls`, its and its block's classes
      when the hooks were set, and `block_fn`, the block class's forward then.
    - `block_hook`: the forward the hub set on its block (None: declared, none set).
    """

    index: int
    site: RouterSite
    selectors: tuple[type[Selector], ...]
    declared: bool
    indices_at: int | None
    cls: type
    block_cls: type
    block_fn: Any
    block_hook: Any = None
    call: RouterCall | None = None
    ran_in: Step | None = None  # the step it last ran in
    runs: int = 0  # its extra runs in that step (`layer`)
    pending: RecomputeQueue | None = None

    @property
    def name(self) -> str:
        return self.site.name

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

    def action(self, session: Session) -> Action:
        """The `Action` of a call of its forward now (the module docstring's table)."""
        if self.call is not None:
            return Action.INSIDE
        router, block = self.site.router, self.site.scope
        if block.__dict__.get("forward") is not self.block_hook or (
            self.declared
            and (
                type(router) is not self.cls
                or type(block) is not self.block_cls
                or self.block_cls.forward is not self.block_fn
            )
        ):
            raise ReplayError(
                f"router {self.site.name!r}'s class, or its MoE block's class or forward, changed while a moe-replay "
                f"context was open (now {type(router).__name__} in {type(block).__name__}): its hooks were set for "
                "the code that ran then; change the model before opening its contexts (or between them)"
            )
        if not self.declared:
            return Action.OPEN
        if self.indices_at is None or session.replayers or session.tracker.current is None or _graph_task() != -1:
            return Action.OPEN
        return Action.READ


def router_forward(session: Session, r: Router, inner: Callable[..., Any]) -> Callable[..., Any]:
    """The forward that replaces router `r`'s, `inner`, while the contexts of `session` are open: each call takes its
    `Action`.

    Example:
        >>> router.forward = router_forward(hub.session, r, router.forward)  # doctest: +SKIP
    """

    def forward(*args: Any, **kwargs: Any) -> Any:
        if r.action(session) is Action.READ:
            return read(r, session, inner, args, kwargs)
        return run_call(session, r, inner, True, args, kwargs)

    return forward


def block_forward(session: Session, r: Router, inner: Callable[..., Any]) -> Callable[..., Any]:
    """The forward that replaces the MoE block's of an undeclared router `r` (the general path): it opens the
    router's call, intercepting the whole block.

    Example:
        >>> block.forward = block_forward(hub.session, r, block.forward)  # doctest: +SKIP
    """

    def forward(*args: Any, **kwargs: Any) -> Any:
        return run_call(session, r, inner, False, args, kwargs)

    return forward


def read(r: Router, session: Session, inner: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """READ: run the router as it is and record the top-k indices its output holds (declared.py), as returned (an
    edit in place before they are copied is caught). Raises `UnsupportedModelError` if that output is not a
    [tokens, K] integer tensor: the declaration does not hold for this model.

    Example:
        >>> out = read(r, hub.session, router.forward, (hidden_states,), {})  # doctest: +SKIP
    """
    out = inner(*args, **kwargs)
    found = outputs(out)
    step = session.tracker.current
    idx = found[r.indices_at] if len(found) > r.indices_at else None
    if not isinstance(idx, torch.Tensor) or idx.is_floating_point() or idx.numel() != step.tokens * idx.shape[-1]:
        raise UnsupportedModelError(
            f"router {r.site.name!r} ({type(r.site.router).__name__}) is declared to return its top-k indices at "
            f"output {r.indices_at}, but that output is not an integer tensor over the forward's {step.tokens} "
            "tokens: this transformers release changed the class; run with MOE_REPLAY_PATH=general"
        )
    indices, version = hold(idx)
    session.taken.append((r.layer(step), indices, version, num_scores(out, r.site.logits_index)))
    return out


def run_call(session: Session, r: Router, inner: Callable[..., Any], is_router: bool, args: tuple, kwargs: dict):
    """OPEN or INSIDE: run the router (`is_router`) or its MoE block inside the router's `RouterCall`, opened here,
    under the interception of its torch functions, by whichever runs first, and closed by it (call.py).

    Example:
        >>> out = run_call(hub.session, r, router.forward, True, (hidden_states,), {})  # doctest: +SKIP
    """
    call = r.call
    opened = call is None
    if opened:
        call = r.call = begin_call(session, r)
        call.selectors = [make(call) for make in r.selectors]
    if is_router:
        call.router_runs += 1
        if call.router_runs == 1:
            at_router(session, r, call, args, kwargs)
    try:
        if opened:
            with InterceptMode(call):
                out = inner(*args, **kwargs)
        else:
            out = inner(*args, **kwargs)
        if is_router:
            call.num_experts = num_scores(out, r.site.logits_index)
    finally:
        if opened:
            r.call = None
    if opened:
        try:
            end_call(session, call)
        finally:  # its selectors point back at the call: unlinked, both are freed now, not by the collector
            call.selectors = []
    return out


def make_router(i: int, site: RouterSite, selectors: tuple[type[Selector], ...], at: int | None | object) -> Router:
    """Router `i` at `site`, with `at` from `declared.declared` (its `NOT_DECLARED` or where its indices are).

    Example:
        >>> at = declared(site.router, site.scope, declarations())  # doctest: +SKIP
        >>> r = make_router(0, site, selectors_for(site.router), at)  # doctest: +SKIP
    """
    is_declared = at is None or isinstance(at, int)
    indices_at = at if isinstance(at, int) else None
    block_cls = type(site.scope)
    return Router(i, site, selectors, is_declared, indices_at, type(site.router), block_cls, block_cls.forward)
