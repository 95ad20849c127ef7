"""The wrappers that run a hooked router's calls (the `Action` each takes: router.py): the router's forward
(`router_forward`), and, on the general path, its MoE block's (`block_forward`); READ (`read`) and the opening,
running and closing of a `RouterCall` (`run_call`, `begin_call`, `end_call`; call.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ...errors import ReplayError, UnsupportedModelError
from ..autograd import in_backward
from .call import InterceptMode, RouterCall, num_scores, outputs
from .recompute import at_router
from .router import Action, Router
from .session import Session
from .stream import hold


def router_forward(session: Session, r: Router, inner: Callable[..., Any]) -> Callable[..., Any]:
    """The forward that replaces router `r`'s, `inner`, while the contexts of `session` are open: each call takes its
    `Action`.

    Example:
        >>> router.forward = router_forward(hub.session, r, router.forward)  # doctest: +SKIP
    """

    def forward(*args: Any, **kwargs: Any) -> Any:
        if r.action(bool(session.replayers), session.tracker.current) is Action.READ:
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
            at_router(r.queue(), session.replayers[-1] if session.replayers else None, call, args, kwargs)
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


def begin_call(session: Session, r: Router) -> RouterCall:
    """Open a call of router `r` in the open contexts' `session` (session.py): which layer it is, which routes it
    must use, whether it is recorded.

    Example:
        >>> call = begin_call(hub.session, hub.session.routers[0])  # doctest: +SKIP
    """
    site = r.site
    if in_backward():  # a checkpoint recompute: its plan is found when the router runs (`at_router`)
        return RouterCall(r.index, site, site.name, None, None, record=False, recompute=True)
    step = session.tracker.current
    if step is None:
        raise ReplayError(
            f"router {site.name!r} ran outside a forward of the hooked model: call the model that was given to "
            "record_routes / replay_routes"
        )
    name = r.layer(step)
    plan = session.replayers[-1].plan(name, step) if session.replayers else None
    return RouterCall(r.index, site, name, step, plan, record=bool(session.recorders))


def end_call(session: Session, call: RouterCall) -> None:
    """Close a router call of the open contexts' `session`: check its replay was applied, and hold its selection for
    the recorders.

    Example:
        >>> end_call(hub.session, call)  # doctest: +SKIP
    """
    call.check_replayed()
    if call.record:
        held, version = call.selected()
        session.taken.append((call.layer, held, version, call.num_experts))
