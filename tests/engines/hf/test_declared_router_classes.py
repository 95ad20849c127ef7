"""The declared path: a router whose class the installed transformers release declares (declared.py) is hooked on its
own forward, not its MoE block's, and a recording alone reads its output. Whatever a user does with it (record,
replay with or without grad, count the live picks, record inside a replay, checkpoint) must give bit for bit what
MOE_REPLAY_PATH=general gives; a bad MOE_REPLAY_PATH, routes the router cannot take, or a broken selector order are
refused with an error that says why."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch
from families import build_tiny_model
from helpers import left_padded, perturb, tiny_qwen3_moe

from moe_replay import LayerInfo, ReplayError, Routes, record_routes, replay_routes
from moe_replay.engines.hf.declared import ENV, declarations
from moe_replay.engines.hf.selectors import GroupTopK


@pytest.fixture(autouse=True)
def auto_path(monkeypatch):  # noqa: ANN001, ANN201
    monkeypatch.delenv(ENV, raising=False)  # the declarations apply unless a test sets the variable


def gates(model):  # noqa: ANN001, ANN202
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def hub_routers(model):  # noqa: ANN001, ANN202
    """(declared, indices_at) of each router of the hub open on `model` (inside a context)."""
    return [(r.declared, r.indices_at) for r in model.__dict__["_moe_replay_hub"].routers]


def foreign_routes(model, ids, mask):  # noqa: ANN001, ANN202
    """Routes a perturbed copy of `model` records: a replay of them moves some of `model`'s live experts."""
    other = copy.deepcopy(model)
    perturb(other, scale=1.0)
    with torch.no_grad(), record_routes(other) as rec:
        other(ids, attention_mask=mask)
    return rec.routes


def every_use(model, ids, mask, routes):  # noqa: ANN001, ANN201
    """Record alone (two forwards), replay without grad, replay with grad and track_live, record inside a replay:
    what each gives, and the hub's routers as each context saw them."""
    out, seen = {}, {}
    with torch.no_grad(), record_routes(model) as rec:
        first = model(ids, attention_mask=mask).logits
        model(ids, attention_mask=mask)
        seen["record"] = hub_routers(model)
    assert rec.batches[0].equal(rec.batches[1])  # every forward of a context records alike
    out["record"] = (first, *(r.indices for r in rec.batches))
    with torch.no_grad(), replay_routes(model, routes):
        out["replay"] = (model(ids, attention_mask=mask).logits,)
        seen["replay"] = hub_routers(model)
    model.zero_grad(set_to_none=True)
    with replay_routes(model, routes, track_live=True) as rep:
        logits = model(ids, attention_mask=mask).logits
        logits.square().mean().backward()
        seen["replay, track_live"] = hub_routers(model)
    grads = [g.weight.grad.clone() for g in gates(model)]
    assert all(g.abs().sum() > 0 for g in grads)  # the routers get gradients under replay
    out["replay, track_live"] = (logits.detach(), *grads, *rep.live_moved())
    with torch.no_grad(), replay_routes(model, routes), record_routes(model) as rec:
        out["record in replay"] = (model(ids, attention_mask=mask).logits, rec.routes.indices)
        seen["record in replay"] = hub_routers(model)
    return out, seen


@pytest.mark.parametrize("training", [False, True], ids=["eval", "train"])
@pytest.mark.parametrize("pads", [[0, 0, 0], [0, 2, 1]], ids=["all-recorded", "left-padded"])
def test_the_declared_path_records_and_replays_bit_for_bit_like_the_general_path(monkeypatch, training, pads):
    """A stock Qwen3-MoE, its routers declared, replaying another model's routes (all recorded, or live at the
    padding): every use gives the logits, routes, router gradients and live tallies of the general path."""
    model = tiny_qwen3_moe().train(training)
    ids, mask = left_padded(3, 8, pads)
    routes = foreign_routes(model, ids, mask)
    auto, seen = every_use(model, ids, mask, routes)
    assert all(found == [(True, 2), (True, 2)] for found in seen.values()), seen
    live = auto["record"][1]
    assert not torch.equal(live[routes.mask], routes.indices[routes.mask])  # the replay has experts to move
    assert torch.equal(auto["record in replay"][1][routes.mask], routes.indices[routes.mask])  # and moves them
    moved, compared = auto["replay, track_live"][-2:]
    assert int(moved.sum()) > 0 and int(compared.sum()) == 2 * int(routes.mask.sum())
    monkeypatch.setenv(ENV, "general")
    general, seen = every_use(model, ids, mask, routes)
    assert all(found == [(False, None), (False, None)] for found in seen.values()), seen
    for name, expected in general.items():
        assert all(torch.equal(a, b) for a, b in zip(auto[name], expected, strict=True)), name


def checkpointed(model, ids, mask, routes):  # noqa: ANN001, ANN202
    """Two checkpointed training steps' replayed logits, routes recorded inside the replay, router gradients."""
    found = []
    for _ in range(2):
        model.zero_grad(set_to_none=True)
        with replay_routes(model, routes), record_routes(model) as rec:
            logits = model(ids, attention_mask=mask).logits
            logits.square().mean().backward()
        found.append((logits.detach(), rec.routes.indices, *(g.weight.grad.clone() for g in gates(model))))
    return found


def test_a_checkpointed_replay_on_the_declared_path_matches_the_general_path(monkeypatch):
    """With gradient checkpointing the backward recomputes each router: the replayed logits, the routes recorded
    once per forward, and the router gradients equal the general path's and an unchecked replay's."""
    model = tiny_qwen3_moe().train()
    ids, mask = left_padded(2, 8, [0, 3])
    routes = foreign_routes(model, ids, mask)
    plain = checkpointed(model, ids, mask, routes)[0]
    model.gradient_checkpointing_enable()
    auto = checkpointed(model, ids, mask, routes)
    monkeypatch.setenv(ENV, "general")
    general = checkpointed(model, ids, mask, routes)
    assert torch.equal(auto[0][1][routes.mask], routes.indices[routes.mask])
    assert all(g.abs().sum() > 0 for g in auto[0][2:])
    for got in (*auto, *general):
        assert all(torch.equal(a, b) for a, b in zip(got, plain, strict=True))


def test_a_declared_group_limited_router_steers_its_groups_like_the_general_path(monkeypatch):
    """DeepSeek-V2's group-limited routing (a top-k over two expert groups, then over the experts) on a perturbed
    model: the replay must keep the recorded experts' groups, else their scores are masked to zero. Its logits and
    router gradients equal the general path's; without the steering (control) they would not."""
    model = build_tiny_model("deepseek_v2").train()
    ids = torch.randint(5, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), record_routes(model) as rec:
        model(ids)
    perturb(model, scale=1.0)

    def replayed():  # noqa: ANN202
        model.zero_grad(set_to_none=True)
        with replay_routes(model, rec.routes), record_routes(model) as used:
            logits = model(ids).logits
            logits.square().mean().backward()
            declared = [d for d, _ in hub_routers(model)]
        grads = [p.grad.clone() for n, p in model.named_parameters() if n.endswith("gate.weight")]
        assert torch.equal(used.routes.indices, rec.routes.indices)  # the recorded experts, forced
        return logits.detach(), grads, declared

    auto, auto_grads, declared = replayed()
    assert declared and all(declared)
    monkeypatch.setenv(ENV, "general")
    general, general_grads, declared = replayed()
    assert not any(declared)
    assert torch.equal(auto, general) and auto_grads and all(g.abs().sum() > 0 for g in auto_grads)
    assert all(torch.equal(a, b) for a, b in zip(auto_grads, general_grads, strict=True))
    monkeypatch.delenv(ENV)
    monkeypatch.setattr(GroupTopK, "claims", lambda *a: False)  # control: unsteered groups change the logits
    assert not torch.equal(replayed()[0], general)


def test_routes_a_declared_router_cannot_take_are_refused_naming_why(qwen):
    """Routes with another expert count, or another k, than the router's: refused at the first forward."""
    ids, mask = left_padded(2, 8, [0, 3])
    with torch.no_grad(), record_routes(qwen) as rec:
        qwen(ids, attention_mask=mask)
        assert all(d for d, _ in hub_routers(qwen))
    routes = rec.routes
    wider = Routes(routes.indices, routes.mask, [LayerInfo(n, 16, 2) for n in routes.layer_names])
    with pytest.raises(ReplayError, match="has E=8 experts but the routes hold E=16 for it"):
        with torch.no_grad(), replay_routes(qwen, wider):
            qwen(ids, attention_mask=mask)
    three = tiny_qwen3_moe(top_k=3)
    with torch.no_grad(), record_routes(three) as rec:
        three(ids, attention_mask=mask)
    with pytest.raises(
        ReplayError, match=r"could not be applied .* k=3 of E=8 .* top-k calls were \(E, k\) = \[\(8, 2\)\]"
    ):
        with torch.no_grad(), replay_routes(qwen, rec.routes):
            qwen(ids, attention_mask=mask)


def test_a_replay_whose_router_raised_is_freed_and_the_next_one_replays(qwen):
    """A router that raises inside a replayed forward (a user's pre-hook here): the closed context and its routes
    are let go of (no router keeps its plan), and the next replay is applied."""
    ids, mask = left_padded(2, 8, [0, 3])
    routes = foreign_routes(qwen, ids, mask)

    def failing(module, args) -> None:  # noqa: ANN001
        raise RuntimeError("raised inside the router")

    hook = gates(qwen)[1].register_forward_pre_hook(failing)
    ctx = replay_routes(qwen, routes)
    with pytest.raises(RuntimeError, match="raised inside the router"), torch.no_grad(), ctx:
        qwen(ids, attention_mask=mask)
    hook.remove()
    gone = weakref.ref(ctx)
    del ctx
    gc.collect()
    assert gone() is None
    with torch.no_grad(), replay_routes(qwen, routes), record_routes(qwen) as rec:
        qwen(ids, attention_mask=mask)
    assert torch.equal(rec.routes.indices[routes.mask], routes.indices[routes.mask])


@pytest.mark.parametrize("value", ["fast", "General Path", "bogus"])
def test_an_unknown_moe_replay_path_is_refused_naming_it_and_the_choices_and_nothing_is_left(value, monkeypatch):
    model = tiny_qwen3_moe()
    before = {name: dict(vars(m)) for name, m in model.named_modules()}
    monkeypatch.setenv(ENV, value)
    message = rf"MOE_REPLAY_PATH='{value}' is not one of auto, general"
    with pytest.raises(ValueError, match=message):
        declarations()
    with pytest.raises(ValueError, match=message):
        with record_routes(model):
            pass
    assert {name: dict(vars(m)) for name, m in model.named_modules()} == before


def test_a_selector_order_that_breaks_the_contract_is_refused_naming_it():
    """The first selector that claims a call runs it: one that claims every call of its functions (TopK) must be
    offered last, or the group-limited rule after it would never run."""
    from moe_replay.engines.hf.rules import check_rules
    from moe_replay.engines.hf.selectors import TopK

    assert check_rules((GroupTopK, TopK)) == (GroupTopK, TopK)
    with pytest.raises(TypeError, match="TopK claims every call of its functions .* offered before GroupTopK"):
        check_rules((TopK, GroupTopK))
    with pytest.raises(TypeError, match="is not a Selector subclass"):
        check_rules((GroupTopK, torch.topk))
