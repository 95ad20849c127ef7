"""Interception of the router's own `torch.topk` only (redirect.py): which routers qualify, that it replays bit for
bit like the TorchFunctionMode path (forward and gradients), and that anything else keeps the mode."""

from __future__ import annotations

import pytest
import torch
from families import build_tiny_model
from helpers import perturb

from moe_replay import keep_warm, record_routes, replay_routes
from moe_replay.engines.hf import paths
from moe_replay.engines.hf.selectors import GroupTopK

pytestmark = pytest.mark.usefixtures("auto_path")  # (tests of which path a call takes)


def facts_of(model):  # noqa: ANN001, ANN202
    """What the `keep_warm` scope open on the model learned about its routers, alike here (a nested scope shares it)."""
    with keep_warm(model) as scope:
        first, *others = scope.facts.values()
    assert all(f == first for f in others), scope.facts
    return first


def gates(model):  # noqa: ANN001, ANN202
    """The routers of a tiny Qwen3-MoE (its first layer is dense)."""
    return [layer.mlp.gate for layer in model.model.layers if hasattr(layer.mlp, "gate")]


def replayed(model, routes, ids, general: bool = False):  # noqa: ANN001, ANN202
    """Logits and router-weight gradients of a replayed forward + backward, on the paths the table picks (with the
    router's facts as learned) or, with `general`, on the general path alone (MOE_REPLAY_PATH=general)."""
    model.zero_grad()
    with pytest.MonkeyPatch.context() as env:
        if general:
            env.setenv(paths.ENV, "general")
        with replay_routes(model, routes):
            logits = model(ids).logits
            logits.square().mean().backward()
    grads = [p.grad.clone() for n, p in model.named_parameters() if n.endswith("gate.weight")]
    return logits.detach(), grads


def test_a_plain_topk_router_is_redirected_and_replays_like_the_mode_path(warm):
    model = build_tiny_model("qwen3_moe").train()
    warm(model)
    ids = torch.randint(5, 100, (2, 10))
    with torch.no_grad(), record_routes(model) as rec:
        live = model(ids).logits
    first, _ = replayed(model, rec.routes, ids)  # learns, per training mode, that the top-k qualifies
    assert facts_of(model).redirect == {True: 1}
    fast, fast_grads = replayed(model, rec.routes, ids)
    mode, mode_grads = replayed(model, rec.routes, ids, general=True)
    assert torch.equal(fast, live) and torch.equal(fast, mode) and torch.equal(first, live)
    assert all(torch.equal(a, b) for a, b in zip(fast_grads, mode_grads, strict=True))
    assert all(g.abs().sum() > 0 for g in fast_grads)  # the router still gets gradients


def test_a_group_limited_router_is_redirected_and_steers_its_groups_like_the_mode_path(warm, monkeypatch):
    """DeepSeek-V2's group-limited greedy routing makes three top-k calls: each group's best score (over [tokens,
    groups, experts per group], a method call left as it is), the groups, then the experts (both `torch.topk` in its
    forward). Replayed on a changed model, the group top-k must keep the recorded experts' groups, or their weights
    are masked to zero: the redirected path steers it as the mode path does."""
    model = build_tiny_model("deepseek_v2").train()
    warm(model)
    ids = torch.randint(5, 100, (2, 10))
    with torch.no_grad(), record_routes(model) as rec:
        model(ids)
    perturb(model, scale=1.0)  # the live groups are no longer the recorded ones
    first, _ = replayed(model, rec.routes, ids)  # learns that both ranked top-k calls qualify
    assert facts_of(model).redirect == {True: 2}
    fast, fast_grads = replayed(model, rec.routes, ids)
    mode, mode_grads = replayed(model, rec.routes, ids, general=True)
    assert torch.equal(fast, mode) and torch.equal(first, mode)
    assert all(torch.equal(a, b) for a, b in zip(fast_grads, mode_grads, strict=True))
    monkeypatch.setattr(GroupTopK, "claims", lambda *a: False)  # control: without steering the groups, it differs
    unsteered, _ = replayed(model, rec.routes, ids)
    assert not torch.equal(unsteered, mode)


def test_routers_that_do_not_qualify_keep_the_mode(warm):
    ids = torch.randint(5, 100, (2, 8))
    # a top-k called as a tensor method (GraniteMoE), which the proxy for `torch` cannot see
    model = build_tiny_model("granitemoe")
    warm(model)
    with torch.no_grad(), record_routes(model) as rec:
        live = model(ids).logits
    with torch.no_grad(), replay_routes(model, rec.routes):
        assert torch.equal(model(ids).logits, live)
    assert [facts_of(model).redirect] == [{False: 0}]

    # a wrapper in front of the router's forward (as accelerate's hooks install): redirecting would bypass it
    model = build_tiny_model("qwen3_moe")
    warm(model)
    calls = []
    for gate in gates(model):
        gate.forward = lambda *a, _f=gate.forward, **k: calls.append(1) or _f(*a, **k)
    with torch.no_grad(), record_routes(model) as rec:
        live = model(ids).logits
    for _ in range(2):
        n = len(calls)
        with torch.no_grad(), replay_routes(model, rec.routes):
            assert torch.equal(model(ids).logits, live)
        assert len(calls) - n == len(rec.routes.layers)  # the wrapper ran for every router call

    # a top-k called from a helper, not from the router's own forward
    model = build_tiny_model("qwen3_moe")
    warm(model)
    gate_cls = type(gates(model)[0])
    source = gate_cls.forward

    def pick(probs, k):  # noqa: ANN001, ANN202
        return torch.topk(probs, k, dim=-1)

    class HelperTopK(gate_cls):
        def forward(self, hidden_states):  # noqa: ANN001, ANN202
            hidden_states = hidden_states.reshape(-1, self.hidden_dim)
            logits = torch.nn.functional.linear(hidden_states, self.weight)
            probs = torch.softmax(logits, dtype=torch.float, dim=-1)
            values, indices = pick(probs, self.top_k)
            values = values / values.sum(dim=-1, keepdim=True) if self.norm_topk_prob else values
            return logits, values.to(logits.dtype), indices

    assert source is not HelperTopK.forward
    for gate in gates(model):
        gate.__class__ = HelperTopK
    with torch.no_grad(), record_routes(model) as rec:
        live = model(ids).logits
    for _ in range(2):
        with torch.no_grad(), replay_routes(model, rec.routes):
            assert torch.equal(model(ids).logits, live)
    assert facts_of(model).redirect == {False: 0}


def test_the_redirected_forward_runs_what_its_module_holds_when_a_context_opens(warm, monkeypatch):
    """The redirected copy of a router's forward reads its module's globals from a copy of them: a module-level name
    patched between contexts (a kernel library, a user's patch of `F`) is copied again as the next context opens,
    so the copy runs what the class's forward would (found by review: it ran the first context's `F`)."""
    import types

    model = build_tiny_model("qwen3_moe").eval()
    warm(model)
    ids = torch.randint(5, 100, (2, 10))
    with torch.no_grad(), record_routes(model) as rec:
        model(ids)
    before, _ = replayed(model, rec.routes, ids)  # makes the copy, and learns that its top-k qualifies
    assert facts_of(model).redirect == {False: 1}
    scope = type(gates(model)[0]).forward.__globals__
    F = scope["F"]
    doubled = types.SimpleNamespace(**{k: getattr(F, k) for k in dir(F) if not k.startswith("__")})
    doubled.linear = lambda x, w, b=None: 2 * F.linear(x, w, b)
    monkeypatch.setitem(scope, "F", doubled)
    fast, _ = replayed(model, rec.routes, ids)
    mode, _ = replayed(model, rec.routes, ids, general=True)
    assert torch.equal(fast, mode) and not torch.equal(fast, before)


def test_the_redirected_forward_runs_the_torch_attributes_torch_holds_when_a_context_opens(warm, monkeypatch):
    """The same for what the forward reads as `torch.<name>` (the proxy holds torch's attributes as they were): a
    torch attribute replaced between contexts is read again as the next context opens, and a context that finds
    nothing replaced copies nothing."""
    import types

    model = build_tiny_model("qwen3_moe").eval()
    warm(model)
    ids = torch.randint(5, 100, (2, 10))
    with torch.no_grad(), record_routes(model) as rec:
        model(ids)
    before, _ = replayed(model, rec.routes, ids)
    assert facts_of(model).redirect == {False: 1}
    with keep_warm(model) as scope:
        copy = next(iter(scope.warm.layout.kept["hub"].redirects._forwards.values()))
    kept = copy.refreshed
    again, _ = replayed(model, rec.routes, ids)
    assert torch.equal(again, before) and copy.refreshed is kept  # nothing replaced: nothing copied
    F = torch.nn.functional
    functional = types.SimpleNamespace(**{k: getattr(F, k) for k in dir(F) if not k.startswith("__")})
    functional.softmax = lambda x, *a, **k: F.softmax(2 * x, *a, **k)  # what the Qwen3 router reads as torch.nn...
    monkeypatch.setattr(torch, "nn", types.SimpleNamespace(**{**vars(torch.nn), "functional": functional}))
    fast, _ = replayed(model, rec.routes, ids)
    mode, _ = replayed(model, rec.routes, ids, general=True)
    assert copy.refreshed is not kept
    assert torch.equal(fast, mode) and not torch.equal(fast, before)
