"""Routers and MoE blocks whose code the user patched before a context opened: a forward wrapped on the instance, a
subclass, a class swapped in place (torch parametrize), a block or router forward replaced on the class or the
instance, a router helper replaced (LongCat-Flash's `get_topk_indices`), a name in the router's module replaced. The
routes recorded must be the experts the blocks used, and a replay of them must make the blocks use them, as the
patched code runs now (not the class's stock code, nor what an earlier context saw): such routers are not declared,
the general path intercepts them, while stock routers stay declared."""

from __future__ import annotations

import contextlib
import copy
import types

import pytest
import torch
from families import build_tiny_model
from helpers import experts_used, left_padded, perturb, tiny_qwen3_moe
from torch import nn
from transformers.models.qwen3_moe import modeling_qwen3_moe

from moe_replay import record_routes, replay_routes
from moe_replay.engines.hf.declared import ENV


@pytest.fixture(autouse=True)
def auto_path(monkeypatch):  # noqa: ANN001, ANN201
    monkeypatch.delenv(ENV, raising=False)  # the declarations apply unless a test sets the variable


def gates(model):  # noqa: ANN001, ANN202
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def declared(model) -> list[bool]:  # noqa: ANN001
    """Whether each router of `model` is declared, as a context opened now sees it."""
    with record_routes(model):
        return [r.declared for r in model.__dict__["_moe_replay_hub"].routers]


def assert_records_and_replays_the_experts_used(model) -> None:  # noqa: ANN001
    """The routes recorded are the experts the blocks used; after a perturbation that moves some live experts, a
    replay of them makes the blocks use them again."""
    ids, mask = left_padded(2, 6, [0, 1])
    recorder = record_routes(model)
    used = experts_used(model, ids, mask, recorder)
    routes = recorder.routes
    want = routes.indices.long().sort(-1).values[routes.mask]
    assert torch.equal(used[routes.mask], want)
    perturb(model, scale=1.0)
    assert not torch.equal(experts_used(model, ids, mask, contextlib.nullcontext())[routes.mask], want)
    assert torch.equal(experts_used(model, ids, mask, replay_routes(model, routes))[routes.mask], want)


def test_a_router_forward_wrapped_on_the_instance_runs_its_wrapper_at_every_call():
    """A wrapper set on each router instance (as accelerate's hooks are): it runs for every router call inside the
    contexts, stays the router's forward after them, and the experts used are recorded and replayed."""
    model = tiny_qwen3_moe()
    assert declared(model) == [True, True]
    calls = []
    for gate in gates(model):
        gate.forward = lambda *a, _f=gate.forward, **k: calls.append(1) or _f(*a, **k)
    wrappers = [gate.__dict__["forward"] for gate in gates(model)]
    assert declared(model) == [False, False]
    assert_records_and_replays_the_experts_used(model)
    assert len(calls) == 3 * 2  # each of the three forwards ran both wrappers
    assert [gate.__dict__["forward"] for gate in gates(model)] == wrappers


def test_a_router_subclass_whose_top_k_runs_in_a_helper_records_and_replays_the_experts_used():
    """A router subclass of the user's whose top-k runs in a module-level helper of theirs."""
    model = tiny_qwen3_moe()

    def pick(probs: torch.Tensor, k: int):  # noqa: ANN202
        return torch.topk(probs, k, dim=-1)

    class HelperTopK(modeling_qwen3_moe.Qwen3MoeTopKRouter):
        def forward(self, hidden_states):  # noqa: ANN001, ANN202
            hidden_states = hidden_states.reshape(-1, self.hidden_dim)
            logits = nn.functional.linear(hidden_states, self.weight)
            values, indices = pick(torch.softmax(logits, dtype=torch.float, dim=-1), self.top_k)
            values = values / values.sum(dim=-1, keepdim=True) if self.norm_topk_prob else values
            return logits, values.to(logits.dtype), indices

    for gate in gates(model):
        gate.__class__ = HelperTopK
    assert declared(model) == [False, False]
    assert_records_and_replays_the_experts_used(model)


def test_a_router_class_swapped_in_place_by_parametrize_between_contexts():
    """torch's parametrize swaps a router's class in place for a subclass that keeps its forward (here its weight
    rolled over the experts): the next context runs the swapped class, recording and replaying the experts it makes
    the block use."""
    from torch.nn.utils import parametrize

    class Rolled(nn.Module):
        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return weight.roll(1, 0)  # expert e scores with expert e-1's row

    model = tiny_qwen3_moe()
    ids, mask = left_padded(2, 6, [0, 1])
    before = experts_used(model, ids, mask, record_routes(model))
    router = gates(model)[0]
    stock = type(router)
    parametrize.register_parametrization(router, "weight", Rolled())
    assert type(router) is not stock and type(router).forward is stock.forward
    assert declared(model) == [False, True]
    with torch.no_grad(), record_routes(model) as rec:
        live = model(ids, attention_mask=mask).logits
    assert not torch.equal(rec.routes.indices.long().sort(-1).values[rec.routes.mask], before[rec.routes.mask])
    with torch.no_grad(), replay_routes(model, rec.routes):
        assert torch.equal(model(ids, attention_mask=mask).logits, live)
    assert_records_and_replays_the_experts_used(model)


def biased_block_forward(self, hidden_states):  # noqa: ANN001, ANN201
    """A Qwen3-MoE block forward that ranks the router's logits itself, with a per-expert bias (as a balancing patch
    or a fused kernel might): the router's own top-k no longer decides the experts."""
    B, T, H = hidden_states.shape
    x = hidden_states.view(-1, H)
    probs = torch.softmax(self.gate(x)[0], dim=-1, dtype=torch.float)
    idx = torch.topk(probs + torch.linspace(-0.3, 0.3, probs.shape[-1]), self.gate.top_k, dim=-1).indices
    return self.experts(x, idx, probs.gather(-1, idx).to(x.dtype)).reshape(B, T, H)


@pytest.mark.parametrize("where", ["class", "instance"])
def test_an_moe_block_forward_patched_between_contexts_records_and_replays_the_block_s_experts(monkeypatch, where):
    """After a context on the stock model (its routers declared), the blocks' forward is replaced by one that picks
    the experts itself: the next contexts record the experts the block used, and force the replayed ones."""
    model = tiny_qwen3_moe()
    assert declared(model) == [True, True]
    for block in (layer.mlp for layer in model.model.layers if hasattr(layer.mlp, "gate")):
        if where == "class":
            monkeypatch.setattr(type(block), "forward", biased_block_forward)
        else:
            block.forward = types.MethodType(biased_block_forward, block)
    assert declared(model) == [False, False]
    assert_records_and_replays_the_experts_used(model)


def test_a_router_forward_replaced_on_its_class_between_contexts_runs_in_the_next_context(monkeypatch):
    """The router class's forward replaced by the user's (which counts its calls) after a context: it runs in the
    next contexts, which record and replay the experts used."""
    model = tiny_qwen3_moe()
    assert declared(model) == [True, True]
    stock, seen = modeling_qwen3_moe.Qwen3MoeTopKRouter.forward, []

    def counted(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append(self)
        return stock(self, *args, **kwargs)

    monkeypatch.setattr(modeling_qwen3_moe.Qwen3MoeTopKRouter, "forward", counted)
    assert declared(model) == [False, False]
    assert_records_and_replays_the_experts_used(model)
    assert seen == gates(model) * 3


def test_a_router_helper_patched_on_its_class_between_contexts_replays_as_recorded(monkeypatch):
    """LongCat-Flash's router returns the indices its `get_topk_indices` helper returns. Patched on the class after
    a context (here to remap the ids it returns), its routes must replay as recorded: the replayed ids must not be
    remapped again (found by review: a recording read the remapped ids from the router's output)."""
    model = build_tiny_model("longcat_flash").eval()
    ids = torch.randint(5, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), record_routes(model) as rec:
        model(ids)
        assert all(r.declared for r in model.__dict__["_moe_replay_hub"].routers)
    before = rec.routes
    cls = next(type(m) for m in model.modules() if type(m).__name__ == "LongcatFlashTopkRouter")
    helper = cls.get_topk_indices

    def remapped(self, scores):  # noqa: ANN001, ANN202
        return (helper(self, scores) + 1) % self.n_routed_experts

    monkeypatch.setattr(cls, "get_topk_indices", remapped)
    with torch.no_grad(), record_routes(model) as rec:
        expected = model(ids).logits
        assert not any(r.declared for r in model.__dict__["_moe_replay_hub"].routers)
    with torch.no_grad(), replay_routes(model, rec.routes):
        assert torch.equal(model(ids).logits, expected)
    assert not torch.equal(rec.routes.indices, before.indices)  # (the patch changed which experts run)


def test_a_name_in_the_router_s_module_patched_between_contexts_runs_in_the_next_context(monkeypatch):
    """`F` of the Qwen3-MoE module, which its router's forward reads, replaced by the user (its `linear` tripled)
    between contexts: the still-declared routers run it, recording and replaying what the general path does."""
    model = tiny_qwen3_moe()
    ids, mask = left_padded(2, 6, [0, 1])
    other = copy.deepcopy(model)
    perturb(other, scale=1.0)
    with torch.no_grad(), record_routes(other) as rec:
        other(ids, attention_mask=mask)
    routes = rec.routes

    def replayed(path: str) -> torch.Tensor:
        monkeypatch.setenv(ENV, path)
        with torch.no_grad(), replay_routes(model, routes):
            return model(ids, attention_mask=mask).logits

    before = replayed("auto")
    F = modeling_qwen3_moe.F
    tripled = types.SimpleNamespace(**{k: getattr(F, k) for k in dir(F) if not k.startswith("__")})
    tripled.linear = lambda x, w, b=None: 3 * F.linear(x, w, b)
    monkeypatch.setattr(modeling_qwen3_moe, "F", tripled)
    monkeypatch.delenv(ENV)
    assert declared(model) == [True, True]
    fast = replayed("auto")
    assert torch.equal(fast, replayed("general")) and not torch.equal(fast, before)
    assert_records_and_replays_the_experts_used(model)
