"""What running a router class taught the hub, kept per model so that it outlives the hub.

The hub is dropped when the last context on a model closes, and an RL loop opens a context per minibatch: the facts
live on the model (not in module globals) so they are learned once per model and router class.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from torch import nn

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


def signature_cache(model: nn.Module) -> dict:
    """The model's cache of its forwards' parsed signatures (steps.py), kept across hubs like the facts."""
    cache = model.__dict__.get(SIGNATURES)
    if cache is None:
        cache = model.__dict__[SIGNATURES] = {}
    return cache
