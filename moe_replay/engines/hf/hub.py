"""The hooks on one model, set as its first record/replay context opens and removed as its last one closes: one
`RouterHub`, shared by every context open on the model, so that a recording nested in a replay sees the replayed
experts. What the open contexts share is its `session` (session.py); each router is a `Router` (router.py).

The hooks are instance attributes (patch.py): the tracked models' `forward` (each outermost call a step, steps.py) and
`generate` (generation.py), each router's `forward`, and, for a router whose class declared.py does not declare, its
MoE block's `forward`. Each context walks the model afresh (layout.py; docs/host_cost.md has its cost), so
nothing of moe-replay stays on the model between contexts; a copied or saved model carries no hub.
"""

from __future__ import annotations

import threading
from functools import partial

from torch import nn

from ...errors import ForeignThreadError, NestedContextError
from .adapters import refuse_idle
from .call import Recorder, Replayer
from .declared import declarations, declared
from .generation import PACKED_GENERATION, generate_wrapper, refuse_packed
from .hooks import block_forward, router_forward
from .layout import Layout, model_layout
from .patch import MARKER, Patches, drop_stale, patched_by
from .router import Router, make_router
from .rules import selectors_for
from .session import Session
from .steps import step_wrapper


class RouterHub:
    """Hooks on one model, shared by every active record/replay context on it."""

    def __init__(self, model: nn.Module, layout: Layout) -> None:
        self.model = model
        self.layout = layout
        table = declarations()
        routers = tuple(
            make_router(i, s, selectors_for(s.router), declared(s.router, s.scope, table))
            for i, s in enumerate(layout.sites)
        )
        self.session = Session(routers)
        self._patches = Patches(owner=self)

    def __deepcopy__(self, memo: dict) -> None:
        return None  # a copied model makes its own

    def __reduce__(self) -> tuple:
        return (_forgotten, ())  # nor is a hub pickled with a saved model

    @property
    def routers(self) -> tuple[Router, ...]:
        return self.session.routers

    @classmethod
    def attach(cls, model: nn.Module, handler: Recorder | Replayer, *, replay: bool) -> RouterHub:
        """The model's hub (made and installed as its first context opens), with `handler` added to its session as a
        recorder or a replayer."""
        hub = model.__dict__.get(MARKER)
        if hub is not None and (hub.model is not model or not len(hub._patches)):
            drop_stale(model, hub)  # left on a shallow copy (copy.copy) of a hooked model
            hub = None
        if hub is None:
            hub = cls(model, model_layout(model))
            try:
                hub._install()
            except BaseException:
                hub._patches.undo()
                raise
        elif hub.session.thread != threading.get_ident():
            raise ForeignThreadError(
                f"a context cannot open on {type(model).__name__} in this thread while contexts opened in another "
                "thread are open on it: open and use a model's contexts in one thread"
            )
        hub.session.add(handler, replay=replay)
        return hub

    def detach(self, handler: Recorder | Replayer) -> None:
        """Remove `handler`; the last one out removes every hook."""
        session = self.session
        try:
            if session.held:
                session.hand_over()  # (a recorder's error on the held steps still lets the handler go)
        finally:
            if session.remove(handler):
                self._patches.undo()

    def _install(self) -> None:
        for site in self.layout.sites:
            if (other := patched_by(site.router.__dict__.get("forward"))) is not None:
                raise NestedContextError(
                    f"router {site.name!r} is already hooked by a context opened on {type(other.model).__name__}; "
                    "open every record/replay context of a model on the same module"
                )
        self._patches.set(self.model, MARKER, self)
        patch, session = self._patches.patch, self.session
        for module in self.layout.tracked:
            patch(module, "forward", partial(step_wrapper, self))
            if callable(getattr(module, "generate", None)):
                patch(module, "generate", partial(generate_wrapper, self))
            for name in PACKED_GENERATION:
                if callable(getattr(module, name, None)):
                    patch(module, name, partial(refuse_packed, name))
        for r in self.routers:
            if not r.declared:  # the general path: the block opens the call, intercepted whole
                patch(r.site.scope, "forward", partial(block_forward, session, r))
                r.block_hook = r.site.scope.__dict__["forward"]
            patch(r.site.router, "forward", partial(router_forward, session, r))
        for layer, router in self.layout.idle:  # PEFT copies that did not run at entry must not run inside
            patch(router, "forward", partial(refuse_idle, layer))


def _forgotten() -> None:
    """What a pickled hub loads as (a hub holds closures over a live model: it is never saved)."""
    return None


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
