"""What a replay context makes of its routes per span of positions (replay.py): forwards of one span share one
conversion only while the routes are unchanged, so routes or a mask edited in place inside the context are followed
from the next forward on; the experts get contiguous indices, as from a live top-k; routes whose tensors are replaced
by others are refused. On both paths (the declared one, and MOE_REPLAY_PATH=general)."""

from __future__ import annotations

import pytest
import torch
from helpers import left_padded, tiny_qwen3_moe

from moe_replay import ReplayError, Routes, UnsupportedModelError, record_routes, replay_routes
from moe_replay.engines.hf import replay as replay_module
from moe_replay.engines.hf.declared import ENV


@pytest.fixture(params=["auto", "general"], autouse=True)
def path(request, monkeypatch):  # noqa: ANN001, ANN201
    """Each test on the paths the declarations pick, then on the general path alone."""
    monkeypatch.setenv(ENV, request.param)
    return request.param


def gates(model):  # noqa: ANN001, ANN202
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def own_and_other(ids, mask):  # noqa: ANN001, ANN202
    """A tiny Qwen3-MoE, the routes it records, and the routes another one (seed 1) records on the same batch, which
    differ from its own at some recorded position."""
    model = tiny_qwen3_moe()
    with torch.no_grad(), record_routes(model) as rec:
        model(ids, attention_mask=mask)
    other = tiny_qwen3_moe(seed=1)
    with torch.no_grad(), record_routes(other) as theirs:
        other(ids, attention_mask=mask)
    own, foreign = rec.routes, theirs.routes
    assert not torch.equal(own.indices[own.mask], foreign.indices[own.mask])
    return model, own, foreign


def zero_indices(module, inputs, out) -> None:  # noqa: ANN001
    out[2].zero_()


def test_routes_edited_in_place_or_indices_edited_by_a_router_are_followed_inside_a_context():
    """Forwards of the same span in one context: routes edited in place between them are replayed as edited; a
    router that edits in place the indices it was given is refused by the recording (it would record the experts
    given, not those used), and the next forward is given indices converted afresh."""
    ids, mask = left_padded(2, 8, [0, 0])  # all recorded: a router is given the converted indices themselves
    model, own, foreign = own_and_other(ids, mask)
    edited = Routes(own.indices.clone(), own.mask.clone(), own.layers)

    def used() -> torch.Tensor:  # the experts the replayed forward used, at recorded positions
        with record_routes(model) as seen:
            model(ids, attention_mask=mask)
        return seen.routes.indices[own.mask]

    with torch.no_grad(), replay_routes(model, edited):
        assert torch.equal(used(), own.indices[own.mask])
        edited.indices.copy_(foreign.indices)  # the routes edited in place, inside the context
        assert torch.equal(used(), foreign.indices[own.mask])
        hook = gates(model)[0].register_forward_hook(zero_indices)
        with pytest.raises(UnsupportedModelError, match="changed in place after it returned them"):
            used()
        hook.remove()
        assert torch.equal(used(), foreign.indices[own.mask])  # not the zeros: given fresh ones


@pytest.mark.parametrize("device_mask", [False, True], ids=["host-mask", "device-mask"])
def test_a_routes_mask_edited_in_place_inside_a_context_is_followed(monkeypatch, device_mask):
    """Positions whose mask is set False in place, inside the context, route live from the next forward on; with a
    mask on a device (as on a GPU; simulated here), the host copy that says whether a span is all recorded is made
    again after the edit."""
    if device_mask:
        monkeypatch.setattr(replay_module, "on_host", lambda tensor: False)
    ids, mask = left_padded(2, 8, [0, 0])
    model, own, foreign = own_and_other(ids, mask)
    forced = Routes(foreign.indices.clone(), foreign.mask.clone(), foreign.layers)

    def used() -> torch.Tensor:
        with record_routes(model) as seen:
            model(ids, attention_mask=mask)
        return seen.routes.indices

    with torch.no_grad(), replay_routes(model, forced):
        assert torch.equal(used()[forced.mask], foreign.indices[forced.mask])
        forced.mask[1] = False  # the second sequence now routes live
        now = used()
    assert not torch.equal(foreign.indices[1], own.indices[1])  # (live differs from the forced experts there)
    assert torch.equal(now[0], foreign.indices[0]) and torch.equal(now[1], own.indices[1])


@pytest.mark.parametrize("small", [True, False], ids=["converted-per-span", "converted-per-call"])
@pytest.mark.parametrize("track_live", [False, True], ids=["replay", "track-live"])
def test_the_experts_get_contiguous_indices_under_replay_as_from_a_live_top_k(monkeypatch, small, track_live):
    """The indices a replayed router returns reach the experts contiguous, as a live top-k's do (a strided view, a
    layer's columns of the routes, would cost the experts a copy per call), and are the recorded ones."""
    if not small:
        monkeypatch.setattr(replay_module, "SMALL_FORWARD", 0)
    ids, mask = left_padded(2, 8, [0, 0])  # all recorded: the experts get the converted indices themselves
    model, _, routes = own_and_other(ids, mask)
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


@pytest.mark.parametrize("which", ["indices", "mask"])
def test_routes_whose_tensors_are_replaced_inside_a_context_are_refused(which):
    """A context converts its routes once per span and reuses that while their version counters are unchanged: a
    tensor put in their place (a fresh one's counter may equal the old one's) would be ignored, so it is refused."""
    ids, mask = left_padded(2, 6, [0, 2])
    model, own, foreign = own_and_other(ids, mask)
    routes = Routes(own.indices.clone(), own.mask.clone(), own.layers)
    with torch.no_grad(), replay_routes(model, routes):
        model(ids, attention_mask=mask)
        replaced = foreign.indices.clone() if which == "indices" else routes.mask.clone()
        setattr(routes, which, replaced)
        with pytest.raises(ReplayError, match="replaced by another tensor while a replay of them was open"):
            model(ids, attention_mask=mask)
