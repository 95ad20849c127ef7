"""`keep_warm`: what the contexts on one model learn, kept across them only while a scope the user opens is open.

A context learns about the model it hooks: the walk of its modules (layout.py), facts about its routers
(facts.py), its forwards' parsed signatures (tracker.py) and the hub with its wrappers (hub.py). Without a scope all of
it belongs to the open contexts and goes with the last one: nothing of moe-replay stays on the model. Inside `with
keep_warm(model):` it is kept for the next context (an RL loop opens one per minibatch or log-prob chunk), as torch's
`parametrize.cached()` keeps its caches; a copy or a saved model made inside the scope carries none of it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from torch import nn

from ...errors import ReplayError
from .patch import MARKER, Patches

ATTR = "_moe_replay_warm"


@dataclass(eq=False)
class Warm:
    """What contexts on one model learned: its layout (which keeps the hub), its routers' facts by class (facts.py's
    `ClassFacts`), its forwards' signatures."""

    layout: Any = None
    facts: dict[type, Any] = field(default_factory=dict)
    signatures: dict = field(default_factory=dict)

    def drop(self) -> None:
        """Let go of the layout and release the hub kept with it (hub.py), which refer to each other and to this
        state: they are freed at once, not at the next garbage collection."""
        layout, self.layout = self.layout, None
        if layout is not None:
            hub = layout.kept.pop("hub", None)
            layout.kept.clear()
            if hub is not None:
                hub.release()


def warm_state(model: nn.Module) -> Warm:
    """The `Warm` of the `keep_warm` scope open on `model`, or a new one (which lives as long as its contexts)."""
    found = model.__dict__.get(ATTR)
    return found if isinstance(found, Warm) else Warm()


def is_warm(model: object) -> bool:
    """Whether `model` is a transformers model walked by a context inside a `keep_warm` scope still open on it (then
    it needs no other test of which engine it runs on).

    Example:
        >>> is_warm(nn.Linear(2, 2))
        False
    """
    found = getattr(model, "__dict__", {}).get(ATTR)
    return isinstance(found, Warm) and found.layout is not None


class KeepWarm:
    """Context manager returned by `keep_warm`; `facts` shows what was learned about each router."""

    def __init__(self, model: nn.Module) -> None:
        if not isinstance(model, nn.Module):
            raise ValueError(f"keep_warm needs a model (torch.nn.Module), got {type(model).__name__}")
        self.model = model
        self.warm: Warm | None = None
        self._patches: Patches | None = None  # None: an outer scope on the model holds the state

    def __enter__(self) -> KeepWarm:
        if self.warm is not None:
            raise RuntimeError("this keep_warm scope is already open")
        found = self.model.__dict__.get(ATTR)
        if isinstance(found, Warm):
            self.warm = found
        else:
            if MARKER in self.model.__dict__:  # (its hooks would be undone under the scope's)
                raise ReplayError(
                    f"keep_warm cannot open on {type(self.model).__name__} while a record/replay context is open on "
                    "it: open the scope around the contexts"
                )
            self.warm, self._patches = Warm(), Patches(owner=self)
            self._patches.set(self.model, ATTR, self.warm)  # (a copy or pickle of the model leaves it out)
        return self

    def __exit__(self, *exc: object) -> None:
        patches, self._patches, warm, self.warm = self._patches, None, self.warm, None
        if patches is None:
            return
        hub = self.model.__dict__.get(MARKER)
        if hub is not None:  # a context opened inside is still open (an ExitStack closing out of order): its hub
            hub.undo_after(patches)  # drops the scope's state after its own hooks, as the last one closes
        else:
            patches.undo()
            patches.close()
            warm.drop()

    @property
    def facts(self) -> dict[str, Any]:
        """Per router the contexts hooked, by name: what the calls of the modules there last taught (facts.py's
        `RouterFacts`, per training mode: where its top-k runs, which output is its indices, whether its top-k is
        redirected; empty until it runs). The scope's own objects: read them, do not change them."""
        if self.warm is None:
            raise RuntimeError("keep_warm(...).facts is read inside the scope")
        return {name: kept[-1] for found in self.warm.facts.values() for name, kept in found.routers.items() if kept}


def keep_warm(model: nn.Module) -> KeepWarm:
    """Keep what record/replay contexts on `model` learn (its module walk, router facts, wrappers) from one context to
    the next while the scope is open, and drop it when it closes: a training loop that opens a context per minibatch
    then pays the walk once. Open it on the module the contexts are given, around them; nested scopes share the
    outermost one's state. Without it each outermost context starts cold and leaves nothing on the model.

    Example:
        >>> with keep_warm(model):  # doctest: +SKIP
        ...     for batch, routes in minibatches:
        ...         with replay_routes(model, routes):
        ...             loss_fn(model(batch)).backward()
    """
    return KeepWarm(model)
