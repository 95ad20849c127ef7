"""What running a router class taught the hub, kept per model so that it outlives the hub.

The hub is dropped when the last context on a model closes, and an RL loop opens a context per minibatch: the facts
live on the model (not in module globals) so they are learned once per model and router class.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

from .patch import patched_by

ATTR = "_moe_replay_router_facts"
SIGNATURES = "_moe_replay_forward_signatures"


@dataclass
class RouterFacts:
    """Facts about one router class, learned from its calls (never from equal values).

    - `topk_in_router`: its selecting top-k ran inside the router's own forward (not in the MoE block around it), so
      interception can skip the block, whose experts run many ops. None until seen.
    - `output_index`: per training mode, the position j in the router's output that *is* the selecting top-k's
      indices tensor (None: no output is), so a recording without replay can read it and skip interception.
    - `redirect`: per training mode, how many top-k calls over each token's scores it makes, if every one is a
      `torch.topk` in its class's own `forward` (else 0), so that interception can redirect those calls instead of
      running the router under a mode (redirect.py).
    """

    topk_in_router: bool | None = None
    output_index: dict[bool, int | None] = field(default_factory=dict)
    redirect: dict[bool, int] = field(default_factory=dict)
    forward: object = None  # the class's `forward` they were learned on: a class patched since starts afresh

    def __getstate__(self) -> dict:
        """A saved or copied model's facts forget the function (a patched one may not pickle): relearned on use."""
        return {**self.__dict__, "forward": None}


def router_facts(model: nn.Module) -> dict[type, RouterFacts]:
    """The facts learned so far about the router classes of `model` (created empty on first use).

    Example:
        >>> with record_routes(model):  # doctest: +SKIP
        ...     model(ids)
        >>> router_facts(model)[Qwen3MoeTopKRouter].topk_in_router
        True
    """
    facts = model.__dict__.get(ATTR)
    if facts is None:
        facts = model.__dict__[ATTR] = {}
    return facts


def facts_for(model: nn.Module, classes: Iterable[type]) -> dict[type, RouterFacts]:
    """The (possibly still empty) facts about each router class in `classes` on `model`: new ones for a class whose
    `forward` was replaced since they were learned (a kernel library or a user patching the class between contexts).

    Example:
        >>> facts_for(model, {Qwen3MoeTopKRouter})[Qwen3MoeTopKRouter].redirect  # doctest: +SKIP
        {False: 1}
    """
    facts = router_facts(model)
    for cls in classes:
        forward = getattr(cls, "forward", None)
        found = facts.get(cls)
        if found is None or found.forward is not forward:
            facts[cls] = RouterFacts(forward=forward)
    return facts


def runs_class_methods(router: nn.Module) -> bool:
    """Whether `router` runs its class's own methods, on which its class's facts were learned: nothing set on the
    instance shadows one, except a hub's wrapper of the class's own `forward`. A forward or a helper method replaced
    on one router (a routing patch, an expert remap, another library's hook) may return other indices than its
    top-k selected, so its output is not read for them.

    Example:
        >>> runs_class_methods(nn.Linear(2, 2))
        True
    """
    cls = type(router)
    for name, value in router.__dict__.items():
        if name == "forward":
            inner = getattr(value, "__wrapped__", None)  # (a hub's wrapper of the forward that was there)
            if patched_by(value) is None or getattr(inner, "__func__", None) is not getattr(cls, "forward", None):
                return False
            if getattr(inner, "__self__", None) is not router:
                return False
        elif not name.startswith("__") and callable(value) and not isinstance(value, nn.Module):
            if getattr(cls, name, None) is not None:
                return False
    return True


def signature_cache(model: nn.Module) -> dict:
    """The model's cache of its forwards' parsed signatures (steps.py), kept across hubs like the facts."""
    cache = model.__dict__.get(SIGNATURES)
    if cache is None:
        cache = model.__dict__[SIGNATURES] = {}
    return cache
