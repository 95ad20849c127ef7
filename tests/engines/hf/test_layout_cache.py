"""The module walk kept between contexts (layout.py): reused while the model's tree holds, found again when a router,
a layer or a wrapper changes it, so a context never hooks a stale set of routers."""

from __future__ import annotations

import copy

import torch
from families import build_tiny_model
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from moe_replay import record_routes
from moe_replay.engines.hf.layout import model_layout
from moe_replay.layers import plain_name


def recorded_layers(model, ids):  # noqa: ANN001, ANN202
    with torch.no_grad(), record_routes(model) as rec:
        model(ids)
    return rec.routes.layer_names


def test_layout_is_kept_and_found_again_when_the_tree_changes():
    model = build_tiny_model("qwen3_moe")
    ids = torch.randint(5, 100, (1, 6))
    first = recorded_layers(model, ids)
    kept = model_layout(model)
    assert model_layout(model) is kept  # no new walk while nothing changed
    assert recorded_layers(model, ids) == first

    layers = model.model.layers
    layers.append(copy.deepcopy(layers[-1]))  # a new MoE layer: its router must be hooked and recorded
    model.config.num_hidden_layers += 1
    grown = recorded_layers(model, ids)
    assert model_layout(model) is not kept and len(grown) == len(first) + 1

    kept = model_layout(model)
    block = layers[1].mlp
    block.gate = copy.deepcopy(block.gate)  # the same path, another router instance
    assert model_layout(model) is not kept
    assert model_layout(model).sites[0].router is block.gate

    kept = model_layout(model)
    layers[0] = copy.deepcopy(layers[1])  # the dense first layer swapped for an MoE one: same number of children
    assert model_layout(model) is not kept
    grown = recorded_layers(model, ids)
    assert len(grown) == len(first) + 2

    kept = model_layout(model)
    layers[1] = checkpoint_wrapper(layers[1])  # a wrapper renames the path: found again
    assert model_layout(model) is not kept
    assert [plain_name(n) for n in recorded_layers(model, ids)] == grown

    clone = copy.deepcopy(model)  # a copy never uses the original's modules
    assert all(
        a.router is not b.router for a, b in zip(model_layout(clone).sites, model_layout(model).sites, strict=True)
    )
