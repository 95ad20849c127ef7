"""Which router of a model uses which layer of a `Routes`: the one matching rule shared by every engine.

A router matches a routes layer by its qualified module name (ignoring the path segments of transparent wrappers:
torch's checkpoint_wrapper, FSDP1, torch.compile); failing that by a unique dotted suffix (a model wrapped
in another module such as a PEFT or DDP wrapper, or routes recorded on an inner module); and when no layer name
matches any router at all (routes from another engine, which names its modules differently), by layer order, provided
the number of layers agrees and, where the engine knows them before the forward, E and K agree layer by layer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from .errors import ReplayError
from .routes import LayerInfo
from .routes.rows import decoder_index

# Path segments that wrappers insert without changing the model: torch's checkpoint_wrapper, FSDP1, torch.compile.
WRAPPER_SEGMENTS = ("_checkpoint_wrapped_module", "_fsdp_wrapped_module", "_orig_mod")


def plain_name(name: str) -> str:
    """`name` without the path segments of transparent wrappers (`WRAPPER_SEGMENTS`).

    Example:
        >>> plain_name("model.layers.0._checkpoint_wrapped_module.mlp.gate")
        'model.layers.0.mlp.gate'
    """
    return ".".join(part for part in name.split(".") if part not in WRAPPER_SEGMENTS)


def same_module(a: str, b: str) -> bool:
    """Whether two names (already through `plain_name`) name the same module: equal, or one a dotted suffix of the
    other (a wrapped model, or routes recorded on an inner module).

    Example:
        >>> same_module("base_model.model.layers.0.mlp.gate", "model.layers.0.mlp.gate")
        True
    """
    return a == b or a.endswith("." + b) or b.endswith("." + a)


def match_layers(
    routers: Sequence[str],
    held: Sequence[LayerInfo],
    owner: str,
    shapes: Mapping[str, tuple[int, int]] | None = None,
) -> dict[str, int]:
    """Map each router call name (`name`, or `name#n` for the n-th extra run of a looped layer) to its column in routes.

    `routers` are the model's router names in forward order, `held` the layers of the routes, `owner` the model's
    class name (for messages), `shapes` each router's (E, K) where known up front. Every router must get a layer and
    every layer a router; otherwise `ReplayError` names both sides.

    Example:
        >>> held = [LayerInfo("decoder.layers.0.mlp.router", 8, 2)]
        >>> match_layers(["model.layers.0.mlp.gate"], held, "Qwen3MoeForCausalLM")  # another engine: by order
        {'model.layers.0.mlp.gate': 0}
    """
    names = list(routers)
    held_names = [layer.name for layer in held]
    base = {h: h.partition("#")[0] for h in held_names}
    plain = {plain_name(n): n for n in names}
    mapping: dict[str, str] = {}
    named = False  # some layer name matches some router (even ambiguously): no fallback to layer order
    for b in set(base.values()):
        pb = plain_name(b)
        if pb in plain:
            mapping[b] = plain[pb]
            named = True
            continue
        hits = [n for p, n in plain.items() if same_module(p, pb)]  # no exact match (checked above): a suffix
        named |= bool(hits)
        if len(hits) == 1:
            mapping[b] = hits[0]
    if not named and len(held_names) == len(names) and all("#" not in h for h in held_names):
        columns = {name: i for i, name in enumerate(names)}  # another engine's names: by layer order
        _check_numbers(columns, held, owner)
        _check_shapes(columns, held, shapes)
        return columns
    missing = sorted(set(names) - set(mapping.values()))
    unknown = sorted(set(base.values()) - set(mapping))
    if missing or unknown or len(set(mapping.values())) != len(mapping):
        raise ReplayError(
            f"routes hold layers {held_names} but {owner} has routers {names} "
            f"(routers without routes: {missing}; route layers without a router: {unknown})"
        )
    columns = {mapping[base[h]] + h[len(base[h]) :]: i for i, h in enumerate(held_names)}
    _check_shapes(columns, held, shapes)
    return columns


def _check_numbers(columns: Mapping[str, int], held: Sequence[LayerInfo], owner: str) -> None:
    """Layers matched by order whose names both carry a decoder-layer number (`layers.<i>.`) must carry the same one:
    routes of decoder layers 0 and 1 are not those of a model whose MoE layers are 0 and 2."""
    for name, i in columns.items():
        ours, theirs = decoder_index(name), decoder_index(held[i].name)
        if ours is not None and theirs is not None and ours != theirs:
            raise ReplayError(
                f"routes layer {held[i].name!r} (decoder layer {theirs}) would replay on {owner}'s router {name!r} "
                f"(decoder layer {ours}) by layer order, but their layer numbers differ: the routes hold layers "
                f"{[layer.name for layer in held]} and the model's MoE layers are {list(columns)}"
            )


def _check_shapes(
    columns: Mapping[str, int], held: Sequence[LayerInfo], shapes: Mapping[str, tuple[int, int]] | None
) -> None:
    for name, (E, K) in (shapes or {}).items():
        layer = held[columns[name]]
        if (layer.num_experts, layer.top_k) != (E, K):
            raise ReplayError(
                f"routes layer {layer.name!r} has E={layer.num_experts}, K={layer.top_k} but router {name!r} has "
                f"E={E}, K={K}"
            )
