"""The replay lane (lane.py): a replay alone of a redirected router runs without the call lifecycle, replays exactly
like the general path, leaves the lane whenever the call has more to do, and refuses routes it cannot apply."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from helpers import left_padded, tiny_qwen3_moe

from moe_replay import LayerInfo, ReplayError, Routes, UnsupportedModelError, keep_warm, record_routes, replay_routes
from moe_replay.engines.hf import call as call_module
from moe_replay.engines.hf import lane as lane_module
from moe_replay.engines.hf import paths

pytestmark = pytest.mark.usefixtures("auto_path")  # (tests of which path a call takes)


@pytest.fixture
def calls(monkeypatch):  # noqa: ANN001, ANN201
    """Counts the `RouterCall`s the hub opens (none for a call in the lane)."""
    opened = []
    real = call_module.RouterCall

    def counting(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        opened.append(args[2])
        return real(*args, **kwargs)

    monkeypatch.setattr(call_module, "RouterCall", counting)
    return opened


def facts_of(model):  # noqa: ANN001, ANN202
    """What the `keep_warm` scope open on the model learned about its routers, alike here (a nested scope shares it)."""
    with keep_warm(model) as scope:
        first, *others = scope.facts.values()
    assert all(f == first for f in others), scope.facts
    return first


def learned(model, ids, mask):  # noqa: ANN001, ANN202
    """Live logits and routes, after a first replay that learns the router's facts (on the general path)."""
    with torch.no_grad(), record_routes(model) as rec:
        live = model(ids, attention_mask=mask).logits
    with torch.no_grad(), replay_routes(model, rec.routes):
        model(ids, attention_mask=mask)
    facts = facts_of(model)
    assert facts.redirect == {False: 1}
    return live, rec.routes


def test_a_replay_alone_runs_in_the_lane_and_replays_exactly(warm, calls):
    model = tiny_qwen3_moe()
    warm(model)
    ids, mask = left_padded(3, 9, [0, 2, 4])  # padded positions route live: the plan's mask is applied
    live, routes = learned(model, ids, mask)
    calls.clear()
    with torch.no_grad(), replay_routes(model, routes):
        out = model(ids, attention_mask=mask).logits
    assert calls == [] and torch.equal(out, live)
    lane_out, lane_calls = lane_then_mode(model, routes, ids, mask, calls)  # with grad, no checkpoint: the lane
    assert lane_calls == [] and torch.equal(lane_out, live)


def lane_then_mode(model, routes, ids, mask, calls):  # noqa: ANN001, ANN201
    """Replay with grad in the lane, then on the general path (MOE_REPLAY_PATH=general): both give the same logits
    and the same nonzero router gradients, and the mode path opens a call per MoE layer. Returns the lane's logits and
    the calls it opened."""
    with replay_routes(model, routes):
        lane_out = model(ids, attention_mask=mask).logits
        lane_out.square().mean().backward()
    lane_calls = list(calls)
    lane_grads = [g.weight.grad.clone() for g in gates(model)]
    model.zero_grad()
    with pytest.MonkeyPatch.context() as env:
        env.setenv(paths.ENV, "general")  # the general path, for comparison
        with replay_routes(model, routes):
            mode_out = model(ids, attention_mask=mask).logits
            mode_out.square().mean().backward()
    assert len(calls) - len(lane_calls) == 2  # its two MoE layers' calls ran on the general path
    assert torch.equal(lane_out, mode_out)
    assert all(
        torch.equal(g.weight.grad, a) and a.abs().sum() > 0 for g, a in zip(gates(model), lane_grads, strict=True)
    )
    return lane_out.detach(), lane_calls


def test_all_recorded_and_padded_selections_replay_in_the_lane_like_the_general_path(warm, calls):
    """Routes recorded at every position, then left-padded routes (live at the padding): both replay in the lane,
    with the logits and router gradients of the general path."""
    model = tiny_qwen3_moe()
    warm(model)
    for pads in ([0, 0], [0, 2]):
        ids, mask = left_padded(2, 7, pads, seed=3)
        live, routes = learned(model, ids, mask)
        assert bool(routes.mask.all()) == (pads == [0, 0])
        calls.clear()
        model.zero_grad()
        lane_out, lane_calls = lane_then_mode(model, routes, ids, mask, calls)
        assert lane_calls == [] and torch.equal(lane_out, live)


def gates(model):  # noqa: ANN001, ANN202
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def test_a_call_with_more_to_do_leaves_the_lane(warm, calls):
    model = tiny_qwen3_moe()
    warm(model)
    ids, mask = left_padded(2, 8, [0, 3])
    live, routes = learned(model, ids, mask)
    calls.clear()
    with torch.no_grad(), replay_routes(model, routes), record_routes(model) as rec:  # a recording nested inside
        out = model(ids, attention_mask=mask).logits
    assert len(calls) == 2 and torch.equal(out, live)
    assert torch.equal(rec.routes.indices[routes.mask], routes.indices[routes.mask])
    calls.clear()
    with torch.no_grad(), replay_routes(model, routes, track_live=True) as ctx:  # live picks to count
        model(ids, attention_mask=mask)
    assert len(calls) == 2 and int(ctx.live_moved()[1].sum()) == 2 * int(routes.mask.sum())
    calls.clear()
    model.gradient_checkpointing_enable()
    model.train()  # checkpointing needs training mode; checkpointed calls stay on the general path
    for _ in range(2):
        with replay_routes(model, routes):
            model(ids, attention_mask=mask).logits.sum().backward()
    assert len(calls) == 2 * 2 * 2  # two forwards: each MoE layer's call and its recompute in the backward


def test_the_lane_refuses_routes_it_cannot_apply(warm, calls):
    model = tiny_qwen3_moe()
    warm(model)
    ids, mask = left_padded(2, 8, [0, 3])
    _, routes = learned(model, ids, mask)
    calls.clear()
    wider = Routes(routes.indices, routes.mask, [LayerInfo(n, 16, 2) for n in routes.layer_names])
    with pytest.raises(ReplayError, match="has E=8 experts but the routes hold E=16 for it"):
        with torch.no_grad(), replay_routes(model, wider):
            model(ids, attention_mask=mask)
    assert calls == []  # refused in the lane
    three = tiny_qwen3_moe(top_k=3)
    with torch.no_grad(), record_routes(three) as rec:
        three(ids, attention_mask=mask)
    calls.clear()  # (the other model's recording learned its router on the general path)
    with pytest.raises(
        ReplayError, match=r"could not be applied .* k=3 of E=8 .* top-k calls were \(E, k\) = \[\(8, 2\)\]"
    ):
        with torch.no_grad(), replay_routes(model, rec.routes):
            model(ids, attention_mask=mask)
    assert calls == []  # refused in the lane too


def test_a_lane_call_that_raises_holds_nothing_of_its_replay_afterwards(warm, calls, monkeypatch):
    """Each router keeps its lane's top-k across calls (a `keep_warm` scope keeps the wrappers): a call that raises
    inside the router lets go of its plan all the same, so the closed context and its routes can be freed."""
    model = tiny_qwen3_moe()
    warm(model)
    ids, mask = left_padded(2, 8, [0, 3])
    _, routes = learned(model, ids, mask)
    calls.clear()

    def failing(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        raise RuntimeError("raised inside the router")

    monkeypatch.setattr(lane_module, "forced_topk", failing)
    ctx = replay_routes(model, routes)
    with pytest.raises(RuntimeError, match="raised inside the router"):
        with torch.no_grad(), ctx:
            model(ids, attention_mask=mask)
    assert calls == []  # it raised in the lane
    gone = weakref.ref(ctx)
    del ctx
    gc.collect()
    assert gone() is None
    monkeypatch.undo()
    with torch.no_grad(), replay_routes(model, routes):  # and the next call replays
        model(ids, attention_mask=mask)


def zero_indices(module, inputs, out) -> None:  # noqa: ANN001
    out[2].zero_()


def test_a_context_reuses_a_span_conversion_only_while_routes_and_given_indices_are_unchanged(warm):
    """Forwards of the same span in one context share one conversion of the routes: an in-place edit of the routes,
    or of the indices a router was given, between them makes a fresh one."""
    model = tiny_qwen3_moe()
    warm(model)
    ids, mask = left_padded(2, 8, [0, 0])  # all recorded: a router is given the converted indices themselves
    routes = learned(model, ids, mask)[1]
    other = tiny_qwen3_moe(seed=1)
    with torch.no_grad(), record_routes(other) as rec:
        other(ids, attention_mask=mask)
    assert not torch.equal(rec.routes.indices[routes.mask], routes.indices[routes.mask])
    assert bool(routes.mask.all())
    edited = Routes(routes.indices.clone(), routes.mask.clone(), routes.layers)

    def used() -> torch.Tensor:  # the experts the replayed forward used, at recorded positions
        with record_routes(model) as seen:
            model(ids, attention_mask=mask)
        return seen.routes.indices[routes.mask]

    gate = gates(model)[0]
    with torch.no_grad(), replay_routes(model, edited):
        assert torch.equal(used(), routes.indices[routes.mask])
        edited.indices.copy_(rec.routes.indices)  # the routes edited in place, inside the context
        assert torch.equal(used(), rec.routes.indices[routes.mask])
        hook = gate.register_forward_hook(zero_indices)  # a router that edits the indices it was given, in place
        with pytest.raises(UnsupportedModelError, match="changed in place after it returned them"):
            used()  # (which its recording refuses: it would record the experts given, not the ones used)
        hook.remove()
        assert torch.equal(used(), rec.routes.indices[routes.mask])  # given fresh ones


@pytest.mark.parametrize("device_mask", [False, True])
def test_an_in_place_edit_of_the_routes_mask_inside_a_context_is_followed(warm, monkeypatch, device_mask):
    """Positions whose mask is set False in place, inside the context, route live from the next forward on; with a
    mask on a device (as on a GPU; simulated here), the host copy that tells whether a span is all recorded is made
    again after the edit."""
    import moe_replay.engines.hf.replay as replay_module

    if device_mask:
        monkeypatch.setattr(replay_module, "on_host", lambda tensor: False)
    model = tiny_qwen3_moe()
    warm(model)
    ids, mask = left_padded(2, 8, [0, 0])
    routes = learned(model, ids, mask)[1]
    other = tiny_qwen3_moe(seed=1)
    with torch.no_grad(), record_routes(other) as rec:
        other(ids, attention_mask=mask)
    forced = Routes(rec.routes.indices.clone(), rec.routes.mask.clone(), rec.routes.layers)  # another model's picks

    def used() -> torch.Tensor:
        with record_routes(model) as seen:
            model(ids, attention_mask=mask)
        return seen.routes.indices

    with torch.no_grad(), replay_routes(model, forced):
        assert torch.equal(used()[forced.mask], rec.routes.indices[forced.mask])
        forced.mask[1] = False  # the second sequence now routes live
        now = used()
    assert torch.equal(now[0], rec.routes.indices[0]) and torch.equal(now[1], routes.indices[1])


@pytest.mark.parametrize("small", [True, False], ids=["converted-per-span", "converted-per-call"])
@pytest.mark.parametrize("track_live", [False, True], ids=["lane", "general-path"])
def test_the_experts_get_contiguous_indices_under_replay_as_from_a_live_top_k(warm, monkeypatch, small, track_live):
    """The indices a replayed router returns reach the experts contiguous, as a live top-k's do: a strided view
    (a layer's columns of the routes) would cost the experts a copy per router call (grouped_mm reshapes them)."""
    from moe_replay.engines.hf import replay as replay_module

    if not small:
        monkeypatch.setattr(replay_module, "SMALL_FORWARD", 0)
    model = tiny_qwen3_moe()
    warm(model)
    ids, mask = left_padded(2, 8, [0, 0])  # all recorded: the experts get the converted indices themselves
    routes = learned(model, ids, mask)[1]
    given = []
    hooks = [
        layer.mlp.experts.register_forward_pre_hook(lambda m, args: given.append(args[1]))
        for layer in model.model.layers
        if hasattr(layer.mlp, "experts")
    ]
    with torch.no_grad(), replay_routes(model, routes, track_live=track_live):
        model(ids, attention_mask=mask)
    for hook in hooks:
        hook.remove()
    assert len(given) == len(routes.layers) == 2
    assert all(idx.is_contiguous() for idx in given), [idx.stride() for idx in given]
    assert torch.equal(torch.stack([idx.reshape(2, 8, -1) for idx in given], 2), routes.indices.long())


@pytest.mark.parametrize("shape", [(2, 9), (3, 2000)])  # read as lists, and by a torch reduction (over SMALL_MASK)
def test_whether_a_span_is_all_recorded_is_read_alike_for_small_and_large_masks(shape):
    from moe_replay.engines.hf.replay import SMALL_MASK, all_true

    mask = torch.ones(shape, dtype=torch.bool)
    assert (mask.numel() > SMALL_MASK) == (shape[1] == 2000)
    assert all_true(mask) and all_true(mask[:, 3:7])  # a whole mask and a strided slice of it
    mask[-1, 5] = False
    assert not all_true(mask) and not all_true(mask[:, 3:7]) and all_true(mask[:, :5]) and all_true(mask[:-1])
