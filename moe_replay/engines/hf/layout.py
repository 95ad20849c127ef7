"""What a hub needs to know about a model's module tree, found by one walk and kept on the model between contexts.

An RL loop opens a context per minibatch or per log-prob chunk; walking every module each time costs more than the
router calls of a small forward. The routers, their scopes and the tracked models are kept on the model with a
stamp: every module on the path from the model to a router (or to a tracked model), with its named children. A context
reuses them only if every path still leads to the same modules and every module on it still has the same children,
so a router added, removed or replaced anywhere along those paths (a new layer, a dense layer swapped for an MoE
one, a PEFT or checkpoint wrapper) is found by a fresh walk.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter, eq

from torch import nn

from .discover import RouterSite, find_routers

ATTR = "_moe_replay_layout"
# (the modules on the paths, a copy of each one's children by name)
Stamp = tuple[tuple[nn.Module, ...], tuple[dict[str, nn.Module | None], ...]]
_CHILDREN = attrgetter("_modules")


@dataclass(frozen=True)
class Layout:
    """The routers of a model, the models inside it whose outermost forward is a step (the model first), and the
    stamp they hold for: each module on the paths to them, with its children."""

    sites: tuple[RouterSite, ...]
    tracked: tuple[nn.Module, ...]
    stamp: Stamp
    # kept with the layout while it holds: the model's hub ("hub") and match_layers' results (per routes' layers)
    kept: dict = field(default_factory=dict, compare=False)


def model_layout(model: nn.Module) -> Layout:
    """The model's routers and tracked models: the kept ones while the stamp holds, else from a fresh walk.

    Example:
        >>> [site.name for site in model_layout(model).sites]  # doctest: +SKIP
        ['model.layers.1.mlp.gate', 'model.layers.2.mlp.gate']
    """
    kept = model.__dict__.get(ATTR)
    if isinstance(kept, Layout) and _holds(model, kept):
        return kept
    modules = dict(model.named_modules())
    sites = tuple(find_routers(model, modules))
    tracked = _tracked(model, sites, modules)
    paths = tuple(s.name for s in sites) + tuple(name for name, _ in tracked)
    targets = [s.router for s in sites] + [m for _, m in tracked]
    layout = Layout(sites, (model, *(m for _, m in tracked)), _stamp(model, paths, targets))
    model.__dict__[ATTR] = layout
    return layout


def _holds(model: nn.Module, layout: Layout) -> bool:
    """Whether every module of the stamp still has the same children under the same names (the model first): then
    every path leads, step by step, through the same modules to the same targets."""
    modules, children = layout.stamp
    if not modules or modules[0] is not model:
        return False
    # each module's children now against the copy taken then, compared in one C loop: this runs per context
    return all(map(eq, map(_CHILDREN, modules), children))


def _tracked(
    model: nn.Module, sites: tuple[RouterSite, ...], modules: dict[str, nn.Module]
) -> list[tuple[str, nn.Module]]:
    """Every transformers model inside `model` that holds all the routers, by name: like the model itself, its
    outermost forward is a step."""
    from transformers import PreTrainedModel

    names = [site.name for site in sites]
    return [
        (prefix, module)
        for prefix, module in modules.items()
        if prefix and isinstance(module, PreTrainedModel) and all(n.startswith(prefix + ".") for n in names)
    ]


def _stamp(model: nn.Module, paths: tuple[str, ...], targets: list[nn.Module]) -> Stamp:
    """Each module on the paths (the model first, each once) and a copy of its children by name; ((), ()) if a path
    is broken or does not end at its target."""
    seen: dict[int, nn.Module] = {id(model): model}
    for path, target in zip(paths, targets, strict=True):
        module = model
        for part in path.split("."):
            module = module._modules.get(part)
            if module is None:
                return (), ()
            seen.setdefault(id(module), module)
        if module is not target:
            return (), ()
    modules = tuple(seen.values())
    return modules, tuple(dict(m._modules) for m in modules)
