"""What running a model's routers taught the hub: per router and training mode, learned from its own calls afresh by
each outermost context, or kept inside a `keep_warm` scope (warm.py) with the model's other warm state while the
router's class and methods, its MoE block's and the modules themselves are unchanged (an attribute of theirs changed
between contexts is not seen: make such changes before the scope opens, or reopen it).
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from operator import attrgetter, eq, is_
from typing import Any

from torch import nn

from .discover import RouterSite
from .patch import patched_by

KEPT = 4  # sets of modules whose facts a router name keeps (`ClassFacts.of`)
DESCRIPTORS = (staticmethod, classmethod, property)  # class attributes `class_methods` keeps besides callables
_MRO = attrgetter("__mro__")


@dataclass
class RouterFacts:
    """Facts about one router and its MoE block, learned from their own calls (never from equal values), per training
    mode: the routers of one class may differ (an attribute set on one router or on its block can change what the
    same code does), and so may one router in training and in eval.

    - `topk_in_router`: per training mode of the MoE block, whether the selecting top-k ran inside the router's own
      forward (not in the block around it) in every call seen, so interception can skip the block, whose experts run
      many ops. False once one call's block selected on its own, or ran the router more than once.
    - `output_index`: per training mode of the router, the position j in its output that *is* the selecting top-k's
      indices tensor (None: no output is), so a recording without replay can read it and skip interception.
    - `redirect`: per training mode of the router, how many top-k calls over each token's scores it makes, if every
      one is a `torch.topk` in its class's own `forward` (else 0), so that interception can redirect those calls
      instead of running the router under a mode (redirect.py).
    - `learned_on`: the router and block they were learned on (`site_key`); another module there starts afresh.
    """

    topk_in_router: dict[bool, bool] = field(default_factory=dict)
    output_index: dict[bool, int | None] = field(default_factory=dict)
    redirect: dict[bool, int] = field(default_factory=dict)
    learned_on: tuple | None = field(default=None, compare=False, repr=False)

    def __getstate__(self) -> dict:
        """A copied or saved model's facts forget the modules they were learned on: relearned on use."""
        return {**self.__dict__, "learned_on": None}


def site_key(site: RouterSite) -> tuple:
    """What a router's facts hold for besides its class (`watched`): the router and MoE block modules themselves (weak
    references), the block's class and a forward set on the block itself.

    Example:
        >>> site_key(model_layout(model, Warm()).sites[0])  # doctest: +SKIP
        (<weakref to 'Qwen3MoeTopKRouter'>, <weakref to 'Qwen3MoeSparseMoeBlock'>, Qwen3MoeSparseMoeBlock, None)
    """
    return (weakref.ref(site.router), weakref.ref(site.scope), type(site.scope), own_forward(site.scope))


@dataclass
class ClassFacts:
    """The facts of a router class's routers, by router name, and what they were learned on (`watched`: the class's
    methods and its MoE blocks' forwards); a class or a block patched since starts afresh. A name keeps the facts of
    the last `KEPT` sets of modules seen there (a PEFT `modules_to_save` router and its original take turns as
    adapters are enabled and disabled)."""

    watch: tuple | None = None
    routers: dict[str, list[RouterFacts]] = field(default_factory=dict)

    def of(self, site: RouterSite) -> RouterFacts:
        """The facts of the router at `site` and the modules there now (empty until their calls teach them)."""
        key = site_key(site)
        alive = [f for f in self.routers.get(site.name, ()) if f.learned_on]  # (a copy's facts forgot their modules)
        kept = [f for f in alive if all(ref() is not None for ref in f.learned_on[:2])]
        found = next((f for f in kept if f.learned_on == key), None)
        if found is None:
            found = RouterFacts(learned_on=key)
            kept = [*kept[1 - KEPT :], found]
        else:  # (the last one used goes last)
            kept = [f for f in kept if f is not found] + [found]
        self.routers[site.name] = kept
        return found

    def __getstate__(self) -> dict:
        """A saved or copied model's facts forget the functions (a patched one may not pickle): relearned on use."""
        return {**self.__dict__, "watch": None}


def class_methods(cls: type) -> tuple[tuple[str, Any], ...]:
    """The methods (and other descriptors) `cls` defines or inherits from classes below `nn.Module`, by name: a
    router class's facts hold while these do (its forward may call any of them).

    Example:
        >>> class Gate(nn.Linear):
        ...     def score(self, x):
        ...         return x
        >>> sorted(name for name, _ in class_methods(Gate))
        ['__init__', 'extra_repr', 'forward', 'reset_parameters', 'score']
    """
    found: dict[str, Any] = {}
    for klass in _below_module(cls.__mro__):
        for name, value in vars(klass).items():
            if name not in found and (callable(value) or isinstance(value, DESCRIPTORS)):
                found[name] = value
    return tuple(found.items())  # (in definition order: a method patched in place keeps its place)


def _below_module(mro: tuple[type, ...]) -> Iterator[type]:
    """The classes of `mro` whose methods a router class's facts depend on: all but `nn.Module` and `object`."""
    return (klass for klass in mro if klass is not nn.Module and klass is not object)


def watched(sites: Iterable[RouterSite]) -> dict[type, tuple]:
    """Per router class among `sites`, what its facts hold for: its methods (`class_methods`) and, for each MoE block
    around one of its routers, the block's class, that class's methods and a forward set on the block itself (the
    block may run its own top-k: `topk_in_router`). Computed as each stretch of contexts opens (a few microseconds).

    Example:
        >>> methods, blocks, _ = watched(model_layout(model).sites)[Qwen3MoeTopKRouter]  # doctest: +SKIP
        >>> blocks  # doctest: +SKIP
        frozenset({(<class '...Qwen3MoeSparseMoeBlock'>, None)})
    """
    found: dict[type, set] = {}
    for site in sites:
        scope = site.scope
        keys = found.get(type(site.router))
        if keys is None:
            keys = found[type(site.router)] = set()
        keys.add((type(scope), own_forward(scope)))
    blocks: dict[type, tuple] = {}
    watch = {}
    for cls, keys in found.items():
        for block, _ in keys:
            if block not in blocks:
                blocks[block] = class_methods(block)
        watch[cls] = (class_methods(cls), frozenset(keys), {b: blocks[b] for b, _ in keys})
    return watch


class Unchanged:
    """What `watched(sites)` reads, kept so that a later context can tell by a few C loops that it would read the same
    (and reuse its result): the routers' and MoE blocks' classes, the namespace of each class in their MROs (a copy),
    and each block's own `forward` attribute. Take it where no hub's patch is set on the sites' modules.

    Example:
        >>> seen = Unchanged(model_layout(model).sites)  # doctest: +SKIP
        >>> seen.holds()  # doctest: +SKIP
        True
    """

    __slots__ = ("routers", "scopes", "types", "forwards", "classes", "mros", "bases", "namespaces")

    def __init__(self, sites: Iterable[RouterSite]) -> None:
        sites = tuple(sites)
        self.routers = tuple(s.router for s in sites)
        self.scopes = tuple(s.scope for s in sites)
        self.types = (*map(type, self.routers), *map(type, self.scopes))
        self.forwards = [s.__dict__.get("forward") for s in self.scopes]
        self.classes = tuple(dict.fromkeys(self.types))
        self.mros = tuple(cls.__mro__ for cls in self.classes)
        self.bases = tuple(dict.fromkeys(k for mro in self.mros for k in _below_module(mro)))  # (as class_methods)
        self.namespaces = tuple(dict(vars(k)) for k in self.bases)

    def holds(self) -> bool:
        """Whether `watched` of the same sites would read what it read when this was taken."""
        try:  # (values compared by identity first: `==` runs only for a value that changed, and may raise)
            return (
                (*map(type, self.routers), *map(type, self.scopes)) == self.types
                and [s.__dict__.get("forward") for s in self.scopes] == self.forwards
                and all(map(is_, map(_MRO, self.classes), self.mros))
                and all(map(eq, map(vars, self.bases), self.namespaces))
            )
        except Exception:  # noqa: BLE001 (a changed value whose == raises: changed)
            return False


def own_forward(module: nn.Module) -> Any:
    """The forward set on `module` itself, seen through a hub's wrapper (None: it runs its class's)."""
    value = module.__dict__.get("forward")
    if value is None:
        return None
    if patched_by(value) is not None:
        value = getattr(value, "__wrapped__", None)
    if (
        getattr(value, "__func__", None) is getattr(type(module), "forward", None)
        and getattr(value, "__self__", None) is module
    ):
        return None
    return value


def facts_for(facts: dict[type, ClassFacts], watch: dict[type, tuple]) -> dict[type, ClassFacts]:
    """`facts` (a model's, by router class) with the (possibly still empty) facts of each router class in `watch`
    (`watched`): new ones for a class whose methods or MoE blocks changed since they were learned (a kernel library
    or a user patching them between contexts).

    Example:
        >>> facts_for({}, watched(sites))[Qwen3MoeTopKRouter].of(sites[0]).redirect  # doctest: +SKIP
        {}
    """
    for cls, now in watch.items():
        found = facts.get(cls)
        if found is None or found.watch != now:
            facts[cls] = ClassFacts(watch=now)
    return facts


def stale(facts: dict[type, ClassFacts], watch: dict[type, tuple]) -> list[type]:
    """The router classes in `watch` (`watched`) whose `facts` were not learned on what they hold now.

    Example:
        >>> stale(hub.warm.facts, watched(hub.sites))  # doctest: +SKIP
        []
    """
    return [cls for cls, now in watch.items() if (found := facts.get(cls)) is None or found.watch != now]


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
