"""The hooks on one model, shared by every active record/replay context on it, and the state its router calls read
(their wrapper is wrapper.py).

Each outermost forward of the model is a `Step` (which positions it covers). Each router call opens a `RouterCall`
(call.py) in whichever of the router and its MoE block runs first: it gets its layer name, the plan its replayer
gives it (and, under activation checkpointing, queues that plan for the recompute in the backward), and the selectors
of its router (selectors.py) see the call's torch functions. When the call ends the replay is checked and the
selection recorded (and its selectors unlinked from it, so that nothing a call made waits for the garbage collector).
A recording without replay, of a router class known to return its top-k indices, needs none of this: it reads them
from the router's output.

One hub per model holds the hooks for all active contexts, so that a recording nested in a replay sees the replayed
experts; its hooks are removed with the last context, and the hub with them. Inside a `keep_warm` scope (warm.py) the
hub (and the methods it patched) is kept with the model's layout for the next context, which re-installs the same
wrappers while what they wrap is unchanged: a context per minibatch or log-prob chunk then costs a few dictionary
writes, not a rebuild. A copied or saved model carries no hub.
"""

from __future__ import annotations

import threading
from functools import partial

from torch import nn

from ...errors import ForeignThreadError, NestedContextError, ReplayError
from .adapters import refuse_idle
from .call import Recorder, Replayer, RouterCall
from .discover import RouterSite
from .facts import RouterFacts, Unchanged, facts_for, runs_class_methods, stale, watched
from .generation import PACKED_GENERATION, generate_wrapper, refuse_packed
from .layout import Layout, model_layout
from .patch import MARKER, Patches, drop_stale, forgotten, patched_by
from .paths import general_path
from .recompute import recompute_queue
from .redirect import Redirects
from .rules import selectors_for
from .steps import Step, StepTracker, step_wrapper
from .stream import Taken
from .warm import ATTR, Warm, warm_state
from .wrapper import router_wrapper


class RouterHub:
    """Hooks on one model, shared by every active record/replay context on it."""

    def __init__(self, model: nn.Module, layout: Layout, warm: Warm) -> None:
        self.model = model
        self.warm = warm  # what the model's contexts learned: kept with a `keep_warm` scope, else with this hub
        self.layout = layout  # kept in `warm` while the model's module tree holds, and this hub with it
        self.sites: list[RouterSite] = list(layout.sites)
        self.selectors = [selectors_for(s.router) for s in self.sites]
        self._tracked: list[nn.Module] = list(layout.tracked)
        self._signatures = warm.signatures  # kept across hubs in a `keep_warm` scope (steps.py)
        self.redirects = Redirects()  # routers whose own torch.topk alone is intercepted
        self._wrappers: dict = {}  # the patched methods, reused by the next contexts while what they wrap holds
        self._patches = Patches(owner=self)
        self._installed: tuple[bool, ...] | None = None  # `router_only` when the patches were last installed
        self._watch: tuple[Unchanged, dict] | None = None  # what `watched` read and returned at the last install
        # plans of forwards whose router calls the backward will recompute (activation checkpointing), per router
        self.pending = [recompute_queue(s.name) for s in self.sites]
        self.queued = False  # whether any call was queued in `pending` since it was made (recompute.py)
        # what was learned about each router's class, and which routers intercept in the router alone: looked up by
        # `_install` whenever the patches are not set again exactly as they were
        self.facts: list[RouterFacts] = []
        self.router_only: list[bool] = []
        self.general = False  # MOE_REPLAY_PATH=general at install: `router_only` stays all False (paths.py)
        # per router, while the open contexts only record and its MoE block runs unwrapped: its class's
        # `output_index` (facts.py), through which a call is recorded from the router's output alone; else None.
        # Mutated in place (the routers' wrappers hold the list), set by `_record_from_outputs`
        self.record_from: list[dict[bool, int | None] | None] = [None] * len(self.sites)
        self._reading = False  # whether `record_from` is set
        self.then_undo: list[Patches] = []  # a `keep_warm` scope closed before the contexts: undone after the last
        self._reset()

    def _reset(self) -> None:
        """The state of one stretch of open contexts: a kept hub starts each one afresh (its facts are `_install`'s)."""
        self.tracker = StepTracker(self._signatures)
        self.thread = threading.get_ident()  # the thread whose contexts are open: the only one that may open more
        self.recorders: list[Recorder] = []
        self.replayers: list[Replayer] = []
        self._record_from_outputs(False)
        if self.queued:  # (each context drops its calls as it closes: made afresh all the same)
            self.pending, self.queued = [recompute_queue(s.name) for s in self.sites], False
        self.occurrence: list[Step | None] = [None] * len(self.sites)  # the step each router last ran in
        self._repeats: list[tuple[Step | None, int]] = [(None, 0)] * len(self.sites)  # run again in it (`layer`)
        self.calls: list[RouterCall | None] = [None] * len(self.sites)
        self.in_router = [0] * len(self.sites)  # router forwards on the stack, per router
        self.own_methods: list[bool | None] = [None] * len(self.sites)  # `reads_output`, once asked
        self.taken: list[Taken] = []  # recorded router calls of the running step
        self.held: list[tuple[Step, list[Taken]]] = []  # steps that returned, not yet handed over (`step_wrapper`)
        self.lane_step: Step | None = None  # the running step, once its replayed calls can all take the lane (lane.py)
        self.generating = 0  # generate calls on the stack (generation.py)
        self.generated: tuple | None = None  # what the innermost of nested generate calls ran with and returned
        self.synced = False  # inside generate(synced_gpus=True): forwards past the routes may be dummies

    def __deepcopy__(self, memo: dict) -> None:
        return None  # a copied model (its layout, with this hub kept in it) makes its own

    def __reduce__(self) -> tuple:
        return (forgotten, ())  # nor is a hub pickled with a saved model

    # ---- lifetime ------------------------------------------------------------------------------------------
    @classmethod
    def attach(cls, model: nn.Module, handler: Recorder | Replayer, *, replay: bool) -> RouterHub:
        """The model's hub (installed on first use), with `handler` added as a recorder or a replayer."""
        hub = model.__dict__.get(MARKER)
        if hub is not None and (hub.model is not model or not len(hub._patches)):
            drop_stale(model, hub)  # left on a shallow copy (copy.copy) of a hooked model
            hub = None
        if hub is None:
            warm = warm_state(model)
            layout = model_layout(model, warm)
            hub = layout.kept.get("hub")
            if isinstance(hub, cls) and hub.model is model:
                hub._reset()
            else:
                hub = layout.kept["hub"] = cls(model, layout, warm)
            try:
                hub._install()
            except BaseException:
                hub._patches.undo()
                raise
        elif hub.thread != threading.get_ident():
            raise ForeignThreadError(
                f"a context cannot open on {type(model).__name__} in this thread while contexts opened in another "
                "thread are open on it: open and use a model's contexts in one thread"
            )
        else:  # the open contexts' wrappers stay: what they learned must still hold
            changed = stale(hub.warm.facts, watched(hub.sites))
            if changed:
                raise ReplayError(
                    f"the methods or MoE blocks of router class {', '.join(c.__name__ for c in changed)} were patched "
                    f"while a moe-replay context was open on {type(model).__name__}: the open contexts run what they "
                    "hooked; patch the model before opening its contexts (or between them)"
                )
        hub.redirects.refresh()  # (the module of a router's forward may have been patched since it was copied)
        if hub.held:
            hub.hand_over()  # what ran before belongs to the contexts open then
        (hub.replayers if replay else hub.recorders).append(handler)
        hub._record_from_outputs(not hub.replayers)
        hub.lane_step = None
        return hub

    def detach(self, handler: Recorder | Replayer) -> None:
        """Remove `handler`; the last one out removes every hook and the hub itself."""
        try:
            if self.held:
                self.hand_over()  # (a recorder's error on the held steps still lets the handler go)
        finally:
            for group in (self.recorders, self.replayers):
                for h in group:
                    if h is handler:
                        group[:] = [h for h in group if h is not handler]
                        break
            self.lane_step = None
            for queue in self.pending if self.queued else ():
                if queue.items or queue.done:
                    queue.drop(handler)
            if not self.recorders and not self.replayers:
                self._patches.undo()
                for patches in self.then_undo:
                    patches.undo()
                    patches.close()
                self.then_undo = []
                if self.model.__dict__.get(ATTR) is not self.warm:  # no scope keeps it: it goes with this hub
                    self.warm.drop()
                    self.release()
            else:
                self._record_from_outputs(not self.replayers)

    def release(self) -> None:
        """Break the references between this hub and its wrappers once nothing keeps it (its last context closed
        outside a `keep_warm` scope, or the scope closed): it is freed at once, with what it holds, not at the next
        garbage collection."""
        self._patches.close()
        self._wrappers.clear()

    def _record_from_outputs(self, on: bool) -> None:
        """Let the routers whose MoE block runs unwrapped record each call from their output alone (`on`: the open
        contexts only record), or not."""
        if on == self._reading:
            return  # (the patches, and so which blocks are wrapped, do not change while a context is open)
        self._reading, table, unwrapped = on, self.record_from, self._installed
        for i, facts in enumerate(self.facts):
            table[i] = facts.output_index if on and unwrapped and unwrapped[i] and self.reads_output(i) else None

    def reads_output(self, i: int) -> bool:
        """Whether router `i` runs its class's own methods, whose facts say where its output holds its top-k's
        indices (facts.py): a router running others is never read from its output (asked once per stretch of open
        contexts)."""
        own = self.own_methods[i]
        if own is None:
            own = self.own_methods[i] = runs_class_methods(self.sites[i].router)
        return own

    def pending_for(self, handler: Replayer) -> int:
        """Replayed router calls still waiting for their recompute in the backward."""
        n = 0
        for queue in self.pending if self.queued else ():
            if queue.items:
                n += queue.waiting(handler)
        return n

    def _install(self) -> None:
        general = general_path()  # (MOE_REPLAY_PATH=general: every MoE block wrapped, no fact acted on; paths.py)
        if general != self.general:
            self._installed, self.general = None, general  # (installed the other way: made afresh)
        wrapped = tuple(self.router_only)  # which routers' MoE blocks need no wrapper
        kept = self._watch
        if kept is not None and kept[0].holds():  # (`watched` walks every class's namespace: this runs per context)
            watch = kept[1]
        else:
            seen = Unchanged(self.sites)  # (taken first: a change in between is found by the next context)
            watch = watched(self.sites)
            self._watch = (seen, watch)
        if wrapped == self._installed and not stale(self.warm.facts, watch) and self._patches.redo():
            # the last context's patches, set again as they were (which also means no other hub's patch is on its
            # modules, and no router's class changed since they were set), and no router class's method was patched
            # since its facts were learned: the facts the hub kept still hold
            return
        # the facts about each router's class (a class patched since has none yet), and where to intercept
        facts = facts_for(self.warm.facts, watch)
        self.facts = [facts[type(s.router)] for s in self.sites]
        self.router_only = [not general and bool(f.topk_in_router) for f in self.facts]  # intercept in the router
        wrapped = tuple(self.router_only)
        for site in self.sites:
            other = patched_by(site.router.__dict__.get("forward"))
            if other is not None:
                raise NestedContextError(
                    f"router {site.name!r} is already hooked by a context opened on "
                    f"{type(other.model).__name__}; open every record/replay context of a model on the same module"
                )
        self._installed = None  # until every patch below is set (a failed install is undone, never redone)
        self._patches.set(self.model, MARKER, self)
        patch = partial(self._patches.patch, kept=self._wrappers)
        for module in self._tracked:
            patch(module, "forward", partial(step_wrapper, self))
            if callable(getattr(module, "generate", None)):
                patch(module, "generate", partial(generate_wrapper, self))
            for name in PACKED_GENERATION:
                if callable(getattr(module, name, None)):
                    patch(module, name, partial(refuse_packed, name))
        for i, site in enumerate(self.sites):
            if not self.router_only[i]:  # a router class known to select inside itself needs no block wrapper
                patch(site.scope, "forward", lambda inner, i=i: router_wrapper(self, i, inner, None))
            patch(site.router, "forward", lambda inner, i=i, s=site: router_wrapper(self, i, inner, s.logits_index))
        for layer, router in self.layout.idle:  # PEFT copies that did not run at entry must not run inside
            patch(router, "forward", partial(refuse_idle, layer))
        self._installed = wrapped

    # ---- one router call -----------------------------------------------------------------------------------
    def layer(self, i: int, step: Step) -> str:
        """Router `i`'s layer name in `step` (run again in the same forward, by looped layers, it is another layer)."""
        if self.occurrence[i] is not step:
            self.occurrence[i] = step
            return self.sites[i].name
        last, n = self._repeats[i]
        n = n + 1 if last is step else 1
        self._repeats[i] = (step, n)
        return f"{self.sites[i].name}#{n}"

    def drop_streams(self, first: int) -> None:
        """Forget what the recorders hold, or the hub still holds for them, of streams `first` and after."""
        self.held = [(step, taken) for step, taken in self.held if step.stream < first]
        for rec in self.recorders:
            rec.drop_streams(first)

    def hand_over(self) -> None:
        """Give the recorders the router calls of the steps held since the last hand-over, in order."""
        held, self.held = self.held, []
        for step, taken in held:
            for rec in self.recorders:
                rec.record_step(step, taken)


def open_contexts(model: nn.Module) -> tuple[int, int]:
    """How many `record_routes` and `replay_routes` contexts are open on `model`, or on a module that wraps it (their
    hooks are on its modules): a forward of it now is recorded or replayed by them.

    Example:
        >>> open_contexts(nn.Linear(2, 2))
        (0, 0)
    """
    for module in model.modules():
        hub = patched_by(module.__dict__.get("forward"))
        if isinstance(hub, RouterHub):
            return len(hub.recorders), len(hub.replayers)
    return 0, 0
