"""Pipeline parallelism: which columns of a `Routes` a stage's routers use, and the stages' parts joined into one.

A stage (or a rank's virtual-pipeline chunks) holds some of the model's MoE layers; its routers are named by their
global layer number and know their global MoE-layer index (routers.py). A stage replays either the whole model's
routes (its columns are its global MoE indices, or its layer names) or its own part (what it recorded), and
`gather_pipeline_routes` puts every stage's part together, in whole-model layer order, on every rank.

Shape legend: B sequences, T positions, L layers, K experts per token.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from ...errors import ReplayError
from ...layers import match_layers, plain_name, same_module
from ...routes import LayerInfo, Routes, index_dtype
from .routers import Site, find_routers, total_moe_layers


def _same(a: str, b: str) -> bool:
    """Whether two layer names name the same module, by the rule `match_layers` uses."""
    return same_module(plain_name(a), plain_name(b))


def _indexless(name: str) -> str:
    """A module path with its numeric segments blanked: `decoder.layers.N.mlp.router`."""
    return re.sub(r"(^|\.)\d+(?=\.|$)", r"\1N", name)


def stage_columns(
    sites: Sequence[Site], held: Sequence[LayerInfo], owner: str, shapes: Mapping[str, tuple[int, int]]
) -> dict[str, int]:
    """Each router's column in routes that hold the whole model's MoE layers or only this stage's.

    By name when any layer name matches a router (routes recorded on Megatron, with or without pipeline
    parallelism); otherwise by order (routes from another engine): the whole model's routes give the stage the columns
    of its global MoE-layer indices, a part with as many layers as the stage gives them in order. Megatron names of
    other layers only (another stage's part) raise `ReplayError`, as does any other number of layers.

    Example:
        >>> stage_columns(find_routers(stage), hf_routes.layers, "GPTModel", shapes)  # doctest: +SKIP
        {'decoder.layers.2.mlp.router': 2, 'decoder.layers.3.mlp.router': 3}
    """
    names = [s.name for s in sites]
    named = [i for i, layer in enumerate(held) if any(_same(layer.name, n) for n in names)]
    if named:  # the matched layers must be exactly this stage's; the others belong to other stages
        columns = match_layers(names, [held[i] for i in named], owner, shapes)
        return {name: named[c] for name, c in columns.items()}
    if any(_same(_indexless(layer.name), _indexless(n)) for layer in held for n in names):
        raise ReplayError(
            f"routes hold layers {[layer.name for layer in held]} but {owner} is a pipeline stage with routers "
            f"{names}: these are routes of other layers of this model (another stage's part?); give the whole "
            "model's routes (gather_pipeline_routes) or this stage's own part"
        )
    total = total_moe_layers(sites)
    if len(held) == total:
        columns = match_layers(names, [held[s.position] for s in sites], owner, shapes)
        return {name: sites[c].position for name, c in columns.items()}
    if len(held) != len(sites):
        raise ReplayError(
            f"routes hold {len(held)} layers ({[layer.name for layer in held]}) but {owner} is a pipeline stage with "
            f"{len(sites)} of the model's {total} MoE layers (global MoE layers {[s.position for s in sites]}): give "
            f"the whole model's routes ({total} layers) or this stage's part ({len(sites)} layers)"
        )
    return match_layers(names, held, owner, shapes)


def gather_pipeline_routes(routes: Routes, model: nn.Module | Sequence[nn.Module], group: Any = None) -> Routes:
    """Join every pipeline stage's part of a batch's routes into the whole model's `Routes` [B, T, L, K] on every
    rank of the pipeline group (a collective: every stage calls it, with the same batch).

    `routes` is what this stage recorded (`record_routes(stage).routes`, or one micro-batch of it); `model` is the
    stage's model or its virtual-pipeline chunks, which place its layers in the whole model. `group` defaults to
    megatron's pipeline-parallel group. The result equals what a model without pipeline parallelism records.

    Example:
        >>> with record_routes(stage_model) as rec:  # doctest: +SKIP
        ...     forward_backward_func(forward_step_func=step, model=[stage_model], num_microbatches=4, ...)
        >>> whole = gather_pipeline_routes(rec.routes, stage_model)  # every stage's layers, on every rank
    """
    if group is None:
        from megatron.core import parallel_state

        group = parallel_state.get_pipeline_model_parallel_group()
    sites = find_routers(model)
    owner = type(model).__name__ if isinstance(model, nn.Module) else "virtual-pipeline chunks"
    shapes = {s.name: (s.info.num_experts, s.info.top_k) for s in sites}
    columns = stage_columns(sites, routes.layers, owner, shapes)
    B, T, _, K = routes.indices.shape
    local = routes.indices[:, :, [columns[s.name] for s in sites]]
    meta = (B, T, K, [(s.position, s.info) for s in sites])
    metas: list[Any] = [None] * torch.distributed.get_world_size(group)
    torch.distributed.all_gather_object(metas, meta, group=group)
    shapes_seen = sorted({m[:3] for m in metas})
    if len(shapes_seen) > 1:
        raise ReplayError(f"the pipeline stages hold routes of different (B, T, K): {shapes_seen}")
    width = max(len(m[3]) for m in metas)
    padded = torch.zeros(B, T, width, K, dtype=local.dtype, device=local.device)
    padded[:, :, : local.shape[2]] = local
    parts = [torch.empty_like(padded) for _ in metas]
    torch.distributed.all_gather(parts, padded, group=group)
    masks = [torch.empty_like(routes.mask) for _ in metas]
    torch.distributed.all_gather(masks, routes.mask.contiguous(), group=group)
    if any(not torch.equal(m, routes.mask) for m in masks):
        raise ReplayError("the pipeline stages recorded different positions (masks differ): gather one batch")
    placed = sorted(
        (
            (pos, info, part[:, :, j])
            for part, m in zip(parts, metas, strict=True)
            for j, (pos, info) in enumerate(m[3])
        ),
        key=lambda item: item[0],
    )
    positions, total = [p for p, _, _ in placed], total_moe_layers(sites)
    if positions != list(range(total)):
        raise ReplayError(
            f"the pipeline stages hold MoE layers {positions} but the model has {total}: every stage must record"
        )
    layers = tuple(info for _, info, _ in placed)
    dtype = index_dtype(max(info.num_experts for info in layers))
    indices = torch.stack([column for _, _, column in placed], dim=2).to(dtype)
    return Routes._trusted(indices, routes.mask.clone(), layers)
