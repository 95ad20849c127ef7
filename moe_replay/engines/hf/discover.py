"""Find the routers of a Hugging Face MoE model by what they are: the classes its models register as router outputs.

Every MoE family in transformers 5.x declares `_can_record_outputs["router_logits"] = OutputRecorder(RouterClass,
index=i)` on its pretrained-model classes. The router modules are the instances of those classes; the index says which
output holds the [N, E] router logits."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from types import MappingProxyType

from torch import nn

from ...errors import UnsupportedModelError
from .adapters import copy_of, is_saved_wrapper, saved_copies

# Router classes that cannot be replayed, with the reason (every other family is tested family by family)
UNSUPPORTED: Mapping[str, str] = MappingProxyType(
    {
        "DogeCDMoE": (
            "Doge routes with product keys whose logits are mixed across tokens of the batch (not causal), "
            "so a token's experts depend on the other tokens and cannot be recorded per token"
        ),
    }
)


@dataclass(frozen=True)
class RouterSite:
    """One router: its qualified name, the router module, the module whose forward takes the top-k (`scope`), and the
    position of the [N, E] router logits in the router's output (`logits_index`)."""

    name: str
    router: nn.Module
    scope: nn.Module
    logits_index: int


def _router_recorders(modules: Iterable[nn.Module]) -> list[tuple[type, int, str | None]]:
    """(router class, logits output index, layer_name filter) registered by the model and its inner models."""
    found: list[tuple[type, int, str | None]] = []
    for module in modules:
        spec = getattr(type(module), "_can_record_outputs", None)
        if not isinstance(spec, dict) or (rec := spec.get("router_logits")) is None:
            continue
        target = getattr(rec, "target_class", rec)
        entry = (target, int(getattr(rec, "index", 0) or 0), getattr(rec, "layer_name", None))
        if isinstance(target, type) and entry not in found:
            found.append(entry)
    return found


def _caller(name: str, modules: Mapping[str, nn.Module], model: nn.Module) -> nn.Module:
    """The module that calls router `name`: its parent, or above a PEFT wrapper of the router (which passes it on)."""
    parent = name.rpartition(".")[0]
    while parent and (
        is_saved_wrapper(modules[parent])
        or (parent.endswith(".modules_to_save") and is_saved_wrapper(modules[parent.rpartition(".")[0]]))
    ):
        parent = parent.rpartition(".")[0]
    return modules[parent] if parent else model


def find_routers(model: nn.Module, modules: Mapping[str, nn.Module] | None = None) -> list[RouterSite]:
    """List the MoE routers of `model` in module order, or raise UnsupportedModelError naming the classes involved.
    `modules` is `dict(model.named_modules())` if the caller has it already (one walk of the model per context).

    Example:
        >>> [site.name for site in find_routers(model)]  # doctest: +SKIP
        ['model.layers.0.mlp.gate', 'model.layers.1.mlp.gate']
    """
    modules = dict(model.named_modules()) if modules is None else modules
    recorders = _router_recorders(modules.values())
    if not recorders:
        raise UnsupportedModelError(
            f"{type(model).__name__} registers no router outputs (no `_can_record_outputs['router_logits']` on any "
            "of its pretrained-model classes): it is not a transformers MoE model moe-replay recognises"
        )
    sites: list[RouterSite] = []
    wrappers = saved_copies(modules)  # PEFT's modules_to_save: only the copy that runs is a router
    for name, module in modules.items():
        for cls, index, layer_name in recorders:
            if not isinstance(module, cls) or (layer_name is not None and not name.endswith(layer_name)):
                continue
            if (copy := copy_of(name, wrappers) if wrappers else None) is not None and not copy[1]:
                break  # (a copy that does not run now)
            if type(module).__name__ in UNSUPPORTED:
                raise UnsupportedModelError(
                    f"{type(model).__name__}: router {name!r} ({type(module).__name__}) is not supported: "
                    f"{UNSUPPORTED[type(module).__name__]}"
                )
            sites.append(RouterSite(name if copy is None else copy[0], module, _caller(name, modules, model), index))
            break
    if not sites:
        classes = ", ".join(sorted({cls.__name__ for cls, _, _ in recorders}))
        raise UnsupportedModelError(f"{type(model).__name__} registers router classes ({classes}) but has no instances")
    if len({id(s.scope) for s in sites}) != len(sites):
        raise UnsupportedModelError(f"{type(model).__name__}: two routers share one parent module; not supported")
    return sites
