"""Activation checkpointing: which router calls the backward will run again, and which plan each recompute takes.

A router call will be recomputed when it runs inside a checkpoint, whatever put the checkpoint there (transformers'
gradient checkpointing, `torch.utils.checkpoint`, torch's `checkpoint_wrapper` / `apply_activation_checkpointing`,
the composable `torch.distributed._composable.checkpoint`): a reentrant checkpoint runs its first forward without
grad inside a forward that has grad; a non-reentrant one runs it under its own saved-tensor hooks. Such a call
queues its plan. A recompute is a router call while autograd runs a backward; it takes the plan of the forward it
recomputes: the only forward with plans waiting, or else the one whose router input it reproduces bit for bit
(recompute re-runs the same ops on the same inputs), in any backward order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...errors import ReplayError
from .call import Plan
from .steps import Step

FINGERPRINT = 64  # elements of the router input kept per queued call to tell forwards apart


def in_backward() -> bool:
    """Whether autograd is running a backward on this thread (where checkpoints recompute their forward)."""
    return torch._C._current_graph_task_id() != -1


def will_be_recomputed(step: Step) -> bool:
    """Whether a router call now, in the forward `step`, runs inside an activation checkpoint."""
    if not step.grad:
        return False  # a forward without grad has no backward
    if not torch.is_grad_enabled():
        return True  # a reentrant checkpoint's first forward
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(False)
    pack = hooks[0] if hooks is not None else None
    return getattr(pack, "__module__", "") == "torch.utils.checkpoint" and "_checkpoint_hook" in pack.__qualname__


def fingerprint(args: tuple, kwargs: dict) -> torch.Tensor | None:
    """A few evenly spaced elements of the call's first tensor input (a copy), or None without one."""
    x = next((a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)), None)
    if x is None or x.numel() == 0:
        return None
    flat = x.detach().reshape(-1)
    return flat[:: max(1, flat.numel() // FINGERPRINT)][:FINGERPRINT].clone()


@dataclass
class Pending:
    """A replayed router call that the backward will recompute."""

    replayer: Any
    step: Step
    layer: str
    plan: Plan
    fingerprint: torch.Tensor | None


class RecomputeQueue:
    """The queued calls of one router, oldest first."""

    def __init__(self, router: str) -> None:
        self.router = router
        self.items: list[Pending] = []

    def add(self, item: Pending) -> None:
        self.items.append(item)

    def count(self, replayer: Any) -> int:
        return sum(p.replayer is replayer for p in self.items)

    def drop(self, replayer: Any) -> None:
        self.items = [p for p in self.items if p.replayer is not replayer]

    def take(self, args: tuple, kwargs: dict) -> Pending | None:
        """The queued call a recompute with these inputs re-runs (None: its forward routed live)."""
        if not self.items:
            return None
        latest = {id(p.step): k for k, p in enumerate(self.items)}  # within a forward, the latest call first
        if len(latest) == 1:
            return self.items.pop()
        fp = fingerprint(args, kwargs)
        hits = [k for k in latest.values() if _same(self.items[k].fingerprint, fp)]
        if not hits or (len(hits) > 1 and not _equal_plans([self.items[k].plan for k in hits])):
            raise ReplayError(
                f"router {self.router!r} is recomputed in the backward while {len(latest)} replayed forwards wait for "
                f"their recompute, and its input matches {len(hits)} of them: cannot tell which forward it re-runs "
                "(recompute differs from the forward: nondeterministic kernels?); run each backward before the next "
                "forward"
            )
        return self.items.pop(hits[-1])


def _same(a: torch.Tensor | None, b: torch.Tensor | None) -> bool:
    return a is not None and b is not None and a.shape == b.shape and bool(torch.equal(a, b.to(a.device)))


def _equal_plans(plans: list[Plan]) -> bool:
    first = plans[0]
    return all(
        p.indices.shape == first.indices.shape
        and torch.equal(p.indices, first.indices)
        and torch.equal(p.mask, first.mask)
        for p in plans[1:]
    )
