"""The wrappers of a router's forward and of its MoE block's: the hot path of every router call. Each call asks the
tables in paths.py which path it takes and runs it: PASS (the block as is), READ (`read_output`, here), LANE
(`lane.lane_path`) or CALL (`call_path`, here: one `RouterCall` with its HOLD, AS_IS, REDIRECT or MODE path). They
read the routers' facts in the hub (hub.py) and the open contexts' state in its session (session.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from .call import InterceptMode, begin_call, end_call, num_scores, outputs
from .lane import LaneTopK, lane_path
from .paths import AS_IS, HOLD, LANE, MODE, PASS, READ, REDIRECT, before_block, before_call, in_call
from .recompute import at_router
from .redirect import run_redirected
from .session import Session
from .steps import Step
from .stream import hold


class Wrapped:
    """What every path of one wrapped router (or MoE block) takes: the hub, the router's index and module, its name,
    the forward wrapped, the redirected copy of the router's forward (redirect.py; None if it has none), where its
    logits are in its output (None: this wraps the MoE block) and its lane's top-k (lane.py)."""

    __slots__ = ("hub", "i", "router", "name", "inner", "own_copy", "logits_index", "lane", "lane_topk")

    def __init__(self, hub: Any, i: int, inner: Callable[..., Any], logits_index: int | None) -> None:
        self.hub, self.i, self.inner, self.logits_index = hub, i, inner, logits_index
        self.router, self.name = hub.sites[i].router, hub.sites[i].name
        self.own_copy = hub.redirects.forward(self.router, inner) if logits_index is not None else None
        # the redirected top-k of its calls on the lane (lane.py), and that top-k bound: a router with a redirected copy
        self.lane = LaneTopK() if self.own_copy is not None else None
        self.lane_topk = None if self.lane is None else self.lane.topk


def router_wrapper(hub: Any, i: int, inner: Callable[..., Any], logits_index: int | None) -> Callable[..., Any]:
    """The forward that replaces router `i`'s (`logits_index`: where its logits are in its output) or, with
    `logits_index=None`, its MoE block's, `inner`: each call runs the path paths.py's table picks.

    Both are wrapped until the router is known: DBRX takes the top-k in the block, outside the router; JetMoE's
    attention experts call the router from a method other than the block's forward. Once every top-k of its calls
    ran inside the router in both training modes of its block, the next contexts wrap the router alone (hub.py).

    Example:
        >>> router.forward = router_wrapper(hub, 0, router.forward, site.logits_index)  # doctest: +SKIP
    """
    w = Wrapped(hub, i, inner, logits_index)
    if logits_index is None:
        block = hub.sites[i].scope

        def block_forward(*args: Any, **kwargs: Any) -> Any:
            if before_block(hub, hub.session, i, block) is PASS:
                return inner(*args, **kwargs)
            return call_path(w, args, kwargs)

        return block_forward
    router, redirectable = w.router, w.own_copy is not None

    def forward(*args: Any, **kwargs: Any) -> Any:
        session = hub.session
        step = session.tracker.current
        path = before_call(hub, session, i, router, step, redirectable)
        if path is READ:
            return read_output(w, session, step, args, kwargs)
        if path is LANE:
            return lane_path(w, session, step, args, kwargs)
        return call_path(w, args, kwargs)

    return forward


def read_output(w: Wrapped, session: Session, step: Step, args: tuple, kwargs: dict) -> Any:
    """READ: run the router as it is and record the top-k indices its output holds (no call, no interception).

    Example:
        >>> out = read_output(w, hub.session, step, (hidden_states,), {})  # doctest: +SKIP
    """
    out = w.inner(*args, **kwargs)
    found = out if type(out) is tuple else outputs(out)
    indices, version = hold(found[w.hub.record_from[w.i][w.router.training]])
    session.taken.append((session.layer(w.i, step), indices, version, found[w.logits_index].shape[-1]))
    return out


def call_path(w: Wrapped, args: tuple, kwargs: dict) -> Any:
    """CALL: run the router or its MoE block inside the router's `RouterCall` (opened here by whichever runs first,
    closed by it), on the path `paths.in_call` picks: HOLD, AS_IS, REDIRECT or MODE.

    Example:
        >>> out = call_path(w, (hidden_states,), {})  # doctest: +SKIP
    """
    hub, i, router = w.hub, w.i, w.router
    session = hub.session
    is_router = w.logits_index is not None
    call = session.calls[i]
    opened = call is None
    if opened:
        call = session.calls[i] = begin_call(hub, session, i)
    if is_router:
        call.router_runs += 1
        if call.router_runs == 1:
            at_router(hub, session, call, args, kwargs)
    path = in_call(hub, session, call, router, is_router, w.own_copy is not None)
    intercept = path is REDIRECT or path is MODE
    if intercept and not call.selectors:  # made only for a call that intercepts
        # (a router whose one top-k over each token's scores is redirected needs its catch-all selector alone)
        one = path is REDIRECT and hub.facts[i].redirect.get(router.training) == 1
        call.selectors = [make(call) for make in hub.selectors[i] if make.catch_all or not one]
    session.in_router[i] += is_router
    try:
        if path is HOLD or path is AS_IS:
            out = w.inner(*args, **kwargs)
        elif path is REDIRECT:  # only the router's own torch.topk is intercepted
            call.intercepting = True
            out = run_redirected(w.own_copy, call.redirected_topk, router, args, kwargs)
        else:
            call.intercepting = True
            with InterceptMode(call, lambda: session.in_router[i] > 0):
                out = w.inner(*args, **kwargs)
        if is_router:
            call.num_experts = num_scores(out, w.logits_index)
            call.router_out = out
            if path is HOLD and call.record:  # held as the router returns them (an edit after it is caught)
                call.held = hold(outputs(out)[hub.facts[i].output_index[router.training]])
    finally:
        session.in_router[i] -= is_router
        if intercept:
            call.intercepting = False
        if opened:
            session.calls[i] = None
    if opened:
        try:
            end_call(hub, session, call)
        finally:  # its selectors point back at the call: unlinked, both are freed now, not by the collector
            call.selectors = []
    return out
