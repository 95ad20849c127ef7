"""Activation checkpointing: which router calls the backward will run again, and which plan each recompute takes.

A router call will be recomputed when it runs inside a checkpoint, whatever put the checkpoint there (transformers'
gradient checkpointing, `torch.utils.checkpoint`, torch's `checkpoint_wrapper` / `apply_activation_checkpointing`,
the composable `torch.distributed._composable.checkpoint`): a reentrant checkpoint runs its first forward without
grad inside a `CheckpointFunction.forward`; a non-reentrant one runs it under its own saved-tensor hooks. Such a call
queues its plan with the checkpoints around it (`autograd.checkpoint_chain`) and a fingerprint of the router's input. A
recompute is a router call while autograd runs a backward; it takes the call queued inside the checkpoint being
recomputed (`autograd.recomputing`), else the queued call whose input it reproduces, in any backward order (nested
replays, gradient accumulation, looped layers inside one checkpoint), and keeps it for a later recompute of the same
call (`retain_graph=True`, nested checkpoints). A recompute that matches no queued call, or several with different
plans, or a reentrant checkpoint's that queued none, raises; a call whose checkpoints were freed unrecomputed is
forgotten.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ...errors import ReplayError
from ..autograd import (
    checkpoint_chain,
    checkpoint_pack_hook,
    freed,
    inside_reentrant_checkpoint,
    is_reentrant_node,
    recomputing,
    within,
)
from ..fingerprint import FINGERPRINT, matches
from ..fingerprint import fingerprint as tensor_fingerprint
from .call import RouterCall
from .plan import Plan
from .steps import Step

# recomputed calls kept per router for a second recompute (retain_graph, nested checkpoints), those whose checkpoints
# were freed let go first: a second backward over more checkpointed forwards of one context is refused
KEEP_DONE = 256


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


@dataclass
class Pending:
    """A replayed router call that the backward will recompute."""

    replayer: Any
    step: Step
    layer: str
    plan: Plan
    fingerprint: torch.Tensor | None
    checkpoints: tuple = ()  # weak references to the checkpoints around it, and around its recomputes (`take`)

    @property
    def abandoned(self) -> bool:
        """Whether every checkpoint around it was freed before recomputing it: none will (a checkpoint whose inputs
        and parameters need no gradient saves nothing, and its backward never runs)."""
        return freed(self.checkpoints)


class RecomputeQueue:
    """The queued calls of one router, oldest first, and those already recomputed (kept for a second recompute)."""

    def __init__(self, router: str) -> None:
        self.router = router
        self.items: list[Pending] = []
        self.done: list[Pending] = []
        self.let_go = 0  # recomputed calls dropped from `done` to keep KEEP_DONE while their checkpoints were alive

    @property
    def empty(self) -> bool:
        """Whether no call waits for its recompute and none is kept."""
        return not self.items and not self.done

    def add(self, item: Pending) -> None:
        self.items.append(item)

    def count(self, replayer: Any) -> int:
        """`replayer`'s calls still waiting for their recompute (the abandoned ones are forgotten)."""
        self.items = [p for p in self.items if not p.abandoned]
        return sum(p.replayer is replayer for p in self.items)

    def drop(self, replayer: Any = None, step: Step | None = None) -> None:
        """Forget the calls of `replayer` (its context closed) or of `step` (its forward raised)."""

        def keep(p: Pending) -> bool:
            return p.replayer is not replayer if step is None else p.step is not step

        self.items = [p for p in self.items if keep(p)]
        self.done = [p for p in self.done if keep(p)]

    def take(self, args: tuple, kwargs: dict) -> Pending | None:
        """The queued call a recompute with these inputs re-runs; None when nothing was queued at all. The call queued
        inside the checkpoint being recomputed, where one is (`autograd.recomputing`), else the one whose input's
        fingerprint matches; a reentrant checkpoint none of the queued calls ran in is not a replayed forward's."""
        if not self.items and not self.done:
            return None
        fp, checkpoint = fingerprint(args, kwargs), recomputing()

        # (in either pool: a nested checkpoint's recompute, or a second one, finds a call recomputed already)
        owned = any(within(p.checkpoints, checkpoint) for p in (*self.items, *self.done))
        for pool, first in ((self.items, True), (self.done, False)):
            hits = [
                k
                for k, p in enumerate(pool)
                if matches(p.fingerprint, fp) and (not owned or within(p.checkpoints, checkpoint))
            ]
            if not hits:
                continue
            if len(hits) > 1 and not _equal_plans([pool[k].plan for k in hits]):
                raise self._refused(
                    f"router {self.router!r} is recomputed in the backward and {FINGERPRINT} sampled elements of its "
                    f"input match those of {len(hits)} waiting replayed calls with different routes (inputs that "
                    "differ in a few elements only may sample alike): cannot tell which forward it re-runs; run each "
                    "backward before the next forward"
                )
            k = hits[0] if first else hits[-1]  # (the oldest waiting: a checkpoint re-runs its calls in forward order)
            item = pool[k]
            if is_reentrant_node(checkpoint) and not owned:
                raise self._refused(
                    f"router {self.router!r} is recomputed in the backward of a checkpoint whose forward replayed "
                    "nothing (a forward run outside `with replay_routes(...)`, backwarded inside it?): its input "
                    "matches a replayed call's, whose routes it would take; run each forward's backward inside the "
                    "context it ran in"
                )
            item.checkpoints = (*item.checkpoints, *checkpoint_chain())  # (nested checkpoints run in its recompute)
            if first:
                done = [p for p in self.done if not p.abandoned]
                if len(done) >= KEEP_DONE:
                    self.let_go += len(done) - KEEP_DONE + 1
                    done = done[len(done) - KEEP_DONE + 1 :]
                self.done = [*done, pool.pop(k)]
            return item
        raise self._refused(
            f"router {self.router!r} is recomputed in the backward but its input matches none of the "
            f"{len(self.items)} replayed calls waiting for their recompute: cannot tell which forward it re-runs "
            "(the model or its inputs changed since the forward, or a forward run outside the replay?)"
        )

    def _refused(self, message: str) -> ReplayError:
        """The error of a recompute `take` cannot place, naming the recomputed calls let go (`KEEP_DONE`) if any."""
        if self.let_go:
            message += (
                f"; {self.let_go} recomputed calls of this router were let go while their checkpoints were alive, to "
                f"keep {KEEP_DONE} for a second backward: a second backward (retain_graph=True) over more "
                "checkpointed forwards of one context than that is not supported"
            )
        return ReplayError(message)


def _equal_plans(plans: list[Plan]) -> bool:
    first = plans[0]
    with _disable_current_modes():
        return all(
            p.indices.shape == first.indices.shape
            and torch.equal(p.indices, first.indices)
            and torch.equal(p.mask, first.mask)
            for p in plans[1:]
        )


def at_router(hub: Any, call: RouterCall, args: tuple, kwargs: dict) -> None:
    """On entering the router module of `call` (inside any checkpoint around its layer): queue a replayed call that the
    backward will recompute in `hub.pending` (hub.py), or give a recompute the plan of the forward it re-runs.

    Example:
        >>> at_router(hub, call, (hidden_states,), {})  # doctest: +SKIP
    """
    queue = hub.pending[call.index]
    if call.recompute:
        queued = queue.take(args, kwargs)
        if queued is not None:
            call.layer, call.step, call.plan = queued.layer, queued.step, queued.plan
            call.selectors = [make(call) for make in hub.selectors[call.index]]
        elif hub.replayers:  # the forward was replayed but not seen to be checkpointed: never route it live
            raise ReplayError(
                f"router {call.layer!r} is recomputed in the backward but no replayed forward awaits it: a "
                "checkpoint moe-replay did not recognise (other saved-tensor hooks inside it?), or a forward run "
                "outside `with replay_routes(...)`"
            )
    elif call.plan is not None and call.step is not None and will_be_recomputed(call.step):
        queue.add(
            Pending(hub.replayers[-1], call.step, call.layer, call.plan, fingerprint(args, kwargs), checkpoint_chain())
        )
        hub.queued = True
