"""The replay lane: a replayed router call with nothing else to do, run without the call lifecycle's objects.

Most replayed router calls only need their one selecting `torch.topk` replaced: no recording, no checkpoint recompute
to queue for, no live picks to count. A router whose only top-k over each token's scores is a `torch.topk` in its own
`forward` (redirect.py) then runs its redirected forward with a `Lane` as the top-k's handler: no `RouterCall`, no
selector objects, no interception state. A host call costs microseconds on a CPU that has just run other code (a
forward's kernels and Python), so a call that touches less code is what makes replay free at small batches.
The checks are the general path's: the routes' E against the router's, and a replay that was not applied raises.
"""

from __future__ import annotations

import types
from typing import Any

import torch
from torch import nn

from .call import Plan, check_experts, not_applied, num_scores
from .recompute import will_be_recomputed
from .redirect import run_redirected
from .selectors import forced_topk, replaces, topk_args, topk_calls
from .steps import Step


class Lane:
    """The top-k handler of one replayed router call in the lane: forces the selecting top-k to the plan's experts,
    runs any other top-k as it is."""

    __slots__ = ("plan", "shape", "applied", "seen")

    def __init__(self, plan: Plan, tokens: int) -> None:
        self.plan, self.applied = plan, 0
        self.shape = (tokens, plan.num_experts)  # the input [N, E] of a selecting top-k, as most routers call it
        self.seen: list[tuple[int, int]] | None = None  # (last dim, k) of top-k calls over the last dim, not replaced

    def topk(self, *args: Any, **kwargs: Any) -> Any:
        """`torch.topk(*args, **kwargs)`, the plan's experts if it is the selection the plan replaces."""
        x, plan = args[0], self.plan
        if x.shape == self.shape and plan.all_recorded:  # the common case, checked with the fewest calls
            k = args[1] if len(args) > 1 else kwargs["k"]
            dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
            idx = plan.indices
            if type(k) is int and k == plan.top_k and dim in (-1, 1) and idx.device == x.device:
                self.applied += 1
                return torch.return_types.topk((x.gather(-1, idx), idx))  # = forced_topk's for it
        x, k, last = topk_args(args, kwargs)
        if last and replaces(plan, self.shape[0], x, k):
            self.applied += 1
            return forced_topk(torch.topk, args, kwargs, x, plan)
        if last:
            self.seen = [*(self.seen or ()), (x.shape[-1], k)]
        return torch.topk(*args, **kwargs)


def lane_ready(hub: Any, step: Step) -> bool:
    """Whether a replayed router call of `hub` (hub.py) in `step` has, as far as the step goes, nothing to do but its
    redirected top-k: no live picks to count and no recompute to queue for. A step run without grad and outside any
    checkpoint stays ready to its end: it is kept as `hub.lane_step`, so the next calls skip these checks. (The caller
    checks the rest per call: no recorder, not in a backward, a router with one redirected top-k.)

    Example:
        >>> lane_ready(hub, hub.tracker.current)  # doctest: +SKIP
        True
    """
    if hub.replayers[-1].track_live or will_be_recomputed(step):
        return False
    if step.grad is False:  # (set by will_be_recomputed): no router call of this step is recomputed
        hub.lane_step = step
    return True


def run_lane(
    forward: types.FunctionType,
    router: nn.Module,
    layer: str,
    plan: Plan,
    tokens: int,
    logits_index: int,
    args: tuple,
    kwargs: dict,
) -> Any:
    """Run `router`'s redirected `forward` with its selecting top-k forced to `plan` (router call `layer` of a forward
    of `tokens` tokens) and return its output; raise `ReplayError` unless the plan decided the call's experts.

    Example:
        >>> out = run_lane(fwd, router, "model.layers.0.mlp.gate", plan, 32, 0, (h,), {})  # doctest: +SKIP
    """
    lane = Lane(plan, tokens)
    out = run_redirected(forward, lane.topk, router, args, kwargs)
    # (`check_experts(layer, num_scores(out, logits_index), plan)`, inlined for a tuple output: a call costs a frame)
    E = out[logits_index].shape[-1] if type(out) is tuple else num_scores(out, logits_index)
    if E != plan.num_experts:
        check_experts(layer, E, plan)
    if not lane.applied:
        raise not_applied(layer, router, plan, tokens, topk_calls(lane.seen or []))
    return out
