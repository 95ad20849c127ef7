"""What the record/replay contexts open on one model share, from the first one's entry to the last one's exit: a
`Session`, made with the model's hooks (hub.py) and dropped with them. One forward's positions are a `Step`
(steps.py); one router and its state a `Router` (router.py); one router call a `RouterCall` (call.py). Every change to
a session's fields goes through its methods, except `taken`, to which a path that recorded a call appends it.
"""

from __future__ import annotations

import threading

from ..recompute_queue import RecomputeQueue
from .call import Recorder, Replayer
from .router import Router
from .steps import HAND_OVER, Step, extends_generation
from .stream import Taken
from .tracker import GENERATE_START, StepTracker


class Session:
    """What the record/replay contexts open on one model share: their recorders and replayers, its routers
    (router.py), the forwards' tracker, the router calls of the running step, the running `generate`.

    Example:
        >>> session = Session(routers)  # doctest: +SKIP
        >>> session.routers[0].name  # doctest: +SKIP
        'model.layers.0.mlp.gate'
    """

    def __init__(self, routers: tuple[Router, ...]) -> None:
        self.routers = routers
        self.tracker = StepTracker()
        self.thread = threading.get_ident()  # the thread whose contexts are open: the only one that may open more
        self.recorders: list[Recorder] = []
        self.replayers: list[Replayer] = []
        # recorded router calls of the running step: (layer, its top-k's indices, their version, E), appended by the
        # paths that record (hooks.read, hooks.end_call)
        self.taken: list[Taken] = []
        self.held: list[tuple[Step, list[Taken]]] = []  # steps that returned, not yet handed over
        self.generating = 0  # generate calls on the stack (generation.py)
        self.generated: tuple | None = None  # what the innermost of nested generate calls ran with and returned
        self.synced = False  # inside generate(synced_gpus=True): forwards past the routes may be dummies

    # ---- the contexts ----------------------------------------------------------------------------------------
    def add(self, handler: Recorder | Replayer, *, replay: bool) -> None:
        """Add an opening context's recorder or replayer (after the steps that ran before it are handed over)."""
        if self.held:
            self.hand_over()  # what ran before belongs to the contexts open then
        (self.replayers if replay else self.recorders).append(handler)

    def remove(self, handler: Recorder | Replayer) -> bool:
        """Remove a closing context's `handler` and drop its queued calls (the hub hands the held steps over
        first): whether no context is left open."""
        for group in (self.recorders, self.replayers):
            if any(h is handler for h in group):
                group[:] = [h for h in group if h is not handler]
        for queue in self.queues():
            if queue.items or queue.done:
                queue.drop(handler)
        return not self.recorders and not self.replayers

    def waiting(self, handler: Replayer) -> int:
        """Replayed router calls of `handler` still waiting for their recompute in the backward."""
        return sum(queue.waiting(handler) for queue in self.queues() if queue.items)

    def queues(self) -> list[RecomputeQueue]:
        """The routers' queues of replayed calls a backward will recompute (those made so far)."""
        return [r.pending for r in self.routers if r.pending is not None]

    # ---- steps -----------------------------------------------------------------------------------------------
    def step_ended(self, step: Step) -> None:
        """The forward of `step` returned: hold its recorded calls for the recorders, and hand them over unless it
        is one of a generate's decode steps (those go `HAND_OVER` at a time)."""
        self.tracker.current = None
        if self.taken:
            self.held.append((step, self.taken))
            self.taken = []
            if len(self.held) >= HAND_OVER or step.length != 1 or not extends_generation(step):
                self.hand_over()

    def step_failed(self, step: Step) -> None:
        """The forward of `step` raised: it is never backwarded, nor recorded."""
        self.tracker.current = None
        for queue in self.queues():
            queue.drop(step=step)
        self.taken.clear()

    def check_resume(self, stream: int) -> None:
        """Before the first forward of a `generate` that continues `stream`'s kept KV cache opens its step (tracker.py):
        every recorder must hold that stream's last generate (record.py)."""
        if self.recorders:
            self.hand_over()
            for rec in self.recorders:
                rec.check_resume(stream)

    def hand_over(self) -> None:
        """Give the recorders the router calls of the steps held since the last hand-over, in order."""
        held, self.held = self.held, []
        for step, taken in held:
            for rec in self.recorders:
                rec.record_step(step, taken)

    def drop_streams(self, first: int) -> None:
        """Forget what the recorders hold, or the session still holds for them, of streams `first` and after."""
        self.held = [(step, taken) for step, taken in self.held if step.stream < first]
        for rec in self.recorders:
            rec.drop_streams(first)

    # ---- generate --------------------------------------------------------------------------------------------
    def enter_generate(self, synced: bool) -> int | None:
        """A `generate` begins (`synced`: with `synced_gpus`): the first stream its forwards will make, or None if
        an outer generate is running (the outer one owns the streams)."""
        self.synced = synced
        if self.generating:
            return None
        self.generating += 1
        self.generated = None
        self.tracker.cache, self.tracker.resumed = GENERATE_START, None
        return self.tracker.stream + 1

    def generate_streams(self, first: int) -> range:
        """The streams the outermost `generate` made (from stream `first` on), or continued: a later turn of a
        conversation over one kept KV cache continues the stream of the turns before it (tracker.py)."""
        resumed = self.tracker.resumed
        return range(first if resumed is None else min(first, resumed[0]), self.tracker.stream + 1)

    def generated_by_inner(self, ran: tuple) -> None:
        """What a generate called by an outer one ran with and returned: the innermost's, which returns first."""
        if self.generated is None:
            self.generated = ran

    def exit_generate(self) -> tuple | None:
        """The outermost `generate` ended: what its innermost generate ran with and returned (None: itself)."""
        self.generating -= 1
        self.synced = False
        self.tracker.cache = None  # let go of its KV cache: the next generate may get it emptied
        ran, self.generated = self.generated, None
        return ran
