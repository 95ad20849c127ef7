"""Routes that do not fit the forward they are replayed on: another batch size or length, positions left unused,
another model's layers, expert count or k; and routes laid out for another batch or another model, which replay used
to apply without an error: routes recorded on a left-padded batch replayed on the same sequences right-padded, and
engine layer names whose layer numbers contradict the model's MoE layers (matched by order before)."""

from __future__ import annotations

import pytest
import torch
from helpers import hook_count, left_padded, recorded, tiny_qwen3_moe

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


def test_wrong_batch_and_length(qwen):
    ids, mask = left_padded(3, 6, [0, 0, 2])
    routes = recorded(qwen, ids, mask)
    with pytest.raises(ReplayError, match="routes hold B=3 sequences but the forward has batch 2"):
        with replay_routes(qwen, routes):
            qwen(ids[:2], attention_mask=mask[:2])
    longer = torch.cat([ids, ids[:, :2]], 1)
    with pytest.raises(ReplayError, match=r"covers positions 0..7 but the routes hold T=6"):
        with replay_routes(qwen, routes):
            qwen(longer)
    assert hook_count(qwen) == 0


def test_unconsumed_routes_are_an_error(qwen):
    ids, mask = left_padded(2, 6, [0, 0])
    routes = recorded(qwen, ids, mask)
    with pytest.raises(ReplayError, match=r"left recorded routes unused: .* at positions \[4, 5\]"):
        with replay_routes(qwen, routes):
            qwen(ids[:, :4])
    with pytest.raises(ReplayError, match="never run"):
        with replay_routes(qwen, routes):
            pass
    # dropping positions whose routes are masked is fine (e.g. the last sampled token)
    trimmed = Routes(routes.indices, routes.mask.clone().index_fill_(1, torch.tensor([5]), False), routes.layers)
    with replay_routes(qwen, trimmed):
        qwen(ids[:, :5])


def test_other_layer_set_is_an_error(qwen):
    ids, mask = left_padded(2, 6, [0, 0])
    routes = recorded(qwen, ids, mask)
    deeper = tiny_qwen3_moe(layers=4)
    with pytest.raises(
        ReplayError, match=r"routes hold layers .* but Qwen3MoeForCausalLM has routers .*model.layers.3"
    ):
        with replay_routes(deeper, routes):
            pass
    # names that match no router map by layer order only when the layer count agrees (layers.match_layers)
    three = Routes(routes.indices[:, :, [0, 1, 1]], routes.mask, [LayerInfo(f"x.{i}", 8, 2) for i in range(3)])
    with pytest.raises(ReplayError, match=r"route layers without a router: \[.x.0., .x.1., .x.2.\]"):
        with replay_routes(qwen, three):
            pass
    half = Routes(routes.indices, routes.mask, [LayerInfo("x.0", 8, 2), LayerInfo(routes.layer_names[1], 8, 2)])
    with pytest.raises(ReplayError, match=r"route layers without a router: \[.x.0.\]"):
        with replay_routes(qwen, half):
            pass
    more_experts = Routes(routes.indices, routes.mask, [LayerInfo(n, 16, 2) for n in routes.layer_names])
    with pytest.raises(ReplayError, match="has E=8 experts but the routes hold E=16"):
        with replay_routes(qwen, more_experts):
            qwen(ids, attention_mask=mask)
    top3 = tiny_qwen3_moe(top_k=3)
    with pytest.raises(ReplayError, match=r"hold k=2 of E=8 experts .* top-k calls were \(E, k\) = \[\(8, 3\)\]"):
        with replay_routes(top3, routes):
            top3(ids, attention_mask=mask)
    assert hook_count(qwen) == hook_count(deeper) == hook_count(top3) == 0
