"""What the rollout-engine importers (vLLM, SGLang) share: the trainer model's MoE layers, the engine's column count,
and the checks that name both sides.

Shape legend: L MoE layers, C engine columns (one per decoder layer), K experts per token.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ..routes import LayerInfo


def layers_of(model: nn.Module | Sequence[LayerInfo]) -> tuple[LayerInfo, ...]:
    """The MoE layers (names, E, K, in forward order) of a trainer model, or `model` itself if it is a list of
    `LayerInfo`. A Hugging Face model runs one no-grad forward of one token under `record_routes` to learn them
    (refused while a context is open on it); a megatron-core model lists its routers, except multi-token-prediction
    ones (a replay routes those live).

    Example:
        >>> layers_of(model)[0]  # doctest: +SKIP
        LayerInfo(name='model.layers.0.mlp.gate', num_experts=16, top_k=2)
    """
    if isinstance(model, Sequence):
        layers = tuple(model)
        if not layers or not all(isinstance(layer, LayerInfo) for layer in layers):
            raise ValueError("layers must be a trainer model or a non-empty list of LayerInfo")
        return layers
    from ..engines import megatron

    if megatron.is_megatron_model(model):  # (without its multi-token-prediction routers: engines do not run them)
        from ..engines.megatron.routers import find_routers, is_mtp

        return tuple(site.info for site in find_routers(model) if not is_mtp(site.name))
    from ..analysis import teacher_forced_routes
    from ..engines.hf.hub import open_contexts

    if any(open_contexts(model)):
        raise ValueError(
            f"the importer learns {type(model).__name__}'s MoE layers by one forward, which the record_routes / "
            "replay_routes context open on it would record or replay: import before opening the context, or pass "
            "the layers instead of the model (a recording's routes.layers, or a list of LayerInfo)"
        )
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    return teacher_forced_routes(model, torch.ones(1, 1, dtype=torch.long, device=device)).layers


def decoder_layers(model: nn.Module | Sequence[LayerInfo]) -> int | None:
    """`num_hidden_layers` (Hugging Face) or `num_layers` (megatron-core) of a model's config; None if unknown.

    Example:
        >>> decoder_layers([LayerInfo("l0", 4, 2)]) is None
        True
    """
    config = getattr(model, "config", None)
    for key in ("num_hidden_layers", "num_layers"):
        value = getattr(config, key, None)
        if isinstance(value, int):
            return value
    return None


def check_columns(engine: str, columns: int, layers: Sequence[LayerInfo], decoder: int | None) -> None:
    """Raise unless an engine's column count is one per MoE layer or one per decoder layer of the model (`decoder`;
    None: unknown, nothing to check).

    Example:
        >>> check_columns("SGLang", 3, [LayerInfo("model.layers.0.mlp.gate", 4, 2)], decoder=3)
    """
    if decoder is None:  # unknown (a list of LayerInfo): the decoder-layer numbers in the names must fit
        return
    if columns not in (len(layers), decoder):
        raise ValueError(
            f"{engine} returned routes for {columns} layers but the model has {len(layers)} MoE layers and "
            f"{decoder} decoder layers"
        )


def check_row_length(engine: str, where: str, rows: int, prompt: int, completion: int) -> None:
    """Raise unless an engine returned prompt + completion - 1 rows (the last sampled token is never an input).

    Example:
        >>> check_row_length("vLLM", "output 0", rows=7, prompt=5, completion=3)
    """
    if rows != prompt + completion - 1:
        raise ValueError(
            f"{engine} {where}: routes hold {rows} positions but its {prompt} prompt and {completion} completion "
            f"tokens need prompt + completion - 1 = {prompt + completion - 1}"
        )


def count(value: Any, name: str, where: str) -> int:
    """len() of a token list, or an int count, or a clear error.

    Example:
        >>> count([5, 6, 7], "token_ids", "vLLM output 0"), count(4, "prompt_tokens", "SGLang response 1")
        (3, 4)
    """
    if isinstance(value, int):
        return value
    if value is None:
        raise ValueError(f"{where} has no {name}: cannot check the length of its routes")
    return len(value)
