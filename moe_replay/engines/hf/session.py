"""The state of one stretch of open contexts on a model: from its outermost context's entry to its last context's exit.

Each lifetime has one home: the model's hooks, its routers' facts and the wrappers live in the hub (hub.py,
kept across sessions only inside a `keep_warm` scope); what the open contexts share lives here, in a `Session`, made
as the first context opens and dropped as the last one closes; one forward's positions are a `Step` (steps.py); one
router call is a `RouterCall` (call.py). The wrappers read a session's fields; every change to them goes through its
methods, except the two per-router slots of the call running now (`calls`, `in_router`), which `wrapper.call_path`
alone writes as a call opens and closes, and `taken`, to which a path that recorded a call appends it.
"""

from __future__ import annotations

import threading
from typing import Any

from ..recompute_queue import RecomputeQueue
from .call import Recorder, Replayer, RouterCall
from .facts import runs_class_methods
from .recompute import recompute_queue
from .steps import HAND_OVER, Step, extends_generation
from .stream import Taken
from .tracker import GENERATE_START, StepTracker


class Session:
    """What the record/replay contexts open on one model share: their recorders and replayers, the forwards' tracker,
    the router calls of the running step, the replayed calls a backward will recompute, the running `generate`.

    Example:
        >>> session = Session(["model.layers.0.mlp.gate"], {})
        >>> session.layer(0, step), session.layer(0, step)  # doctest: +SKIP
        ('model.layers.0.mlp.gate', 'model.layers.0.mlp.gate#1')
    """

    def __init__(self, names: list[str], signatures: dict) -> None:
        n = len(names)
        self.names = names  # the routers' names, in the hub's order
        self.tracker = StepTracker(signatures)
        self.thread = threading.get_ident()  # the thread whose contexts are open: the only one that may open more
        self.recorders: list[Recorder] = []
        self.replayers: list[Replayer] = []
        # per router: the replayed calls whose recompute in the backward is to come (made at the first one queued)
        self.pending: list[RecomputeQueue] | None = None
        self.occurrence: list[Step | None] = [None] * n  # the step each router last ran in
        self._repeats: list[tuple[Step | None, int]] = [(None, 0)] * n  # run again in it (`layer`)
        self.calls: list[RouterCall | None] = [None] * n  # the call open now, per router (wrapper.call_path)
        self.in_router = [0] * n  # router forwards on the stack, per router (wrapper.call_path)
        self._own_methods: list[bool | None] = [None] * n  # `reads_output`, once asked
        # recorded router calls of the running step: (layer, its top-k's indices, their version, E), appended by the
        # paths that record (wrapper.read_output, call.end_call)
        self.taken: list[Taken] = []
        self.held: list[tuple[Step, list[Taken]]] = []  # steps that returned, not yet handed over
        self.lane_step: Step | None = None  # the running step, once its replayed calls can all take the lane (lane.py)
        self.generating = 0  # generate calls on the stack (generation.py)
        self.generated: tuple | None = None  # what the innermost of nested generate calls ran with and returned
        self.synced = False  # inside generate(synced_gpus=True): forwards past the routes may be dummies

    # ---- the contexts ----------------------------------------------------------------------------------------
    def add(self, handler: Recorder | Replayer, *, replay: bool) -> None:
        """Add an opening context's recorder or replayer (after the steps that ran before it are handed over)."""
        if self.held:
            self.hand_over()  # what ran before belongs to the contexts open then
        (self.replayers if replay else self.recorders).append(handler)
        self.lane_step = None

    def remove(self, handler: Recorder | Replayer) -> bool:
        """Remove a closing context's `handler` and drop its queued calls (the hub hands the held steps over
        first): whether no context is left open."""
        for group in (self.recorders, self.replayers):
            if any(h is handler for h in group):
                group[:] = [h for h in group if h is not handler]
        self.lane_step = None
        for queue in self.pending or ():
            if queue.items or queue.done:
                queue.drop(handler)
        return not self.recorders and not self.replayers

    def waiting(self, handler: Replayer) -> int:
        """Replayed router calls of `handler` still waiting for their recompute in the backward."""
        return sum(queue.waiting(handler) for queue in self.pending or () if queue.items)

    def reads_output(self, i: int, router: Any) -> bool:
        """Whether router `i` (`router`) runs its class's own methods, whose facts say where its output holds its
        top-k's indices (facts.py): a router running others is never read from its output (asked once per session)."""
        own = self._own_methods[i]
        if own is None:
            own = self._own_methods[i] = runs_class_methods(router)
        return own

    # ---- router calls ----------------------------------------------------------------------------------------
    def layer(self, i: int, step: Step) -> str:
        """Router `i`'s layer name in `step` (run again in the same forward, by looped layers, it is another layer)."""
        if self.occurrence[i] is not step:
            self.occurrence[i] = step
            return self.names[i]
        last, n = self._repeats[i]
        n = n + 1 if last is step else 1
        self._repeats[i] = (step, n)
        return f"{self.names[i]}#{n}"

    def recompute_queue(self, i: int) -> RecomputeQueue:
        """Router `i`'s queue of replayed calls that the backward will recompute (recompute.py)."""
        if self.pending is None:
            self.pending = [recompute_queue(name) for name in self.names]
        return self.pending[i]

    def keep_lane(self, step: Step) -> None:
        """Let the rest of `step`'s replayed calls take the lane without asking again (lane.py)."""
        self.lane_step = step

    # ---- steps -----------------------------------------------------------------------------------------------
    def step_ended(self, step: Step) -> None:
        """The forward of `step` returned: hold its recorded calls for the recorders, and hand them over unless it
        is one of a generate's decode steps (those go `HAND_OVER` at a time)."""
        self.tracker.current = self.lane_step = None
        if self.taken:
            self.held.append((step, self.taken))
            self.taken = []
            if len(self.held) >= HAND_OVER or step.length != 1 or not extends_generation(step):
                self.hand_over()

    def step_failed(self, step: Step) -> None:
        """The forward of `step` raised: it is never backwarded, nor recorded."""
        self.tracker.current = self.lane_step = None
        for queue in self.pending or ():
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
