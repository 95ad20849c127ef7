"""What the rollout-engine importers (vLLM, SGLang) share: the trainer model's MoE layers, the engine's column count,
the checks that name both sides, and `Routes.from_rows` with its errors naming the engine's response.

Shape legend: L MoE layers, C engine columns (one per decoder layer), K experts per token.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch
from torch import nn

from ..deprecation import moved
from ..routes import LayerInfo, Routes
from ..routes.index import is_integer_scalar
from ..routes.rows import engine_columns, pad_offsets

ROW = re.compile(r"^row (\d+)\b|\bsequence (\d+)\b")  # how `Routes.from_rows` names the row it refuses


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
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def check_columns(where: str, columns: int, layers: Sequence[LayerInfo], decoder: int | None) -> None:
    """Raise unless a row's column count is one per MoE layer or one per decoder layer of the model (`decoder`;
    None: unknown, nothing to check); `where` names the engine's response.

    Example:
        >>> check_columns("SGLang response 0", 3, [LayerInfo("model.layers.0.mlp.gate", 4, 2)], decoder=3)
    """
    if decoder is None:  # unknown (a list of LayerInfo): the decoder-layer numbers in the names must fit
        return
    if columns not in (len(layers), decoder):
        raise ValueError(
            f"{where}: returned routes for {columns} layers but the model has {len(layers)} MoE layers and "
            f"{decoder} decoder layers"
        )


def check_row_length(where: str, rows: int, prompt: int, completion: int, start: int = 0, name: str = "") -> None:
    """Raise unless an engine returned prompt + completion - 1 - `start` rows (the last sampled token is never an
    input; the first `start` positions were not asked for, `name` says by which argument).

    Example:
        >>> check_row_length("vLLM output 0", rows=7, prompt=5, completion=3)
        >>> check_row_length("vLLM output 0", rows=5, prompt=5, completion=3, start=2, name="prompt_start")
    """
    if start > prompt:
        raise ValueError(f"{where}: {name}={start} is past its prompt of {prompt} tokens")
    if rows != prompt + completion - 1 - start:
        skipped = f" - {name} {start}" if start else ""
        raise ValueError(
            f"{where}: routes hold {rows} positions but its {prompt} prompt and {completion} completion tokens "
            f"need prompt + completion - 1{skipped} = {prompt + completion - 1 - start}"
        )


def start_offsets(start: int | Sequence[int] | torch.Tensor | None, requests: int, name: str) -> list[int]:
    """`start` (an engine's offset of the first returned position: one for all requests, or one per request) as one
    whole number >= 0 per request, or a ValueError naming both counts.

    Example:
        >>> start_offsets(2, 3, "prompt_start"), start_offsets([0, 4], 2, "prompt_start")
        ([2, 2, 2], [0, 4])
    """
    if start is None:
        return [0] * requests
    if is_integer_scalar(start):
        given = [start] * requests
    elif isinstance(start, torch.Tensor | np.ndarray | list | tuple):
        given = start.tolist() if isinstance(start, torch.Tensor | np.ndarray) else list(start)
        if len(given) != requests:
            raise ValueError(f"{name} has {len(given)} offsets for {requests} requests")
    else:
        raise ValueError(f"{name} must be a whole number or one per request, got {start!r}")
    bad = next((g for g in given if not is_integer_scalar(g) or g < 0), None)
    if bad is not None:
        raise ValueError(f"{name} must hold whole numbers >= 0, got {bad!r}")
    return [int(g) for g in given]


def batch_length(lengths: Sequence[int], pad_left: Sequence[int] | torch.Tensor | None) -> int:
    """The batch length T that the token counts give: the longest `pad_left[i]` + prompt + completion tokens of row
    i (its routes hold one position less: the last sampled token is never an input).

    Example:
        >>> batch_length([5, 9], pad_left=[4, 0])
        9
    """
    pads = pad_offsets(pad_left, len(lengths))
    return max((p + n for p, n in zip(pads, lengths, strict=True)), default=0)


def from_engine_rows(
    engine: str,
    rows: Sequence[np.ndarray],
    names: Sequence[str],
    layers: Sequence[LayerInfo],
    **kwargs: Any,
) -> Routes:
    """`Routes.from_rows(rows, layers, **kwargs)` of an engine's checked rows, each error naming the row's response
    (`names[i]`, e.g. "vLLM output 2, completion 0, routed_experts"): the column counts are checked here first
    (each must map the layers, and all agree), and a refusal of row i or sequence i is prefixed with `names[i]`.

    Example:
        >>> from_engine_rows("vLLM", [np.array([[[0, 1]]])], ["vLLM output 0"], [LayerInfo("l0", 4, 2)]).batch_size
        1
    """
    first: dict[int, str] = {}  # column count -> the first row's name with it
    for row, name in zip(rows, names, strict=True):
        if row.shape[0]:
            first.setdefault(row.shape[1], name)
    for columns, name in first.items():
        try:
            engine_columns(layers, columns)
        except ValueError as e:
            raise ValueError(f"{name}: {e}") from e
    if len(first) > 1:
        (c0, n0), (c1, n1) = list(first.items())[:2]
        raise ValueError(f"{n1}: routes hold {c1} layer columns, but those of {n0} hold {c0}")
    try:
        return Routes.from_rows(rows, layers, **kwargs)
    except ValueError as e:
        found = ROW.search(str(e))
        i = None if found is None else int(found.group(1) or found.group(2))
        raise ValueError(f"{names[i] if i is not None and i < len(names) else engine}: {e}") from e


# deprecated names, one release: each read warns and names its new place
__getattr__ = moved(__name__, renamed={"rows_to_routes": "moe_replay.integrations.rollout.from_engine_rows"})
