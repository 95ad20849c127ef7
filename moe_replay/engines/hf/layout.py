"""A model's routers, the models whose outermost forward is a step, and idle PEFT copies' routers: one walk."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from .adapters import idle_copies, saved_copies
from .discover import RouterSite, find_routers


@dataclass(frozen=True)
class Layout:
    """The routers of a model, the models inside it whose outermost forward is a step (the model first), and the
    routers of the PEFT copies that did not run at the walk, by layer name."""

    sites: tuple[RouterSite, ...]
    tracked: tuple[nn.Module, ...]
    idle: tuple[tuple[str, nn.Module], ...] = ()


def model_layout(model: nn.Module) -> Layout:
    """The model's routers, tracked models and idle PEFT copies' routers, from one walk of its modules.

    Example:
        >>> [site.name for site in model_layout(model).sites]  # doctest: +SKIP
        ['model.layers.1.mlp.gate', 'model.layers.2.mlp.gate']
    """
    modules = dict(model.named_modules())
    sites = tuple(find_routers(model, modules))
    idle = idle_copies(modules, saved_copies(modules), tuple({type(s.router) for s in sites}))
    return Layout(sites, (model, *_tracked(model, sites, modules)), idle)


def _tracked(model: nn.Module, sites: tuple[RouterSite, ...], modules: dict[str, nn.Module]) -> list[nn.Module]:
    """Every transformers model inside `model` that holds all the routers: like the model itself, its outermost
    forward is a step."""
    from transformers import PreTrainedModel

    names = [site.name for site in sites]
    return [
        module
        for prefix, module in modules.items()
        if prefix and isinstance(module, PreTrainedModel) and all(n.startswith(prefix + ".") for n in names)
    ]
