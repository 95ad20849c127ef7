"""The replayed router calls that the backward will recompute (activation checkpointing): one queue per router.

A replayed call made inside a checkpoint's first forward is queued with what it replayed, a fingerprint of the
router's input (fingerprint.py) and the checkpoints around it (`autograd.checkpoint_chain`). A recompute takes the
call queued inside the checkpoint being recomputed (`autograd.recomputing`), else the one whose input it reproduces,
oldest first, in any backward order; it is kept (at most `keep_done`) for a second recompute of the same call
(`retain_graph=True`, nested checkpoints). A recompute that matches none, or several that replayed different routes,
or a reentrant checkpoint's whose first forward queued none, raises; a call whose checkpoints were all freed
unrecomputed is forgotten."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes

from ..errors import ReplayError
from .autograd import checkpoint_chain, freed, is_reentrant_node, within
from .fingerprint import FINGERPRINT, matches

KEEP_DONE = 256  # recomputed calls kept per router for a second recompute (`_keep`; past it one is refused)


@dataclass
class Pending:
    """A replayed router call the backward will recompute."""

    routes: Any  # what it replayed: the Hugging Face engine's `Plan`, megatron's rows and mask
    fingerprint: torch.Tensor | None  # of its input
    checkpoints: tuple = ()  # around it (and around its recomputes)
    owner: Any = None  # the context that queued it
    step: Any = None  # the forward it ran in (Hugging Face)
    layer: str = ""  # the layer name it ran as (Hugging Face)

    @property
    def abandoned(self) -> bool:
        """Whether every checkpoint around it was freed before recomputing it: none will (a checkpoint whose inputs
        and parameters need no gradient saves nothing, and its backward never runs)."""
        return freed(self.checkpoints)


class RecomputeQueue:
    """The queued calls of one router, oldest first, and those already recomputed (kept for a second recompute).

    Example:
        >>> queue = RecomputeQueue("decoder.layers.0.mlp.router", same=lambda a, b: a == b)
        >>> queue.add(Pending(routes="rows", fingerprint=None))
        >>> queue.take(None, None).routes, queue.waiting()
        ('rows', 0)
    """

    def __init__(self, router: str, same: Callable[[Any, Any], bool], keep_done: int | None = None) -> None:
        self.router = router
        self.same = same  # whether two queued calls replayed the same routes
        self.keep_done = KEEP_DONE if keep_done is None else keep_done
        self.items: list[Pending] = []
        self.done: list[Pending] = []
        self.let_go = 0  # recomputed calls dropped from `done` to keep `keep_done` while their checkpoints were alive

    @property
    def empty(self) -> bool:
        """Whether no call waits for its recompute and none is kept."""
        return not self.items and not self.done

    def add(self, item: Pending) -> None:
        self.items.append(item)

    def waiting(self, owner: Any = None) -> int:
        """The calls (of `owner`, if given) still waiting for their recompute; the abandoned ones are forgotten."""
        self.items = [p for p in self.items if not p.abandoned]
        return sum(owner is None or p.owner is owner for p in self.items)

    def drop(self, owner: Any = None, step: Any = None) -> None:
        """Forget the calls of `owner` (its context closed) or of `step` (its forward raised)."""
        attr, value = ("owner", owner) if step is None else ("step", step)
        self.items = [p for p in self.items if getattr(p, attr) is not value]
        self.done = [p for p in self.done if getattr(p, attr) is not value]

    def take(self, found: torch.Tensor | None, checkpoint: object) -> Pending | None:
        """The queued call re-run by a recompute of `checkpoint` (`recomputing()`) with input fingerprint `found`."""
        if self.empty:
            return None
        # (in either pool: a nested checkpoint's recompute, or a second one, finds a call recomputed already)
        owned = any(within(p.checkpoints, checkpoint) for p in (*self.items, *self.done))
        for pool, first in ((self.items, True), (self.done, False)):
            hits = [k for k, p in enumerate(pool) if matches(p.fingerprint, found)]
            if owned:
                hits = [k for k in hits if within(pool[k].checkpoints, checkpoint)]
            if not hits:
                continue
            if len(hits) > 1 and not self._alike([pool[k] for k in hits]):
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
                pool.pop(k)
                self._keep(item)
            return item
        raise self._refused(
            f"router {self.router!r} is recomputed in the backward but its input matches none of the "
            f"{len(self.items)} replayed calls waiting for their recompute: cannot tell which forward it re-runs "
            "(the model or its inputs changed since the forward, or a forward run outside the replay?)"
        )

    def _alike(self, items: list[Pending]) -> bool:
        with _disable_current_modes():  # (a recompute may run under the Hugging Face engine's TorchFunctionMode)
            return all(self.same(p.routes, items[0].routes) for p in items[1:])

    def _keep(self, item: Pending) -> None:
        """Keep a recomputed call for a second recompute, letting go of the oldest past `keep_done`."""
        done = [p for p in self.done if not p.abandoned]
        if len(done) >= self.keep_done:
            cut = len(done) - self.keep_done + 1
            self.let_go += cut if self.keep_done else 0  # (an engine that keeps none lets nothing go that it kept)
            done = done[cut:]
        self.done = [*done, item] if self.keep_done else done

    def _refused(self, message: str) -> ReplayError:
        """The error of a recompute `take` cannot place, naming the recomputed calls let go (`keep_done`) if any."""
        if self.let_go:
            message += (
                f"; {self.let_go} recomputed calls of this router were let go while their checkpoints were alive, to "
                f"keep {self.keep_done} for a second backward: a second backward (retain_graph=True) over more "
                "checkpointed forwards of one context than that is not supported"
            )
        return ReplayError(message)
