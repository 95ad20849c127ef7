"""The replay lane: a replayed router call with nothing else to do, run without the call lifecycle's objects.

Most replayed router calls only need their one selecting `torch.topk` replaced: no recording, no checkpoint recompute
to queue for, no live picks to count. A router whose only top-k over each token's scores is a `torch.topk` in its own
`forward` (redirect.py) then runs its redirected forward with the router's `LaneTopK` as the top-k's handler: no
`RouterCall`, no selector objects, no interception state, no object made per call. A host call costs microseconds on
a CPU that has just run other code (a forward's kernels and Python), so a call that touches less code is what makes
replay free at small batches (the lane's instructions per call: docs/host_cost.md).
The checks are the general path's: a replay that was not applied raises, naming a router whose E is not the routes'.
"""

from __future__ import annotations

from typing import Any

import torch

from .call import check_experts, not_applied, num_scores
from .plan import Plan
from .recompute import will_be_recomputed
from .redirect import run_redirected
from .selectors import forced_topk, replaces, topk_args, topk_calls
from .steps import Step


def lane_ready(session: Any, step: Step) -> bool:
    """Whether a replayed router call of `session` (session.py) in `step` has, as far as the step goes, nothing to do
    but its redirected top-k: no live picks to count and no recompute to queue for. A step run without grad and
    outside any checkpoint stays ready to its end: it is kept as `session.lane_step`, so the next calls skip these
    checks. (The caller checks the rest per call: no recorder, not in a backward, a router with one redirected top-k.)

    Example:
        >>> lane_ready(session, session.tracker.current)  # doctest: +SKIP
        True
    """
    if session.replayers[-1].track_live or will_be_recomputed(step):
        return False
    if step.grad is False:  # (set by will_be_recomputed): no router call of this step is recomputed
        session.keep_lane(step)
    return True


class LaneTopK:
    """The `torch.topk` of one router's redirected forward on the lane (`topk`): the plan's experts if a call is the
    selection the plan replaces (`replaces`), else the call as it is. One per router, made with its wrapper and set
    for each of its calls by `lane_path`, so that a call on the lane makes no object but its output."""

    __slots__ = ("plan", "tokens", "replaced", "others")

    def __init__(self) -> None:
        self.plan: Plan | None = None  # the running call's (None between calls)
        self.tokens = 0  # its forward's tokens
        self.replaced = 0  # top-k calls the plan decided
        self.others: list[tuple[int, int]] | None = None  # (last dim, k) of the other top-k calls over the last dim

    def topk(self, *args: Any, **kwargs: Any) -> Any:
        x, k, last = topk_args(args, kwargs)
        plan = self.plan
        if last and replaces(plan, self.tokens, x, k):
            self.replaced += 1
            return forced_topk(torch.topk, args, kwargs, x, plan)
        if last:
            self.others = [*(self.others or ()), (x.shape[-1], k)]
        return torch.topk(*args, **kwargs)


def lane_path(w: Any, session: Any, step: Step, args: tuple, kwargs: dict) -> Any:
    """LANE (paths.py): the replayed call of router `w` (wrapper.Wrapped) in `step` of `session`. Runs the router's
    redirected forward with its selecting top-k forced to the call's plan (`w.lane`, a `LaneTopK`) and returns its
    output; raises `ReplayError` unless the plan decided the call's experts. In a dummy forward past the routes
    (`generate(synced_gpus=True)`), routes live.

    Example:
        >>> out = lane_path(w, hub.session, step, (hidden_states,), {})  # doctest: +SKIP
    """
    layer = session.layer(w.i, step)
    plan = session.replayers[-1].plan(layer, step)
    if plan is None:
        return w.inner(*args, **kwargs)
    lane = w.lane
    lane.plan, lane.tokens, lane.replaced, lane.others = plan, step.tokens, 0, None
    try:
        out = run_redirected(w.own_copy, w.lane_topk, w.router, args, kwargs)
    finally:
        lane.plan = None  # (the routes are not held past the call)
    if not lane.replaced:
        check_experts(layer, num_scores(out, w.logits_index), plan)  # (the likeliest reason, named first)
        raise not_applied(layer, w.router, plan, step.tokens, topk_calls(lane.others or []))
    return out
