"""Routes laid out for another batch or another model, which replay used to apply without an error: routes recorded
on a left-padded batch replayed on the same sequences right-padded, and engine layer names whose layer numbers
contradict the model's MoE layers (matched by order before)."""

from __future__ import annotations

import pytest
import torch
from helpers import left_padded, recorded

from moe_replay import LayerInfo, ReplayError, Routes, replay_routes


def right_padded(ids, mask):
    """The same rows with their padding moved from the left to the right."""
    order = torch.argsort(mask == 0, dim=1, stable=True)  # real tokens first, in order
    return ids.gather(1, order), mask.gather(1, order)


def test_left_padded_routes_on_a_right_padded_batch_are_refused(qwen):
    ids, mask = left_padded(2, 7, [3, 0])
    routes = recorded(qwen, ids, mask)
    r_ids, r_mask = right_padded(ids, mask)
    assert torch.equal(r_mask[0], torch.tensor([1, 1, 1, 1, 0, 0, 0]))
    with pytest.raises(ReplayError, match="recorded at 3 positions that the forwards' attention masks mark as padding"):
        with replay_routes(qwen, routes):
            qwen(r_ids, attention_mask=r_mask)
    with replay_routes(qwen, routes):  # laid out as recorded: replays
        qwen(ids, attention_mask=mask)


def test_routes_imported_without_pad_left_are_refused(qwen):
    """An engine's rows placed from position 0 on a left-padded batch (pad_left forgotten)."""
    ids, mask = left_padded(2, 6, [2, 0])
    routes = recorded(qwen, ids, mask)
    rows = [routes.indices[b][routes.mask[b]] for b in range(2)]  # each row's recorded positions, as an engine's
    forgot = Routes.from_rows(rows, routes.layers, seq_len=6)
    with pytest.raises(ReplayError, match="imported without `pad_left`"):
        with replay_routes(qwen, forgot):
            qwen(ids, attention_mask=mask)
    placed = Routes.from_rows(rows, routes.layers, pad_left=[2, 0], seq_len=6)
    assert placed.equal(routes)
    with replay_routes(qwen, placed):
        qwen(ids, attention_mask=mask)


def test_a_replay_without_an_attention_mask_is_not_checked_for_padding(qwen):
    ids, mask = left_padded(2, 6, [2, 0])
    routes = recorded(qwen, ids, mask)
    with replay_routes(qwen, routes):  # (a packed or unpadded forward: every position is real)
        qwen(ids)


def test_engine_layer_numbers_that_contradict_the_models_moe_layers_are_refused(qwen):
    ids, mask = left_padded(1, 5, [0])
    routes = recorded(qwen, ids, mask)  # the model's MoE layers are decoder layers 0 and 2 (layer 1 is dense)
    assert routes.layer_names == ["model.layers.0.mlp.gate", "model.layers.2.mlp.gate"]
    for numbers, ok in (([0, 2], True), ([0, 1], False)):
        layers = [LayerInfo(f"decoder.layers.{n}.mlp.router", 8, 2) for n in numbers]  # another engine's names
        other = Routes(routes.indices, routes.mask, layers)
        if ok:
            with replay_routes(qwen, other):  # matched by order, numbers agreeing
                qwen(ids, attention_mask=mask)
            continue
        with pytest.raises(ReplayError, match="'decoder.layers.1.mlp.router' \\(decoder layer 1\\) would replay on"):
            replay_routes(qwen, other).__enter__()
