"""Routers that PEFT trains in full beside LoRA (`modules_to_save`, the router or its MoE block): the copy that runs
is the router, recorded and replayed bit-exactly, under any adapter or with adapters disabled; routes carry the
layer names without PEFT's segments, so they move between adapters; switching adapters inside a context is refused."""

from __future__ import annotations

import contextlib
import copy

import pytest
import torch
from helpers import left_padded, perturb, recorded

from moe_replay import ReplayError, record_routes, replay_routes

peft = pytest.importorskip("peft")


def lora(model, target):
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=[target])
    return peft.get_peft_model(copy.deepcopy(model), config)


def routers(model, part):
    """The router modules under PEFT's `part` ("modules_to_save.default" or "original_module"), in order."""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    return [m for n, m in model.named_modules() if isinstance(m, Qwen3MoeTopKRouter) and f".{part}" in n]


def forced(model, ids, mask, routes, backward=False):
    """(experts `model` used under replay of `routes`, its logits)."""
    with replay_routes(model, routes), record_routes(model) as used:
        out = model(ids, attention_mask=mask, labels=ids if backward else None)
        if backward:
            out.loss.backward()
    return used.routes, out.logits


def same(a, b):
    m = a.mask
    return torch.equal(m, b.mask) and torch.equal(a.indices[m].sort(-1).values, b.indices[m].sort(-1).values)


@pytest.mark.parametrize("target", ["gate", "mlp"])
def test_saved_routers_record_and_replay_bit_exactly(qwen, target):
    ids, mask = left_padded(2, 7, [0, 2])
    model = lora(qwen, target)
    bare = recorded(qwen, ids, mask)
    own = recorded(model, ids, mask)  # (failed before: the inactive original_module was taken for a router)
    assert own.layer_names == [f"base_model.model.{n}" for n in bare.layer_names]  # no PEFT segment in the names
    assert same(own, bare)  # the copies start as the original's
    logits = model(ids, attention_mask=mask).logits
    used, out = forced(model, ids, mask, own)
    assert torch.equal(out, logits) and same(used, own)  # replaying its own routes: bit-exact

    trained, frozen = routers(model, "modules_to_save.default"), routers(model, "original_module")
    assert len(trained) == len(frozen) == len(bare.layers)
    for r in trained:
        perturb(r, scale=3.0, seed=11)  # the trained copy's routers move, the frozen original's do not
    moved = recorded(model, ids, mask)
    assert not same(moved, own)  # (else the replay below would show nothing)
    model.train()
    used, _ = forced(model, ids, mask, own, backward=True)
    assert same(used, own)  # the old experts forced on the copy that runs
    assert all(r.weight.grad is not None and r.weight.grad.abs().sum() > 0 for r in trained)  # gradients reach it
    assert all(r.weight.grad is None for r in frozen)

    with model.disable_adapter():  # the reference forward: original_module runs, and is the router
        assert same(recorded(model, ids, mask), bare)
        used, _ = forced(model, ids, mask, moved)  # routes of the adapter's copy replayed with adapters disabled
        assert same(used, moved)
    assert same(recorded(model, ids, mask), moved)  # (its layout is walked again once the adapter is back)


def test_routes_move_between_adapters_and_a_switch_inside_a_context_is_refused(qwen):
    ids, mask = left_padded(2, 6, [1, 0])
    model = lora(qwen, "gate")
    for r in routers(model, "modules_to_save.default"):
        perturb(r, scale=3.0, seed=4)
    routes_a = recorded(model, ids, mask)
    model.add_adapter("b", peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["gate"]))
    model.set_adapter("b")  # adapter b's copy of each router is a fresh copy of the original
    routes_b = recorded(model, ids, mask)
    assert same(routes_b, recorded(qwen, ids, mask)) and not same(routes_a, routes_b)
    used, _ = forced(model, ids, mask, routes_a)  # adapter a's routes under adapter b
    assert same(used, routes_a)
    for opened in (lambda: record_routes(model), lambda: replay_routes(model, routes_b)):
        with pytest.raises(ReplayError, match="adapter was switched or disabled inside the context"):
            with opened():  # (before: the other copy ran unhooked, and routed live with no error)
                model(ids, attention_mask=mask)
                with model.disable_adapter():
                    model(ids, attention_mask=mask)
    assert "forward" not in vars(routers(model, "original_module")[0])  # nothing left on the copies after it


@pytest.mark.parametrize("target", ["gate", "mlp"])
def test_saved_and_original_routers_taking_turns_replay_like_the_general_path(qwen, target, monkeypatch):
    """An RL loop's policy contexts (adapter on: the saved copy runs) and reference contexts (`disable_adapter`: the
    original runs) take turns, in both training modes: each replays on the declared path (the copies are the stock
    router class) exactly as on the general path."""
    from moe_replay.engines.hf.patch import MARKER

    model = lora(qwen, target).eval()
    ids, mask = left_padded(2, 5, [0, 1])
    routes = recorded(model, ids, mask)
    logits = {}
    for path in ("auto", "general"):
        monkeypatch.setenv("MOE_REPLAY_PATH", path)
        with torch.no_grad():
            for n in range(4):
                for training in (False, True):
                    model.train(training)
                    with model.disable_adapter() if n % 2 else contextlib.nullcontext(), replay_routes(model, routes):
                        declared = [r.declared for r in model.__dict__[MARKER].routers]
                        logits[path, n, training] = model(ids, attention_mask=mask).logits
                    assert declared == [path == "auto"] * len(declared)
    model.eval()
    for key, value in logits.items():
        if key[0] == "auto":
            assert torch.equal(value, logits["general", *key[1:]]), key
