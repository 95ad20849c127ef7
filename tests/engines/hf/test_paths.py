"""The path table (paths.py): which path each router call takes, and MOE_REPLAY_PATH=general, which forces the one
path that needs no learned fact and gives the same logits, routes and gradients."""

from __future__ import annotations

import pytest
import torch
from helpers import left_padded, tiny_qwen3_moe

from moe_replay import record_routes, replay_routes
from moe_replay.engines.hf import paths
from moe_replay.engines.hf import wrapper as wrapper_module

pytestmark = pytest.mark.usefixtures("auto_path")  # (MOE_REPLAY_PATH unset unless a test sets it)


@pytest.fixture
def taken(monkeypatch):  # noqa: ANN001, ANN201
    """The paths the table picks, in order: "pass" for a wrapped MoE block run as is, before each router forward
    ("read", "lane", "call"), then inside each call for the router ("router:…") and its MoE block ("block:…")."""
    seen = []
    block, before, inside = paths.before_block, paths.before_call, paths.in_call

    def spy_block(*args):  # noqa: ANN002, ANN202
        path = block(*args)
        if path is paths.PASS:
            seen.append(path)
        return path

    def spy_before(*args):  # noqa: ANN002, ANN202
        seen.append(before(*args))
        return seen[-1]

    def spy_in(hub, session, call, router, is_router, redirectable):  # noqa: ANN001, ANN202
        path = inside(hub, session, call, router, is_router, redirectable)
        seen.append(f"{'router' if is_router else 'block'}:{path}")
        return path

    monkeypatch.setattr(wrapper_module, "before_block", spy_block)
    monkeypatch.setattr(wrapper_module, "before_call", spy_before)
    monkeypatch.setattr(wrapper_module, "in_call", spy_in)
    return seen


def run_all(model, ids, mask, routes, taken):  # noqa: ANN001, ANN201
    """Record, replay without grad, replay with grad and a live tally, record under replay: each one's outputs and
    the paths its router calls took."""
    out, path = {}, {}
    for name in ("record", "replay", "replay, tally", "record under replay"):
        taken.clear()
        model.zero_grad(set_to_none=True)
        if name == "record":
            with torch.no_grad(), record_routes(model) as rec:
                logits = model(ids, attention_mask=mask).logits
            out[name] = (logits, rec.routes.indices)
        elif name == "replay":
            with torch.no_grad(), replay_routes(model, routes):
                out[name] = (model(ids, attention_mask=mask).logits,)
        elif name == "replay, tally":
            with replay_routes(model, routes, track_live=True) as rep:
                logits = model(ids, attention_mask=mask).logits
                logits.square().mean().backward()
            out[name] = (logits.detach(), *(g.weight.grad for g in gates(model)), *rep.live_moved())
        else:
            with replay_routes(model, routes), record_routes(model) as rec:
                logits = model(ids, attention_mask=mask).logits
            out[name] = (logits.detach(), rec.routes.indices)
        path[name] = list(taken)
    return out, path


def gates(model):  # noqa: ANN001, ANN202
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def test_each_situation_takes_its_row_and_general_takes_the_mode_with_identical_results(warm, taken, monkeypatch):
    """A tiny Qwen3-MoE (two MoE layers) in a keep_warm scope: the table's rows as a user meets them, then the same
    work under MOE_REPLAY_PATH=general, every call under the TorchFunctionMode over the whole MoE block. Learned in
    eval only, the blocks stay wrapped and pass; learned in both modes, they are not wrapped."""
    model = tiny_qwen3_moe()
    warm(model)
    ids, mask = left_padded(3, 8, [0, 2, 1])
    with torch.no_grad(), record_routes(model) as first:  # (learns the routers' facts in eval)
        model(ids, attention_mask=mask)
    routes = first.routes
    auto, auto_paths = run_all(model, ids, mask, routes, taken)
    assert auto_paths == {
        "record": ["pass", "read"] * 2,
        "replay": ["pass", "lane"] * 2,
        "replay, tally": ["pass", "call", "router:redirect"] * 2,
        "record under replay": ["pass", "call", "router:redirect"] * 2,
    }
    monkeypatch.setenv(paths.ENV, "general")
    general, general_paths = run_all(model, ids, mask, routes, taken)
    assert all(p == ["block:mode", "call", "router:as is"] * 2 for p in general_paths.values()), general_paths
    for name, expected in auto.items():
        assert all(torch.equal(a, b) for a, b in zip(general[name], expected, strict=True)), name
    monkeypatch.setenv(paths.ENV, "auto")  # (set back inside the scope: the table's paths again)
    assert run_all(model, ids, mask, routes, taken)[1] == auto_paths
    model.train()  # (learns them in training too: the blocks are not wrapped from the next context on)
    with torch.no_grad(), record_routes(model):
        model(ids, attention_mask=mask)
    model.eval()
    both, both_paths = run_all(model, ids, mask, routes, taken)
    assert both_paths == {name: [p for p in found if p != "pass"] for name, found in auto_paths.items()}
    for name, expected in auto.items():
        assert all(torch.equal(a, b) for a, b in zip(both[name], expected, strict=True)), name


def test_a_cold_model_takes_the_mode_until_its_routers_are_learned(taken):
    """Outside a keep_warm scope each outermost context starts cold: the first call of each router learns, in the
    whole block; later calls of the same context pass the block and read the router's output."""
    model = tiny_qwen3_moe()
    ids, mask = left_padded(2, 6, [0, 1])
    for _ in range(2):
        taken.clear()
        with torch.no_grad(), record_routes(model):
            model(ids, attention_mask=mask)
            model(ids, attention_mask=mask)
        assert taken == ["block:mode", "call", "router:as is"] * 2 + ["pass", "read"] * 2


@pytest.mark.parametrize("value", ["fast", "General Path"])
def test_an_unknown_path_is_refused_naming_it_and_the_choices_and_nothing_is_left(value, monkeypatch):
    model = tiny_qwen3_moe()
    before = {name: dict(vars(m)) for name, m in model.named_modules()}
    monkeypatch.setenv(paths.ENV, value)
    with pytest.raises(ValueError, match=rf"MOE_REPLAY_PATH='{value}' is not one of auto, general"):
        with record_routes(model):
            pass
    assert {name: dict(vars(m)) for name, m in model.named_modules()} == before


def test_a_selector_order_that_breaks_the_contract_is_refused_naming_it():
    """The first selector that claims a call runs it: one that claims every call of its functions (TopK) must be
    offered last, or the group-limited rule after it would never run."""
    from moe_replay.engines.hf.rules import check_rules
    from moe_replay.engines.hf.selectors import GroupTopK, TopK

    assert check_rules((GroupTopK, TopK)) == (GroupTopK, TopK)
    with pytest.raises(TypeError, match="TopK claims every call of its functions .* offered before GroupTopK"):
        check_rules((TopK, GroupTopK))
    with pytest.raises(TypeError, match="is not a Selector subclass"):
        check_rules((GroupTopK, torch.topk))
