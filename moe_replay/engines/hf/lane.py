"""The replay lane: a replayed router call with nothing else to do, run without the call lifecycle's objects.

Most replayed router calls only need their one selecting `torch.topk` replaced: no recording, no checkpoint recompute
to queue for, no live picks to count. A router whose only top-k over each token's scores is a `torch.topk` in its own
`forward` (redirect.py) then runs its redirected forward with one closure as the top-k's handler: no `RouterCall`,
no selector objects, no interception state. A host call costs microseconds on a CPU that has just run other code (a
forward's kernels and Python), so a call that touches less code is what makes replay free at small batches.
The checks are the general path's: the routes' E against the router's, and a replay that was not applied raises.
"""

from __future__ import annotations

from typing import Any

import torch

from .call import check_experts, not_applied, num_scores
from .recompute import will_be_recomputed
from .redirect import run_redirected
from .selectors import forced_topk, replaces, topk_args, topk_calls
from .steps import Step


def lane_ready(session: Any, step: Step) -> bool:
    """Whether a replayed router call of `session` (session.py) in `step` has, as far as the step goes, nothing to do
    but its redirected top-k: no live picks to count and no recompute to queue for. A step run without grad and
    outside any checkpoint stays ready to its end: it is kept as `session.lane_step`, so the next calls skip these
    checks. (The caller
    checks the rest per call: no recorder, not in a backward, a router with one redirected top-k.)

    Example:
        >>> lane_ready(session, session.tracker.current)  # doctest: +SKIP
        True
    """
    if session.replayers[-1].track_live or will_be_recomputed(step):
        return False
    if step.grad is False:  # (set by will_be_recomputed): no router call of this step is recomputed
        session.keep_lane(step)
    return True


def lane_path(w: Any, session: Any, step: Step, args: tuple, kwargs: dict) -> Any:
    """LANE (paths.py): the replayed call of router `w` (wrapper.Wrapped) in `step` of `session`. Runs the router's
    redirected forward with its selecting top-k forced to the call's plan and returns its output; raises `ReplayError`
    unless the plan decided the call's experts. In a dummy forward past the routes (`generate(synced_gpus=True)`),
    routes live.

    Example:
        >>> out = lane_path(w, hub.session, step, (hidden_states,), {})  # doctest: +SKIP
    """
    layer = session.layer(w.i, step)
    plan = session.replayers[-1].plan(layer, step)
    if plan is None:
        return w.inner(*args, **kwargs)
    tokens = step.tokens
    state = [0, None]  # top-k calls the plan decided; (last dim, k) of the others over the last dim

    def topk(*args: Any, **kwargs: Any) -> Any:
        """`torch.topk(*args, **kwargs)`, the plan's experts if it is the selection the plan replaces."""
        x, k, last = topk_args(args, kwargs)
        if last and replaces(plan, tokens, x, k):
            state[0] += 1
            return forced_topk(torch.topk, args, kwargs, x, plan)
        if last:
            state[1] = [*(state[1] or ()), (x.shape[-1], k)]
        return torch.topk(*args, **kwargs)

    out = run_redirected(w.own_copy, topk, w.router, args, kwargs)
    check_experts(layer, num_scores(out, w.logits_index), plan)
    if not state[0]:
        raise not_applied(layer, w.router, plan, tokens, topk_calls(state[1] or []))
    return out
