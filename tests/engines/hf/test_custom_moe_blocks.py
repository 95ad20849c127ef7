"""MoE blocks and routers whose code differs from one layer or one training mode to another: a block that selects its
own experts in one layer, or in training only, or under a router kept in eval; a block that runs its router twice; a
router whose own attribute renumbers its experts (`expert_map`) or adds a group-limited top-k (`n_group`). Each
context must record and replay exactly what the general path (MOE_REPLAY_PATH=general) does, in every layer and mode,
context after context (found by review, when contexts learned facts: a class's first router's, or one mode's, were
applied to the others, and a block's own choice went unrecorded and unreplayed with no error)."""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F
from helpers import left_padded, own_choice_forward, perturb, recorded, tiny_qwen3_moe
from transformers.models.qwen3_moe import modeling_qwen3_moe

from moe_replay import record_routes, replay_routes
from moe_replay.engines.hf.declared import ENV

CONTEXTS = 2
FROZEN = "training, routers in eval"


@pytest.fixture(autouse=True)
def auto_path(monkeypatch):  # noqa: ANN001, ANN201
    monkeypatch.delenv(ENV, raising=False)  # the declarations apply unless a test sets the variable


def gates(model):  # noqa: ANN001, ANN202
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def runs(model, ids, mask, routes, modes=(False,)):  # noqa: ANN001, ANN201
    """Per context, one after another, in each training mode of `modes` (False: eval; FROZEN: training with the
    routers in eval): the routes a recording gives and the logits a replay of `routes` gives."""
    found = []
    with torch.no_grad():
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
    """The declared path records and replays what the general path does, in every context and mode."""
    ids, mask = left_padded(2, 5, [0, 1])
    auto = runs(model, ids, mask, routes, modes)
    monkeypatch.setenv(ENV, "general")
    general = runs(model, ids, mask, routes, modes)
    monkeypatch.delenv(ENV)
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


def declared(model) -> list[bool]:  # noqa: ANN001
    with record_routes(model):
        return [r.declared for r in model.__dict__["_moe_replay_hub"].routers]


def patched(block_forward):  # noqa: ANN001, ANN202
    """A tiny Qwen3-MoE whose MoE blocks run `block_forward` (set on each instance)."""
    model = tiny_qwen3_moe()
    for layer in model.model.layers:
        if hasattr(layer.mlp, "gate"):
            layer.mlp.forward = types.MethodType(block_forward, layer.mlp)
    return model


def test_a_block_that_selects_its_own_experts_in_one_layer_records_and_replays_its_choice(qwen, monkeypatch):
    """Layer 0's block picks its experts itself (its router stops being declared); layer 2's is the stock one (its
    router stays declared): every context records and replays what the general path does."""
    block = qwen.model.layers[0].mlp
    block.forward = types.MethodType(own_choice_forward, block)
    assert declared(qwen) == [False, True]
    ids, mask = left_padded(2, 5, [0, 1])
    routes = recorded(qwen, ids, mask)
    perturb(qwen)
    assert not recorded(qwen, ids, mask).indices.equal(routes.indices)  # the perturbed model routes otherwise live
    assert_as_general(qwen, routes, monkeypatch)


def _remapped(self, hidden_states: torch.Tensor) -> tuple:
    """Qwen3-MoE's router, whose experts a router's own `expert_map` may renumber after its top-k."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    logits = F.linear(hidden_states, self.weight)
    values, indices = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
    if getattr(self, "expert_map", None) is not None:
        indices = self.expert_map[indices]
    return logits, (values / values.sum(-1, keepdim=True)).to(logits.dtype), indices


def test_a_router_whose_own_attribute_renumbers_its_experts_replays_like_the_general_path(monkeypatch):
    """One class, two routers: layer 2's renumbers its top-k's experts (`expert_map`), layer 0's does not. Recording
    layer 2's output as its top-k records renumbered experts, which a replay renumbers again."""
    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward", _remapped)

    def build():  # noqa: ANN202
        model = tiny_qwen3_moe()
        gates(model)[1].expert_map = torch.arange(8).flip(0)
        return model

    model = build()
    assert_as_general(model, routes_of(build), monkeypatch)
    ids, mask = left_padded(2, 5, [0, 1])
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits
        for _ in range(CONTEXTS):  # its own routes replayed give its own logits
            with record_routes(model) as rec:
                model(ids, attention_mask=mask)
            with replay_routes(model, rec.routes):
                assert torch.equal(model(ids, attention_mask=mask).logits, want)


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


def test_a_router_whose_own_attribute_adds_a_group_limited_top_k_steers_its_groups(monkeypatch):
    """One class, two routers: layer 2's picks a group first (two top-k calls), layer 0's does not. A replay must
    steer layer 2's group pick to the recorded experts' groups (else their scores are masked), as the general path
    does; without that its logits differ (control)."""
    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward", _group_limited)

    def build():  # noqa: ANN202
        model = tiny_qwen3_moe()
        gates(model)[1].n_group = 2
        return model

    model, routes = build(), routes_of(build)
    general = assert_as_general(model, routes, monkeypatch)
    del gates(model)[1].n_group  # control: the same routes on the router without its group pick
    ids, mask = left_padded(2, 5, [0, 1])
    with torch.no_grad(), replay_routes(model, routes):
        assert not torch.equal(model(ids, attention_mask=mask).logits, general[0][1])


def _own_choice_in_training(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """A Qwen3-MoE block that uses its router's experts in eval, and picks its own in training."""
    batch, length, width = hidden_states.shape
    flat = hidden_states.view(-1, width)
    logits, weights, experts = self.gate(flat)
    if self.training:
        weights, experts = torch.topk((-logits).softmax(-1), self.gate.top_k, dim=-1)
    return self.experts(flat, experts, weights).reshape(batch, length, width)


@pytest.mark.parametrize("order", [(False, True), (True, False)], ids=["eval-first", "train-first"])
def test_a_block_that_selects_its_own_experts_in_one_mode_is_followed_in_that_mode(order, monkeypatch):
    """A block that picks its own experts in training only, used in eval then training (or the reverse), context
    after context: each mode records and replays what the general path does."""
    model, routes = patched(_own_choice_in_training), routes_of(lambda: patched(_own_choice_in_training), True)
    general = assert_as_general(model, routes, monkeypatch, modes=order)
    trained = [indices for n, (indices, _) in enumerate(general) if order[n % 2]]
    evaluated = [indices for n, (indices, _) in enumerate(general) if not order[n % 2]]
    assert not trained[0].equal(evaluated[0])  # (the two modes pick other experts: the test can tell them apart)


def test_a_block_in_another_mode_than_its_router_follows_the_block_s_mode(monkeypatch):
    """A router kept in eval (frozen) while the model trains, under a block that picks its own experts in training:
    the block's choice is recorded and replayed, as on the general path."""
    model, routes = patched(_own_choice_in_training), routes_of(lambda: patched(_own_choice_in_training), True)
    general = assert_as_general(model, routes, monkeypatch, modes=(False, FROZEN))
    assert not general[0][0].equal(general[1][0])  # (the block picks otherwise in training)


def _router_twice(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """A Qwen3-MoE block that runs its router twice (once more for a statistic) and uses the second call's experts."""
    batch, length, width = hidden_states.shape
    flat = hidden_states.view(-1, width)
    self.gate(flat.detach() * 2.0)
    _, weights, experts = self.gate(flat)
    return self.experts(flat, experts, weights).reshape(batch, length, width)


def test_a_block_that_runs_its_router_twice_keeps_one_layer_per_block(monkeypatch):
    """Its router's two runs are one layer, the block's (not two, the first, unused one under the block's name), and
    record and replay as on the general path."""
    model, routes = patched(_router_twice), routes_of(lambda: patched(_router_twice))
    assert [layer.name for layer in routes.layers] == ["model.layers.0.mlp.gate", "model.layers.2.mlp.gate"]
    assert_as_general(model, routes, monkeypatch)
