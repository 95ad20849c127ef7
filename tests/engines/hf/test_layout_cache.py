"""The module walk kept between contexts in a `keep_warm` scope (layout.py): reused while the model's tree holds, found
again when a router, a layer or a wrapper changes it, so a context never hooks a stale set of routers."""

from __future__ import annotations

import copy

import pytest
import torch
from families import build_tiny_model
from helpers import perturb
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

from moe_replay import record_routes, replay_routes
from moe_replay.engines.hf.layout import model_layout
from moe_replay.engines.hf.warm import KeepWarm
from moe_replay.errors import ReplayError
from moe_replay.layers import plain_name


def layout(scope: KeepWarm):  # noqa: ANN201
    """The layout the next context in `scope` uses: the kept one while the tree holds, else a fresh walk."""
    return model_layout(scope.model, scope.warm)


def recorded_layers(model, ids):  # noqa: ANN001, ANN202
    with torch.no_grad(), record_routes(model) as rec:
        model(ids)
    return rec.routes.layer_names


def test_layout_is_kept_and_found_again_when_the_tree_changes(warm):
    model = build_tiny_model("qwen3_moe")
    w = warm(model)
    ids = torch.randint(5, 100, (1, 6))
    first = recorded_layers(model, ids)
    kept = layout(w)
    assert layout(w) is kept  # no new walk while nothing changed
    assert recorded_layers(model, ids) == first

    layers = model.model.layers
    layers.append(copy.deepcopy(layers[-1]))  # a new MoE layer: its router must be hooked and recorded
    model.config.num_hidden_layers += 1
    grown = recorded_layers(model, ids)
    assert layout(w) is not kept and len(grown) == len(first) + 1

    kept = layout(w)
    block = layers[1].mlp
    block.gate = copy.deepcopy(block.gate)  # the same path, another router instance
    assert layout(w) is not kept
    assert layout(w).sites[0].router is block.gate

    kept = layout(w)
    layers[0] = copy.deepcopy(layers[1])  # the dense first layer swapped for an MoE one: same number of children
    assert layout(w) is not kept
    grown = recorded_layers(model, ids)
    assert len(grown) == len(first) + 2

    kept = layout(w)
    layers[1] = checkpoint_wrapper(layers[1])  # a wrapper renames the path: found again
    assert layout(w) is not kept
    assert [plain_name(n) for n in recorded_layers(model, ids)] == grown

    clone = copy.deepcopy(model)  # a copy never uses the original's modules
    w_clone = warm(clone)
    assert all(a.router is not b.router for a, b in zip(layout(w_clone).sites, layout(w).sites, strict=True))


def test_a_dense_mlp_swapped_for_an_moe_block_inside_a_kept_layer_is_found(warm):
    """Sparse upcycling in place: the dense first layer keeps its place and gets an MoE block as its `mlp`. That layer
    is on no path to a router, yet a fresh walk must find the new router (found while profiling: the layout kept only
    the paths to the routers, so the new layer was silently left out of the recording)."""
    model = build_tiny_model("qwen3_moe")
    w = warm(model)
    ids = torch.randint(5, 100, (1, 6))
    with torch.no_grad(), record_routes(model) as rec:
        model(ids)
    before = rec.routes
    assert not any(name.startswith("model.layers.0.") for name in before.layer_names)  # the first layer is dense
    kept = layout(w)
    model.model.layers[0].mlp = copy.deepcopy(model.model.layers[1].mlp)
    assert layout(w) is not kept
    with torch.no_grad(), record_routes(model) as rec:
        expected = model(ids).logits
    assert rec.routes.layer_names == ["model.layers.0.mlp.gate", *before.layer_names]
    with pytest.raises(ReplayError, match=r"model\.layers\.0\.mlp\.gate"), replay_routes(model, before):
        model(ids)  # the routes from before the swap hold no layer for the new router: refused as the context opens
    with torch.no_grad(), replay_routes(model, rec.routes):
        assert torch.equal(model(ids).logits, expected)


def test_a_router_class_swapped_in_place_is_learned_afresh(warm):
    """torch's parametrize swaps a router's class in place for a subclass that keeps its forward: the kept hub looks up
    the facts of the class that now runs instead of reusing the old class's (found by review), and still replays."""
    from torch.nn.utils import parametrize

    model = build_tiny_model("qwen3_moe")
    w = warm(model)
    ids = torch.randint(5, 100, (1, 6))
    recorded_layers(model, ids)  # learns the router class's facts
    recorded_layers(model, ids)  # patches set as learned: the next context sets them again as they are
    router = layout(w).sites[0].router
    before = type(router)

    class Scaled(nn.Module):
        def forward(self, weight: torch.Tensor) -> torch.Tensor:
            return weight * 2.0

    parametrize.register_parametrization(router, "weight", Scaled())
    assert type(router) is not before and type(router).forward is before.forward
    with torch.no_grad(), record_routes(model) as rec:
        expected = model(ids).logits
    assert type(router) in w.warm.facts  # learned for the class that ran
    with torch.no_grad(), replay_routes(model, rec.routes):
        assert torch.equal(model(ids).logits, expected)


def test_a_router_class_helper_patched_between_contexts_is_learned_afresh(warm, monkeypatch):
    """LongCat-Flash's router returns the indices its `get_topk_indices` helper returns: learned once, its output is
    read for them. A helper patched on the class afterwards (here one that remaps the ids it returns) must have its
    top-k recorded, not its output: replaying the remapped ids would remap them again, with no error (found by
    review: the facts were kept while the class's `forward` was unchanged)."""
    model = build_tiny_model("longcat_flash").eval()
    w = warm(model)
    ids = torch.randint(5, 100, (2, 6))
    recorded_layers(model, ids)
    recorded_layers(model, ids)  # the patches are set again as they were, the router read from its output
    cls = type(layout(w).sites[0].router)
    helper = cls.get_topk_indices

    def remapped(self, scores):  # noqa: ANN001, ANN202
        idx = helper(self, scores)
        return (idx + 1) % self.n_routed_experts

    monkeypatch.setattr(cls, "get_topk_indices", remapped)
    with torch.no_grad(), record_routes(model) as rec:
        expected = model(ids).logits
    with torch.no_grad(), replay_routes(model, rec.routes):
        assert torch.equal(model(ids).logits, expected)


def biased_block_forward(self, hidden_states):  # noqa: ANN001, ANN201
    """A Qwen3-MoE block forward that ranks the router's logits itself, with a per-expert bias (as a balancing patch
    or a fused kernel might): the router's own top-k no longer decides the experts."""
    B, T, H = hidden_states.shape
    x = hidden_states.view(-1, H)
    logits = self.gate(x)[0]
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    bias = torch.linspace(-0.3, 0.3, probs.shape[-1])
    idx = torch.topk(probs + bias, self.gate.top_k, dim=-1).indices
    return self.experts(x, idx, probs.gather(-1, idx).to(logits.dtype)).reshape(B, T, H)


def experts_used(model, ids, context):  # noqa: ANN001, ANN201
    """The experts each MoE layer's experts module was given [B, T, L, K], in a forward under `context`."""
    got = []
    hooks = [
        m.register_forward_pre_hook(lambda _m, args: got.append(args[1].clone()))
        for m in model.modules()
        if type(m).__name__ == "Qwen3MoeExperts"
    ]
    try:
        with torch.no_grad(), context:
            model(ids)
    finally:
        for hook in hooks:
            hook.remove()
    return torch.stack([g.reshape(*ids.shape, -1) for g in got], 2).sort(-1).values


@pytest.mark.parametrize("where", ["class", "instance"])
def test_an_moe_block_forward_patched_between_contexts_is_learned_afresh(warm, monkeypatch, where):
    """The router class's facts say its top-k runs inside the router, so later contexts wrap the router alone. A block
    forward patched afterwards that ranks the logits itself must be intercepted again: recorded, the experts the
    block used; replayed, the experts forced (found by review: the block ran unseen, with no error)."""
    import types

    model = build_tiny_model("qwen3_moe").eval()
    w = warm(model)
    ids = torch.randint(5, 100, (2, 6))
    other = copy.deepcopy(model)
    perturb(other, scale=1.0)
    with torch.no_grad(), record_routes(other) as rec:
        other(ids)
    routes = rec.routes
    recorded_layers(model, ids)  # learns that the top-k runs in the router
    if where == "class":
        monkeypatch.setattr(layout(w).sites[0].scope.__class__, "forward", biased_block_forward)
    else:
        for site in layout(w).sites:
            site.scope.forward = types.MethodType(biased_block_forward, site.scope)
    recorder = record_routes(model)
    used = experts_used(model, ids, recorder)
    assert torch.equal(recorder.routes.indices.long().sort(-1).values, used)
    assert torch.equal(experts_used(model, ids, replay_routes(model, routes)), routes.indices.long().sort(-1).values)


def test_a_patch_made_while_a_context_is_open_is_refused_by_a_nested_context_or_copied_as_it_opens(warm, monkeypatch):
    """The open contexts' wrappers run what they hooked: a nested context refuses a router class or block patched
    meanwhile, and copies again a module-level name its redirected forward reads (here `F`, patched)."""
    import types

    model = build_tiny_model("qwen3_moe").eval()
    w = warm(model)
    ids = torch.randint(5, 100, (2, 6))
    recorded_layers(model, ids)  # learns the router class (its top-k redirected)
    block = type(layout(w).sites[0].scope)
    scope = type(layout(w).sites[0].router).forward.__globals__
    F = scope["F"]
    tripled = types.SimpleNamespace(**{k: getattr(F, k) for k in dir(F) if not k.startswith("__")})
    tripled.linear = lambda x, w, b=None: 3 * F.linear(x, w, b)
    with torch.no_grad(), record_routes(model):
        monkeypatch.setitem(scope, "F", tripled)
        with record_routes(model) as rec:
            expected = model(ids).logits
        with replay_routes(model, rec.routes):
            assert torch.equal(model(ids).logits, expected)
        monkeypatch.setattr(block, "forward", biased_block_forward)
        with pytest.raises(ReplayError, match="Qwen3MoeTopKRouter were patched while a moe-replay context was open"):
            record_routes(model).__enter__()


def test_the_hub_and_its_wrappers_are_kept_between_contexts_but_never_copied_or_saved(warm, tmp_path):
    """A context per minibatch reuses the hub and its patched methods (no hooks stay between contexts); a method the
    user replaced in between is wrapped afresh; a deep copy or a saved model carries no hub."""
    model = build_tiny_model("qwen3_moe").eval()
    w = warm(model)
    ids = torch.randint(5, 100, (2, 6), generator=torch.Generator().manual_seed(0))
    with torch.no_grad(), record_routes(model) as rec:
        model(ids)
    router = layout(w).sites[0].router
    hub = layout(w).kept["hub"]
    assert "forward" not in router.__dict__  # unhooked once the context closed
    with torch.no_grad(), replay_routes(model, rec.routes):
        wrapper = router.__dict__["forward"]
        assert layout(w).kept["hub"] is hub
        model(ids)
    with torch.no_grad(), replay_routes(model, rec.routes):
        assert router.__dict__["forward"] is wrapper  # the same wrapper, reused
        model(ids)

    calls = []
    plain = router.forward

    def counted(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(1)
        return plain(*args, **kwargs)

    router.forward = counted  # the user's own instance method, set between contexts
    with torch.no_grad(), replay_routes(model, rec.routes):
        assert router.__dict__["forward"] is not wrapper
        model(ids)
    assert calls == [1] and router.__dict__["forward"] is counted
    del router.forward
    with torch.no_grad(), replay_routes(model, rec.routes):  # wrapped afresh: the instance method is gone again
        assert router.__dict__["forward"] is not counted
        model(ids)
        inside = copy.deepcopy(model)  # the copy hook of a context set up from the kept patches
    copied = dict(inside.named_modules())[layout(w).sites[0].name]
    assert calls == [1] and "forward" not in copied.__dict__ and "forward" not in router.__dict__

    cls, original = type(router), type(router).forward
    seen = []

    def class_forward(self, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
        seen.append(1)
        return original(self, *args, **kwargs)

    try:
        cls.forward = class_forward  # the class's method replaced between contexts: its wrappers are made afresh
        with torch.no_grad(), replay_routes(model, rec.routes):
            model(ids)
        assert len(seen) == len(layout(w).sites)
    finally:
        cls.forward = original

    clone = copy.deepcopy(model)
    w_clone = warm(clone)
    assert layout(w_clone).kept.get("hub") is None
    with torch.no_grad(), record_routes(clone) as again:
        clone(ids)
    assert torch.equal(again.routes.indices, rec.routes.indices) and layout(w_clone).kept["hub"] is not hub
    torch.save(model, tmp_path / "model.pt")  # a hub (closures) would not pickle
    loaded = torch.load(tmp_path / "model.pt", weights_only=False)
    with torch.no_grad(), record_routes(loaded) as third:
        loaded(ids)
    assert torch.equal(third.routes.indices, rec.routes.indices)
