"""The wrapper of a router's forward and of its MoE block's: the hot path of every router call (hub.py holds the
state it reads). A recording alone of a router class known to return its top-k indices reads them from the router's
output; a replay alone of a redirected router takes the lane (lane.py); any other call opens a `RouterCall` (call.py)
in whichever of the two runs first and intercepts its top-k.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .call import InterceptMode, begin_call, end_call, num_scores, outputs
from .lane import lane_ready, run_lane
from .recompute import at_router
from .redirect import run_redirected
from .stream import hold


def router_wrapper(hub: Any, i: int, inner: Callable[..., Any], logits_index: int | None) -> Callable[..., Any]:
    """Open router call `i` in whichever of the router and its MoE block runs first, and intercept its calls.

    Both are wrapped until the router class is known: DBRX takes the top-k in the block, outside the router;
    JetMoE's attention experts call the router from a method other than the block's forward. The first call
    intercepts in the whole block; when every top-k it saw ran inside the router, later calls intercept in the
    router alone (cheaper: the experts' ops then skip the Python-level TorchFunctionMode), and later contexts on
    the model wrap the router alone. A router whose only top-k is a `torch.topk` in its own forward then runs a
    redirected copy of that forward instead of the mode (redirect.py); so does a group-limited router whose top-k
    calls over each token's scores are all `torch.topk` calls there.

    Example:
        >>> router.forward = router_wrapper(hub, 0, router.forward, site.logits_index)  # doctest: +SKIP
    """
    is_router = logits_index is not None
    router, name = hub.sites[i].router, hub.sites[i].name
    graph_task = torch._C._current_graph_task_id  # -1 outside a backward (`in_backward`, inlined below)
    own_copy = hub.redirects.forward(router, inner) if is_router else None  # its forward, top-k redirected
    # (a block wrapper's router never reads its output alone: its entry stays None, but the block's is never read)
    record_from = hub.record_from if is_router else [None] * len(hub.sites)

    def forward(*args: Any, **kwargs: Any) -> Any:
        index = record_from[i]
        if index is not None:  # a recording alone, of a router class whose output holds its top-k's indices
            j = index.get(router.training)
            step = hub.tracker.current
            if j is not None and step is not None and graph_task() == -1:
                # read from the router's output: no call state, no interception (`layer`'s first run in a step,
                # inlined: this runs per router call and step)
                out = inner(*args, **kwargs)
                found = out if type(out) is tuple else outputs(out)
                if hub.occurrence[i] is step:
                    layer = hub.layer(i, step)
                else:
                    layer, hub.occurrence[i] = name, step
                indices = found[j]  # (`stream.hold`, inlined: B/A 0.9986 against the path calling a helper, 300 rounds)
                try:
                    version = indices._version
                except RuntimeError:  # an inference tensor, whose edits are not counted: copied now
                    version, indices = None, indices.clone()
                hub.taken.append((layer, indices, version, found[logits_index].shape[-1]))
                return out
        call = hub.calls[i]
        if call is None and is_router:
            step = hub.tracker.current
            if (  # (the hooks are set only while a context is open: no recorder means a replayer)
                own_copy is not None
                and not hub.recorders
                and step is not None
                and hub.router_only[i]
                and hub.facts[i].redirect.get(router.training, 0) == 1
                and graph_task() == -1
                and (step is hub.lane_step or lane_ready(hub, step))
            ):  # a replay alone, of a redirected router: lane.py (`layer`'s first run in a step, inlined)
                if hub.occurrence[i] is step:
                    layer = hub.layer(i, step)
                else:
                    layer, hub.occurrence[i] = name, step
                plan = hub.replayers[-1].plan(layer, step)
                if plan is None:  # a dummy forward past the routes: routed live
                    return inner(*args, **kwargs)
                tokens = step.batch * step.length  # (`step.tokens`, a property: a frame per call)
                return run_lane(own_copy, router, layer, plan, tokens, logits_index, args, kwargs)
        opened = call is None
        if opened:
            call = hub.calls[i] = begin_call(hub, i)
        if is_router and not call.at_router:
            call.at_router = True
            at_router(hub, call, args, kwargs)
        # where in the router's output its top-k's indices are, if the call is recorded from that alone (facts.py)
        j = None
        if call.plan is None and not call.recompute and hub.router_only[i] and hub.reads_output(i):
            j = hub.facts[i].output_index.get(router.training)
        fast = j is not None
        intercept = not fast and not call.intercepting and (is_router or not hub.router_only[i])
        redirected, ranked = None, 0
        if intercept and is_router:
            ranked = hub.facts[i].redirect.get(router.training, 0)
            if ranked:
                redirected = own_copy
        if intercept and not call.selectors:  # made only for a call that intercepts (not a fast recording)
            makers = hub.selectors[i]  # a redirected router's one top-k goes to the plain one, the last
            one = redirected is not None and ranked == 1
            call.selectors = [makers[-1](call)] if one else [make(call) for make in makers]
        hub.in_router[i] += is_router
        try:
            if redirected is not None:  # only the router's own torch.topk is intercepted
                call.intercepting = True
                out = run_redirected(redirected, call.redirected_topk, router, args, kwargs)
            elif intercept:
                call.intercepting = True
                with InterceptMode(call, lambda: hub.in_router[i] > 0):
                    out = inner(*args, **kwargs)
            else:
                out = inner(*args, **kwargs)
            if is_router:
                call.num_experts = num_scores(out, logits_index)
                call.router_out = out
                if fast and call.record:  # held as the router returns them (an edit after it is caught)
                    call.held = hold(outputs(out)[j])
        finally:
            hub.in_router[i] -= is_router
            if intercept:
                call.intercepting = False
            if opened:
                hub.calls[i] = None
        if opened:
            try:
                end_call(hub, call)
            finally:  # its selectors point back at the call: unlinked, both are freed now, not by the collector
                call.selectors = []
        return out

    return forward
