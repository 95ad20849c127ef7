"""Activation checkpointing in the Hugging Face engine: which router calls the backward will run again, queued in the
queue both engines share (recompute_queue.py), and which plan each recompute takes from it.

A router call will be recomputed when it runs inside a checkpoint, whatever put the checkpoint there (transformers'
gradient checkpointing, `torch.utils.checkpoint`, torch's `checkpoint_wrapper` / `apply_activation_checkpointing`,
the composable `torch.distributed._composable.checkpoint`): a reentrant checkpoint runs its first forward without
grad inside a `CheckpointFunction.forward`; a non-reentrant one runs it under its own saved-tensor hooks. A recompute
is a router call while autograd runs a backward.
"""

from __future__ import annotations

import torch

from ...errors import ReplayError
from ..autograd import (
    checkpoint_chain,
    checkpoint_pack_hook,
    inside_reentrant_checkpoint,
    recomputing,
)
from ..fingerprint import fingerprint as tensor_fingerprint
from ..recompute_queue import Pending, RecomputeQueue
from .call import Replayer, RouterCall
from .plan import Plan
from .steps import Step


def will_be_recomputed(step: Step) -> bool:
    """Whether a router call now, in the forward `step`, runs inside an activation checkpoint."""
    if step.grad is None:  # began without grad: only a reentrant checkpoint around the whole model recomputes it
        step.grad = inside_reentrant_checkpoint()  # looked up once per forward, and only for a replayed one
    if not step.grad:
        return False
    if not torch.is_grad_enabled():
        return inside_reentrant_checkpoint()  # else user code under no_grad: never recomputed
    return checkpoint_pack_hook() is not None  # (a non-reentrant checkpoint's first forward)


def fingerprint(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """The fingerprint (fingerprint.py) of the call's first tensor input, or None without one."""
    x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    return None if x is None else tensor_fingerprint(x)


def same_plan(a: Plan, b: Plan) -> bool:
    """Whether two queued calls replayed the same routes (`RecomputeQueue.same`)."""
    return a.indices.shape == b.indices.shape and torch.equal(a.indices, b.indices) and torch.equal(a.mask, b.mask)


def recompute_queue(router: str) -> RecomputeQueue:
    """The queue (recompute_queue.py) of router `router`'s replayed calls that the backward will recompute."""
    return RecomputeQueue(router, same_plan)


def at_router(queue: RecomputeQueue, replayer: Replayer | None, call: RouterCall, args: tuple, kwargs: dict) -> None:
    """On entering the router module of `call` (inside any checkpoint around its layer): queue a replayed call that
    the backward will recompute in the router's `queue`, or give a recompute the plan of the forward it re-runs.
    `replayer`: the innermost open replay (None: none).

    Example:
        >>> at_router(router.queue(), replayer, call, (hidden_states,), {})  # doctest: +SKIP
    """
    if call.recompute:
        queued = queue.take(fingerprint(args, kwargs), recomputing())
        if queued is not None:
            call.layer, call.step, call.plan = queued.layer, queued.step, queued.routes
        elif replayer is not None:  # the forward was replayed but not seen to be checkpointed: never route it live
            raise ReplayError(
                f"router {call.layer!r} is recomputed in the backward but no replayed forward awaits it: a "
                "checkpoint moe-replay did not recognise (other saved-tensor hooks inside it?), or a forward run "
                "outside `with replay_routes(...)`"
            )
    elif call.plan is not None and call.step is not None and will_be_recomputed(call.step):
        queued = Pending(call.plan, fingerprint(args, kwargs), checkpoint_chain(), replayer, call.step, call.layer)
        queue.add(queued)
