"""A model whose module tree the user edits between contexts: a layer added, a router or a whole layer replaced, a
dense MLP swapped for an MoE block (sparse upcycling), a layer wrapped for checkpointing, a block class that
picks its own experts moved to another layer, the model copied or saved. Each context walks the model as it is when
it opens: it records every router that runs now, as the experts the blocks used, under the names they have now, and
never a router, block or hub of another model or of an earlier context."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers import experts_used, left_padded, own_choice_forward, tiny_qwen3_moe
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from transformers.models.qwen3_moe import modeling_qwen3_moe

from moe_replay import ReplayError, record_routes, replay_routes
from moe_replay.engines.hf.declared import ENV
from moe_replay.layers import plain_name


@pytest.fixture(autouse=True)
def auto_path(monkeypatch):  # noqa: ANN001, ANN201
    monkeypatch.delenv(ENV, raising=False)  # the declarations apply unless a test sets the variable


def recorded_as_used(model, ids, mask):  # noqa: ANN001, ANN202
    """The routes of one forward, checked to be the experts each MoE layer's experts module was given."""
    recorder = record_routes(model)
    used = experts_used(model, ids, mask, recorder)
    routes = recorder.routes
    assert torch.equal(routes.indices.long().sort(-1).values[routes.mask], used[routes.mask])
    return routes


def test_layers_added_replaced_or_wrapped_between_contexts_are_recorded_as_they_are_now(qwen):
    """A new MoE layer appended, a router instance replaced (another one's weights), the dense layer replaced by an
    MoE layer, a layer wrapped for checkpointing: the next context records each router that runs, as used."""
    ids, mask = left_padded(2, 6, [0, 1])
    first = recorded_as_used(qwen, ids, mask).layer_names
    assert first == ["model.layers.0.mlp.gate", "model.layers.2.mlp.gate"]
    layers = qwen.model.layers

    def copy_of(layer: int, at: int):  # noqa: ANN202
        new = copy.deepcopy(layers[layer])
        new.self_attn.layer_idx = at  # (its KV cache slot)
        return new

    layers.append(copy_of(2, 3))
    qwen.config.num_hidden_layers += 1
    assert recorded_as_used(qwen, ids, mask).layer_names == [*first, "model.layers.3.mlp.gate"]
    before = recorded_as_used(qwen, ids, mask)
    layers[2].mlp.gate = copy.deepcopy(tiny_qwen3_moe(seed=1).model.layers[2].mlp.gate)  # the same path, another router
    after = recorded_as_used(qwen, ids, mask)
    assert not torch.equal(after.indices[..., 1, :], before.indices[..., 1, :])  # (the new router picks otherwise)
    layers[1] = copy_of(0, 1)  # the dense layer replaced by an MoE one
    grown = recorded_as_used(qwen, ids, mask).layer_names
    assert grown == [f"model.layers.{i}.mlp.gate" for i in range(4)]
    layers[1] = checkpoint_wrapper(layers[1])  # a wrapper renames the path
    assert [plain_name(n) for n in recorded_as_used(qwen, ids, mask).layer_names] == grown


def test_a_dense_mlp_swapped_for_an_moe_block_between_contexts_is_recorded_and_old_routes_are_refused(qwen):
    """Sparse upcycling in place: the dense layer keeps its place and gets an MoE block as its `mlp`. The next
    context records its router (found while profiling, when walks were kept: the new layer was silently left out);
    routes recorded before the swap hold no layer for it and are refused naming it; the new routes replay exactly."""
    ids, mask = left_padded(2, 6, [0, 1])
    before = recorded_as_used(qwen, ids, mask)
    assert "model.layers.1.mlp.gate" not in before.layer_names
    qwen.model.layers[1].mlp = copy.deepcopy(qwen.model.layers[0].mlp)
    with torch.no_grad(), record_routes(qwen) as rec:
        expected = qwen(ids, attention_mask=mask).logits
    names = rec.routes.layer_names
    assert names == ["model.layers.0.mlp.gate", "model.layers.1.mlp.gate", "model.layers.2.mlp.gate"]
    with pytest.raises(ReplayError, match=r"model\.layers\.1\.mlp\.gate"), replay_routes(qwen, before):
        qwen(ids, attention_mask=mask)
    with torch.no_grad(), replay_routes(qwen, rec.routes):
        assert torch.equal(qwen(ids, attention_mask=mask).logits, expected)


class OwnChoiceBlock(modeling_qwen3_moe.Qwen3MoeSparseMoeBlock):
    """A Qwen3-MoE block class that picks its own experts (the top-k of the negated router logits)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return own_choice_forward(self, hidden_states)


@pytest.mark.parametrize("how", ["class swapped in place", "module replaced", "one block's class swapped"])
def test_a_block_class_that_picks_its_own_experts_moved_to_another_layer_between_contexts(how, monkeypatch):
    """The block class that picks its own experts moves from layer 3 to layer 0 between contexts (after contexts in
    eval and training): the next context records layer 0's own choice, as the general path does, and not the
    stock block's experts."""
    ids, mask = left_padded(2, 5, [0, 1])

    def move(model, frm, to):  # noqa: ANN001, ANN202
        moves = ((frm, modeling_qwen3_moe.Qwen3MoeSparseMoeBlock), (to, OwnChoiceBlock))
        for layer, cls in moves[1:] if how == "one block's class swapped" else moves:
            block = model.model.layers[layer].mlp
            if how != "module replaced":
                block.__class__ = cls
            else:
                new = cls.__new__(cls)
                new.__dict__ = dict(block.__dict__)
                model.model.layers[layer].mlp = new

    def runs():  # noqa: ANN202
        model = tiny_qwen3_moe(layers=4)  # (MoE layers 0, 2 and 3)
        move(model, 0, 3)
        with torch.no_grad():
            for training in (False, True, False):
                model.train(training)
                with record_routes(model) as rec:
                    model(ids, attention_mask=mask)
            stock = rec.routes.indices
            move(model, 3, 0)
            with record_routes(model) as rec:
                model(ids, attention_mask=mask)
        return stock, rec.routes.indices

    stock, auto = runs()
    assert not torch.equal(auto[:, :, 0], stock[:, :, 0])  # (layer 0 now picks its own experts)
    monkeypatch.setenv(ENV, "general")
    assert torch.equal(auto, runs()[1])


def test_a_model_copied_or_saved_between_contexts_records_on_its_own_modules(qwen, tmp_path):
    """A deep copy, and a saved and loaded model, made after contexts closed: each records the same routes as the
    original, on its own modules (its contexts leave the original unhooked), and carries nothing of the contexts."""
    ids, mask = left_padded(2, 6, [0, 1])
    first = recorded_as_used(qwen, ids, mask)
    torch.save(qwen, tmp_path / "model.pt")
    for other in (copy.deepcopy(qwen), torch.load(tmp_path / "model.pt", weights_only=False)):
        assert not any("forward" in m.__dict__ for m in other.modules())
        with torch.no_grad(), record_routes(other) as rec:
            other(ids, attention_mask=mask)
            assert not any("forward" in m.__dict__ for m in qwen.modules())
        assert rec.routes.equal(first)
