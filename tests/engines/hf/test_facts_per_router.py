"""What a context learns is each router's own, per training mode: routers of one class whose own attributes change
what the shared code does, a block that selects on its own in training only, and a block that runs its router twice
record and replay inside `keep_warm` exactly as on the general path, which learns nothing (found by review: the
facts of a class's first router, or of one mode, were applied to the others, with no error)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from helpers import left_padded, own_choice_forward, perturb, tiny_qwen3_moe
from transformers.models.qwen3_moe import modeling_qwen3_moe

from moe_replay import keep_warm, record_routes, replay_routes

CONTEXTS = 3  # the first learns, the next ones run on what it learned
FROZEN = "training, routers in eval"


def runs(model, ids, mask, routes, modes=(False,)):  # noqa: ANN001, ANN201
    """Per context, one after another in one `keep_warm` scope, in each training mode of `modes` (False: eval; FROZEN:
    training with the routers in eval): the routes a recording gives and the logits a replay of `routes` gives."""
    found = []
    with keep_warm(model), torch.no_grad():
        for _ in range(CONTEXTS):
            for training in modes:
                model.train(bool(training))
                for gate in gates(model) if training == FROZEN else ():
                    gate.eval()
                with record_routes(model) as rec:
                    model(ids, attention_mask=mask)
                with replay_routes(model, routes):
                    found.append((rec.routes.indices, model(ids, attention_mask=mask).logits))
    model.eval()
    return found


def assert_as_general(model, routes, monkeypatch, modes=(False,)):  # noqa: ANN001, ANN201
    """The table's paths record and replay what the general path does, in every context."""
    ids, mask = left_padded(2, 5, [0, 1])
    auto = runs(model, ids, mask, routes, modes)
    monkeypatch.setenv("MOE_REPLAY_PATH", "general")
    general = runs(model, ids, mask, routes, modes)
    monkeypatch.delenv("MOE_REPLAY_PATH")
    for n, ((a, x), (b, y)) in enumerate(zip(auto, general, strict=True)):
        assert torch.equal(a, b) and torch.equal(x, y), f"context {n // len(modes)}, training={modes[n % len(modes)]}"
    return general


def routes_of(build, training: bool = False):  # noqa: ANN001, ANN201
    """The routes another model of `build`, perturbed, records in mode `training` (a live forward routes otherwise)."""
    other = build().train(training)
    perturb(other, scale=1.0)
    ids, mask = left_padded(2, 5, [0, 1])
    with torch.no_grad(), record_routes(other) as rec:
        other(ids, attention_mask=mask)
    return rec.routes


def _remapped(self, hidden_states: torch.Tensor) -> tuple:
    """Qwen3-MoE's router, whose experts a router's own `expert_map` may renumber after its top-k."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    values, indices = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
    if getattr(self, "expert_map", None) is not None:
        indices = self.expert_map[indices]
    return logits, (values / values.sum(-1, keepdim=True)).to(logits.dtype), indices


def _group_limited(self, hidden_states: torch.Tensor) -> tuple:
    """Qwen3-MoE's router with a group-limited top-k first where the router's own `n_group` is above 1."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    scores = choice = logits.softmax(-1)
    groups = getattr(self, "n_group", 1)
    if groups > 1:
        best = torch.topk(scores.view(-1, groups, self.num_experts // groups).amax(-1), 1, dim=-1)[1]
        keep = torch.zeros(scores.shape[0], groups, device=scores.device).scatter_(1, best, 1).bool()
        choice = scores.masked_fill(~keep.repeat_interleave(self.num_experts // groups, dim=-1), 0.0)
    values, indices = torch.topk(choice, self.top_k, dim=-1)
    return logits, values.to(logits.dtype), indices


def gates(model):  # noqa: ANN001, ANN202
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def patched(block_forward):  # noqa: ANN001, ANN202
    """A tiny Qwen3-MoE whose MoE blocks run `block_forward`."""
    model = tiny_qwen3_moe()
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.forward = types.MethodType(block_forward, layer.mlp)
    return model


def test_a_router_whose_own_attribute_renumbers_its_experts_is_not_read_from_its_output(monkeypatch):
    """One class, two routers: layer 2's renumbers its top-k's experts, layer 0's returns them as selected. Reading
    layer 2's output as its top-k (learned from layer 0) recorded the renumbered experts, renumbered again on replay."""
    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward", _remapped)

    def build():  # noqa: ANN202
        model = tiny_qwen3_moe()
        gates(model)[1].expert_map = torch.arange(8).flip(0)
        return model

    model = build()
    assert_as_general(model, routes_of(build), monkeypatch)
    ids, mask = left_padded(2, 5, [0, 1])
    with torch.no_grad(), keep_warm(model):
        want = model(ids, attention_mask=mask).logits
        for _ in range(CONTEXTS):  # its own routes replayed give its own logits
            with record_routes(model) as rec:
                model(ids, attention_mask=mask)
            with replay_routes(model, rec.routes):
                assert torch.equal(model(ids, attention_mask=mask).logits, want)


def test_a_router_whose_own_attribute_adds_a_group_limited_top_k_steers_its_groups(monkeypatch):
    """One class, two routers: layer 2's picks a group first (two top-k calls), layer 0's does not. Layer 0's fact
    (one top-k: the lane) applied to layer 2 left its group pick unsteered: a recorded expert of another group got a
    masked score."""
    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward", _group_limited)

    def build():  # noqa: ANN202
        model = tiny_qwen3_moe()
        gates(model)[1].n_group = 2
        return model

    model, routes = build(), routes_of(build)
    assert_as_general(model, routes, monkeypatch)
    with keep_warm(model) as scope, torch.no_grad():
        with replay_routes(model, routes):
            model(*left_padded(2, 5, [0, 1]))
        facts = scope.facts
    assert {name: f.redirect for name, f in facts.items()} == {
        "model.layers.0.mlp.gate": {False: 1},
        "model.layers.2.mlp.gate": {False: 2},
    }


def _own_choice_in_training(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """A Qwen3-MoE block that uses its router's experts in eval, and picks its own in training."""
    batch, length, width = hidden_states.shape
    flat = hidden_states.view(-1, width)
    logits, weights, experts = self.gate(flat)
    if self.training:
        weights, experts = torch.topk((-logits).softmax(-1), self.gate.top_k, dim=-1)
    return self.experts(flat, experts, weights).reshape(batch, length, width)


@pytest.mark.parametrize("order", [(False, True), (True, False)], ids=["eval-first", "train-first"])
def test_a_block_that_selects_on_its_own_in_one_mode_is_intercepted_in_that_mode(order, monkeypatch):
    """Learned in eval (the top-k inside the router), a block that selects on its own in training stays wrapped:
    a training forward records and replays the block's choice, in the learning context and every one after it."""
    model, routes = patched(_own_choice_in_training), routes_of(lambda: patched(_own_choice_in_training), True)
    general = assert_as_general(model, routes, monkeypatch, modes=order)
    trained = [indices for n, (indices, _) in enumerate(general) if order[n % 2]]
    evaluated = [indices for n, (indices, _) in enumerate(general) if not order[n % 2]]
    assert not trained[0].equal(evaluated[0])  # (the two modes pick other experts: the test can tell them apart)


def _router_twice(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """A Qwen3-MoE block that runs its router twice (once more for a statistic) and uses the second call's experts."""
    batch, length, width = hidden_states.shape
    flat = hidden_states.view(-1, width)
    self.gate(flat.detach() * 2.0)
    _, weights, experts = self.gate(flat)
    return self.experts(flat, experts, weights).reshape(batch, length, width)


def test_a_block_that_runs_its_router_twice_keeps_one_layer_per_block(monkeypatch):
    """Once its block was left unwrapped, each of the router's two runs became a layer of its own ("…gate#1"), the
    first, unused one under the block's name."""
    model, routes = patched(_router_twice), routes_of(lambda: patched(_router_twice))
    assert [layer.name for layer in routes.layers] == ["model.layers.0.mlp.gate", "model.layers.2.mlp.gate"]
    assert_as_general(model, routes, monkeypatch)


def test_a_block_in_another_mode_than_its_router_is_learned_in_the_block_s_mode(monkeypatch):
    """A router kept in eval (frozen) while the model trains, under a block that picks its own experts in training:
    whether the top-k runs in the router alone is the block's doing, learned per mode of the block (keyed by the
    router's mode, eval facts let the training block run unwrapped: its choice unrecorded, a replay not applied)."""
    model, routes = patched(_own_choice_in_training), routes_of(lambda: patched(_own_choice_in_training), True)
    assert_as_general(model, routes, monkeypatch, modes=(False, FROZEN))


class _OwnChoiceBlock(modeling_qwen3_moe.Qwen3MoeSparseMoeBlock):
    """A Qwen3-MoE block class that picks its own experts (the top-k of the negated router logits)."""

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return own_choice_forward(self, hidden_states)


@pytest.mark.parametrize("how", ["class swapped in place", "module replaced", "unwrapped block's class swapped"])
def test_a_block_that_moves_to_another_layer_between_contexts_is_learned_afresh_there(how, monkeypatch):
    """A block class that selects on its own moves from layer 3 to layer 0 between contexts of one scope (the set
    of the router class's block classes unchanged): layer 0's facts, learned on a stock block, must not carry over,
    also where only layer 0's unwrapped block changes (no patch of the scope's to notice it)."""
    ids, mask = left_padded(2, 5, [0, 1])

    def move(model, frm, to):  # noqa: ANN001, ANN202
        moves = ((frm, modeling_qwen3_moe.Qwen3MoeSparseMoeBlock), (to, _OwnChoiceBlock))
        for layer, cls in moves[1:] if how == "unwrapped block's class swapped" else moves:
            block = model.model.layers[layer].mlp
            if how != "module replaced":
                block.__class__ = cls
            else:
                new = cls.__new__(cls)
                new.__dict__ = dict(block.__dict__)
                model.model.layers[layer].mlp = new

    def runs():  # noqa: ANN202
        model = tiny_qwen3_moe(layers=4)  # (MoE layers 0, 2 and 3: layer 2's stock block keeps the set of classes)
        move(model, 0, 3)
        with keep_warm(model), torch.no_grad():
            for training in (False, True, False):  # (layer 0's stock block: alone in both modes)
                model.train(training)
                with record_routes(model):
                    model(ids, attention_mask=mask)
            move(model, 3, 0)
            with record_routes(model) as rec:
                model(ids, attention_mask=mask)
        return rec.routes.indices

    auto = runs()
    monkeypatch.setenv("MOE_REPLAY_PATH", "general")
    assert torch.equal(auto, runs())
