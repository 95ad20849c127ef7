"""What a hub needs to know about a model's module tree, found by one walk and kept between contexts in a
`keep_warm` scope (warm.py).

An RL loop opens a context per minibatch or per log-prob chunk; walking every module each time costs more than the
router calls of a small forward. The routers, their scopes and the tracked models are kept with a stamp: every module
that had children at the walk (the model first), with a copy of its children by name. A context reuses them only if
each of those modules still has the same children, so a module added, removed or replaced anywhere in the tree (a new
layer, a dense MLP or a whole dense layer swapped for an MoE one, a PEFT or checkpoint wrapper) is found by a fresh
walk. Not stamped: a child given to a module that had none (a Linear, a norm), whose forward calls no child.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from operator import attrgetter, eq

from torch import nn

from .adapters import idle_copies, running_copy, saved_copies
from .discover import RouterSite, find_routers
from .warm import Warm

# (the modules that have children, the model first; a copy of each one's children by name)
Stamp = tuple[tuple[nn.Module, ...], tuple[dict[str, nn.Module | None], ...]]
_CHILDREN = attrgetter("_modules")


@dataclass(frozen=True)
class Layout:
    """The routers of a model, the models inside it whose outermost forward is a step (the model first), and the
    stamp they hold for: each module of the model that has children, with its children."""

    sites: tuple[RouterSite, ...]
    tracked: tuple[nn.Module, ...]
    stamp: Stamp
    # each PEFT modules_to_save wrapper with the copy it ran at the walk (its routers are that copy's)
    copies: tuple[tuple[nn.Module, nn.Module], ...] = ()
    idle: tuple[tuple[str, nn.Module], ...] = ()  # the routers of the copies that did not run, by layer name
    # kept with the layout while it holds: the model's hub ("hub") and match_layers' results (per routes' layers)
    kept: dict = field(default_factory=dict, compare=False)


def model_layout(model: nn.Module, warm: Warm) -> Layout:
    """The model's routers and tracked models: those kept in `warm` while the stamp holds, else from a fresh walk
    (kept there).

    Example:
        >>> [site.name for site in model_layout(model, Warm()).sites]  # doctest: +SKIP
        ['model.layers.1.mlp.gate', 'model.layers.2.mlp.gate']
    """
    kept = warm.layout
    if isinstance(kept, Layout):
        # every module of the stamp still has the same children under the same names (the model first): then a walk
        # would find the same modules under the same names. Compared in one C loop, inline: this runs per context
        modules, children = kept.stamp
        if modules and modules[0] is model and all(map(eq, map(_CHILDREN, modules), children)):
            if all(running_copy(w) is c for w, c in kept.copies):  # (an adapter switched or disabled: walk again)
                return kept
    modules = dict(model.named_modules())
    sites = tuple(find_routers(model, modules))
    tracked = _tracked(model, sites, modules)
    parents = tuple(m for m in modules.values() if m._modules)  # (the model first: it holds the routers)
    wrappers = saved_copies(modules)
    copies = tuple((w, running_copy(w)) for w in wrappers.values())
    idle = idle_copies(modules, wrappers, tuple({type(s.router) for s in sites}))
    stamp = (parents, tuple(dict(m._modules) for m in parents))
    layout = Layout(sites, (model, *(m for _, m in tracked)), stamp, copies, idle)
    warm.drop()  # (the hub kept with the old layout, if any, is not open: a model's open hub is found first)
    warm.layout = layout
    return layout


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
