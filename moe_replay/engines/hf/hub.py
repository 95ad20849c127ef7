"""The hooks on one model, shared by every active record/replay context on it, and what they learned about it (their
wrapper is wrapper.py). What the open contexts share while they are open is the hub's `session` (session.py).

Each outermost forward of the model is a `Step` (which positions it covers). Each router call opens a `RouterCall`
(call.py) in whichever of the router and its MoE block runs first: it gets its layer name, the plan its replayer
gives it (and, under activation checkpointing, queues that plan for the recompute in the backward), and the selectors
of its router (selectors.py) see the call's torch functions. When the call ends the replay is checked and the
selection recorded (and its selectors unlinked from it, so that nothing a call made waits for the garbage collector).
A recording without replay, of a router known to return its top-k indices, needs none of this: it reads them
from the router's output.

One hub per model holds the hooks for all active contexts, so that a recording nested in a replay sees the replayed
experts; the first context opens a session, the last one ends it and removes the hooks, and the hub with them.
Inside a `keep_warm` scope (warm.py) the hub (and the methods it patched) is kept with the model's layout for the
next context, which re-installs the same wrappers while what they wrap is unchanged: a context per minibatch or
log-prob chunk then costs a few dictionary writes, not a rebuild. A copied or saved model carries no hub.
"""

from __future__ import annotations

import threading
from functools import partial

from torch import nn

from ...errors import ForeignThreadError, NestedContextError, ReplayError
from .adapters import refuse_idle
from .call import Recorder, Replayer
from .discover import RouterSite
from .facts import RouterFacts, Unchanged, facts_for, stale, watched
from .generation import PACKED_GENERATION, generate_wrapper, refuse_packed
from .layout import Layout, model_layout
from .patch import MARKER, Patches, drop_stale, forgotten, patched_by
from .paths import general_path
from .redirect import Redirects
from .rules import selectors_for
from .session import Session
from .steps import step_wrapper
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
        self._signatures = warm.signatures  # kept across hubs in a `keep_warm` scope (tracker.py)
        self.redirects = Redirects()  # routers whose own torch.topk alone is intercepted
        self._wrappers: dict = {}  # the patched methods, reused by the next contexts while what they wrap holds
        self._patches = Patches(owner=self)
        # per router, whether its MoE block runs unwrapped (`_blocks_free()` when the patches were last installed:
        # its router is alone in both of the block's modes; paths.py); None until an install completes
        self.unwrapped: tuple[bool, ...] | None = None
        self._watch: tuple[Unchanged, dict] | None = None  # what `watched` read and returned at the last install
        # what each router's calls taught (facts.py), looked up by `_install` whenever the patches are not set again
        # exactly as they were; per router, the training modes in which its MoE block needs no interception (its
        # facts' `topk_in_router`, or {} under MOE_REPLAY_PATH=general: paths.py)
        self.facts: list[RouterFacts] = []
        self.router_only: list[dict[bool, bool]] = []
        self.general = False  # MOE_REPLAY_PATH=general at install
        # per router, while the open contexts only record: its `output_index` (facts.py), through which a call is
        # recorded from the router's output alone; else None. Mutated in place (the routers' wrappers hold the list),
        # set by `_record_from_outputs`
        self.record_from: list[dict[bool, int | None] | None] = [None] * len(self.sites)
        self._reading = False  # whether `record_from` is set
        self.then_undo: list[Patches] = []  # a `keep_warm` scope closed before the contexts: undone after the last
        self.session: Session | None = None  # the open contexts' state (session.py): None while none is open

    def __deepcopy__(self, memo: dict) -> None:
        return None  # a copied model (its layout, with this hub kept in it) makes its own

    def __reduce__(self) -> tuple:
        return (forgotten, ())  # nor is a hub pickled with a saved model

    # ---- lifetime ------------------------------------------------------------------------------------------
    @classmethod
    def attach(cls, model: nn.Module, handler: Recorder | Replayer, *, replay: bool) -> RouterHub:
        """The model's hub (installed, with a new session, as its first context opens), with `handler` added to its
        session as a recorder or a replayer."""
        hub = model.__dict__.get(MARKER)
        if hub is not None and (hub.model is not model or not len(hub._patches)):
            drop_stale(model, hub)  # left on a shallow copy (copy.copy) of a hooked model
            hub = None
        if hub is None:
            warm = warm_state(model)
            layout = model_layout(model, warm)
            hub = layout.kept.get("hub")
            if not isinstance(hub, cls) or hub.model is not model:
                hub = layout.kept["hub"] = cls(model, layout, warm)
            hub._record_from_outputs(False)
            hub.session = Session([s.name for s in hub.sites], hub._signatures)
            try:
                hub._install()
            except BaseException:
                hub._patches.undo()
                hub.session = None
                raise
        elif hub.session.thread != threading.get_ident():
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
        hub.session.add(handler, replay=replay)
        hub._record_from_outputs(not hub.session.replayers)
        return hub

    def detach(self, handler: Recorder | Replayer) -> None:
        """Remove `handler`; the last one out ends the session and removes every hook (and the hub, unless a
        `keep_warm` scope keeps it)."""
        session = self.session
        try:
            if session.held:
                session.hand_over()  # (a recorder's error on the held steps still lets the handler go)
        finally:
            if session.remove(handler):
                self._end_session()
            else:
                self._record_from_outputs(not session.replayers)

    def _end_session(self) -> None:
        """The last context closed: drop the session and every hook (and the hub, unless a scope keeps it)."""
        self.session = None
        self._patches.undo()
        for patches in self.then_undo:
            patches.undo()
            patches.close()
        self.then_undo = []
        if self.model.__dict__.get(ATTR) is not self.warm:  # no scope keeps it: it goes with this hub
            self.warm.drop()
            self.release()

    def undo_after(self, patches: Patches) -> None:
        """Undo `patches` (a `keep_warm` scope's, closed while this hub's contexts are open) after the last context."""
        self.then_undo.append(patches)

    def release(self) -> None:
        """Break the references between this hub and its wrappers once nothing keeps it (its last context closed
        outside a `keep_warm` scope, or the scope closed): it is freed at once, with what it holds, not at the next
        garbage collection."""
        self._patches.close()
        self._wrappers.clear()

    def _record_from_outputs(self, on: bool) -> None:
        """Let the routers record each call from their output alone where their facts allow it (`on`: the open
        contexts only record; paths.py's READ row), or not."""
        if on == self._reading:
            return
        self._reading, table = on, self.record_from
        for i, facts in enumerate(self.facts):
            read = on and not self.general and self.session.reads_output(i, self.sites[i].router)
            table[i] = facts.output_index if read else None

    def learned_topk_in_router(self, i: int, training: bool, inside: bool) -> None:
        """What a call of router `i` with its MoE block in training mode `training` showed (call.py): whether its
        top-k ran inside the router alone. The fact holds while every such call showed so; from then on the block
        is not intercepted in that mode (paths.py), and once it holds in both modes the next outermost context
        leaves the block unwrapped."""
        facts = self.facts[i].topk_in_router
        facts[training] = inside and facts.get(training) is not False

    def _blocks_free(self) -> tuple[bool, ...]:
        """Per router: whether its MoE block needs no wrapper (its top-k ran inside the router in every call seen, in
        both training modes; never under MOE_REPLAY_PATH=general)."""
        return tuple(
            not self.general and f.topk_in_router.get(True) is True and f.topk_in_router.get(False) is True
            for f in self.facts
        )

    def _install(self) -> None:
        general = general_path()  # (MOE_REPLAY_PATH=general: every MoE block wrapped, no fact acted on; paths.py)
        if general != self.general:
            self.unwrapped, self.general = None, general  # (installed the other way: made afresh)
        free = self._blocks_free()  # which routers' MoE blocks need no wrapper
        kept = self._watch
        same = kept is not None and kept[0].holds()  # (`watched` walks every class's namespace: this runs per context)
        if same:
            watch = kept[1]
        else:
            seen = Unchanged(self.sites)  # (taken first: a change in between is found by the next context)
            watch = watched(self.sites)
            self._watch = (seen, watch)
        if same and free == self.unwrapped and not stale(self.warm.facts, watch) and self._patches.redo():
            # no router's or block's class, method or own forward changed since the last install (an unwrapped block
            # has no patch for `redo` to check), and the last context's patches are set again as they were (which
            # also means no other hub's patch is on its modules): the facts the hub kept still hold
            return
        # the facts about each router (a router of a class patched since has none yet), and where to intercept
        facts = facts_for(self.warm.facts, watch)
        self.facts = [facts[type(s.router)].of(s) for s in self.sites]
        self.router_only = [{} if general else f.topk_in_router for f in self.facts]
        free = self._blocks_free()
        for site in self.sites:
            other = patched_by(site.router.__dict__.get("forward"))
            if other is not None:
                raise NestedContextError(
                    f"router {site.name!r} is already hooked by a context opened on "
                    f"{type(other.model).__name__}; open every record/replay context of a model on the same module"
                )
        self.unwrapped = None  # until every patch below is set (a failed install is undone, never redone)
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
            if not free[i]:  # a router known to select inside itself in both modes needs no block wrapper
                patch(site.scope, "forward", lambda inner, i=i: router_wrapper(self, i, inner, None))
            patch(site.router, "forward", lambda inner, i=i, s=site: router_wrapper(self, i, inner, s.logits_index))
        for layer, router in self.layout.idle:  # PEFT copies that did not run at entry must not run inside
            patch(router, "forward", partial(refuse_idle, layer))
        self.unwrapped = free


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
            return len(hub.session.recorders), len(hub.session.replayers)
    return 0, 0
