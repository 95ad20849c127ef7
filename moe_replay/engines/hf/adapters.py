"""Routers that PEFT trains in full beside its adapters (`modules_to_save`): which copy runs, and its layer name.

PEFT wraps each module named in `modules_to_save` (the router, or the whole MoE block) in a `ModulesToSaveWrapper`
that holds the frozen `original_module` and one trainable copy per adapter in `modules_to_save.<adapter>`, and runs
the active adapter's copy, or `original_module` while adapters are disabled (`disable_adapter()`, the reference
forward) or the active adapter has no copy. The router of a layer is the copy that runs. Its layer name leaves out
the wrapper's segments, so routes recorded under one adapter replay under another or with adapters disabled."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from torch import nn

from ...errors import ReplayError


def is_saved_wrapper(module: nn.Module) -> bool:
    """Whether `module` is a PEFT `ModulesToSaveWrapper`, by what it holds (no PEFT import).

    Example:
        >>> is_saved_wrapper(nn.Linear(2, 2))
        False
    """
    sub = module._modules
    wraps = isinstance(sub.get("original_module"), nn.Module) and isinstance(sub.get("modules_to_save"), nn.ModuleDict)
    return wraps and hasattr(module, "active_adapters") and hasattr(module, "disable_adapters")


def running_copy(wrapper: nn.Module) -> nn.Module:
    """The copy a PEFT `ModulesToSaveWrapper` runs now, as its forward picks: the active adapter's, else the original.

    Example:
        >>> running_copy(peft_model.base_model.model.model.layers[0].mlp.gate)  # doctest: +SKIP
        Qwen3MoeTopKRouter(...)
    """
    active, copies = list(wrapper.active_adapters), wrapper.modules_to_save
    if wrapper.disable_adapters or not active or any(a not in copies for a in active):
        return wrapper.original_module
    return copies[active[0]]


def saved_copies(modules: Mapping[str, nn.Module]) -> dict[str, nn.Module]:
    """Every PEFT `ModulesToSaveWrapper` of a model walk (`dict(model.named_modules())`), by qualified name.

    Example:
        >>> saved_copies(dict(nn.Sequential(nn.Linear(2, 2)).named_modules()))
        {}
    """
    return {name: m for name, m in modules.items() if is_saved_wrapper(m)}


def copy_of(name: str, wrappers: Mapping[str, nn.Module]) -> tuple[str, bool] | None:
    """For a module `name` inside a copy held by any of `wrappers` (from `saved_copies`): its layer name without the
    wrappers' segments, and whether every copy holding it is the one that runs now; None when it lies in no copy.

    Example:
        >>> copy_of("m.layers.0.mlp.modules_to_save.default.gate", {"m.layers.0.mlp": wrapper})  # doctest: +SKIP
        ('m.layers.0.mlp.gate', True)
    """
    parts, dropped, runs = name.split("."), set(), True
    for cut in range(1, len(parts)):
        if (wrapper := wrappers.get(".".join(parts[:cut]))) is None:
            continue
        if parts[cut] == "original_module":
            held, width = wrapper.original_module, 1
        elif parts[cut] == "modules_to_save" and cut + 1 < len(parts):
            held, width = wrapper.modules_to_save[parts[cut + 1]], 2
        else:
            continue  # (a module of the wrapper itself)
        dropped.update(range(cut, cut + width))
        runs = runs and held is running_copy(wrapper)
    return (".".join(p for i, p in enumerate(parts) if i not in dropped), runs) if dropped else None


def idle_copies(
    modules: Mapping[str, nn.Module], wrappers: Mapping[str, nn.Module], classes: tuple[type, ...]
) -> tuple[tuple[str, nn.Module], ...]:
    """The routers (instances of `classes`) in the copies of `wrappers` (`saved_copies(modules)`) that do not run now,
    with their layer names: a context refuses their forward, which means adapters were switched or disabled inside it.

    Example:
        >>> idle_copies(modules, saved_copies(modules), (Qwen3MoeTopKRouter,))  # doctest: +SKIP
        (('base_model.model.model.layers.0.mlp.gate', Qwen3MoeTopKRouter(...)), ...)
    """
    if not wrappers:
        return ()
    copies = ((copy_of(name, wrappers), m) for name, m in modules.items() if isinstance(m, classes))
    return tuple((copy[0], m) for copy, m in copies if copy is not None and not copy[1])


def refuse_idle(layer: str, inner: Callable[..., Any]) -> Callable[..., Any]:
    """A forward for an idle copy's router (`idle_copies`) that raises `ReplayError` naming its layer.

    Example:
        >>> router.forward = refuse_idle("model.layers.0.mlp.gate", router.forward)  # doctest: +SKIP
    """

    def forward(*args: Any, **kwargs: Any) -> Any:
        raise ReplayError(
            f"router {layer!r} ran a PEFT modules_to_save copy other than the one that ran when the moe-replay "
            "context opened: an adapter was switched or disabled inside the context, whose hooks are on the copy that "
            "ran then; switch or disable adapters before opening the context (or between contexts)"
        )

    return forward
