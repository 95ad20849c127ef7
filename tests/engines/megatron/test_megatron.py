"""record_routes / replay_routes on a megatron-core GPTModel (2 MoE layers, 4 experts, top-2), one CPU process."""

from __future__ import annotations

import sys
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("megatron.core.transformer.moe.router_replay", reason="needs the [megatron] extra")

from megatron_utils import (  # noqa: E402
    EXPERTS,
    LAYERS,
    TOP_K,
    batch,
    grads,
    perturb_routers,
    recompute_pair,
    tiny_gpt,
)

import moe_replay  # noqa: E402
from moe_replay import ReplayError, Routes, expert_change  # noqa: E402
from moe_replay.engines.megatron import (  # noqa: E402
    MegatronRouteRecorder,
    find_routers,
    from_layer_rows,
    record_routes,
    replay_routes,
    to_layer_rows,
)
from moe_replay.engines.megatron.routers import refusal  # noqa: E402
from moe_replay.routes import LayerInfo  # noqa: E402

pytestmark = pytest.mark.usefixtures("megatron_process")  # one megatron-core CPU process (conftest.py)


def routers(model):
    return [m for name, m in model.named_modules() if name.endswith("mlp.router")]


def capture_routing(model):
    """Forward hooks (outside moe-replay) that keep each router's routing map [S*B, E] of every call."""
    seen: list[list[torch.Tensor]] = [[] for _ in routers(model)]
    handles = [
        r.register_forward_hook(lambda m, a, out, i=i: seen[i].append(out[1].detach().clone()))
        for i, r in enumerate(routers(model))
    ]
    return seen, handles


def as_map(routes: Routes, layer: int) -> torch.Tensor:
    """Routes of one layer as a routing map [T*B, E] in Megatron's sequence-major row order."""
    rows = to_layer_rows(routes)[layer]
    return torch.zeros(rows.shape[0], EXPERTS, dtype=torch.bool).scatter(1, rows, True)


def test_layout_from_layer_rows_by_hand():
    # S=2, B=2, K=2, sequence-major rows: s0b0, s0b1, s1b0, s1b1
    rows = [torch.tensor([[0, 1], [2, 3], [1, 0], [3, 2]])]
    routes = from_layer_rows(rows, batch_size=2, layers=[LayerInfo("l0", 4, 2)])
    assert routes.indices.shape == (2, 2, 1, 2)
    assert routes.indices[0, 1, 0].tolist() == [1, 0]  # sequence 0, position 1 is row s1b0
    assert routes.indices[1, 0, 0].tolist() == [2, 3]  # sequence 1, position 0 is row s0b1
    assert torch.equal(to_layer_rows(routes)[0], rows[0])
    with pytest.raises(ValueError, match="3 rows do not split into batch_size=2"):
        from_layer_rows([torch.zeros(3, 2, dtype=torch.long)], 2, [LayerInfo("l0", 4, 2)])


def test_to_layer_rows_spreads_unrecorded_positions():
    indices = torch.zeros(2, 3, 1, 2, dtype=torch.uint8)
    indices[..., 1] = 1
    mask = torch.tensor([[True, False, False], [True, True, False]])
    rows = to_layer_rows(Routes(indices, mask, [LayerInfo("l0", 4, 2)]))[0]
    recorded = mask.T.reshape(-1)
    assert (rows[recorded] == torch.tensor([0, 1])).all()
    unrecorded = rows[~recorded]
    assert (unrecorded[:, 0] != unrecorded[:, 1]).all()  # distinct experts within a row
    assert len(set(unrecorded.flatten().tolist())) > 2  # not every pad row on the same experts


def test_record_then_replay_is_exact_forward_and_backward():
    model = tiny_gpt()
    tokens, pos, mask, labels = batch()
    with record_routes(model) as rec:
        logits = model(tokens, pos, mask)
    routes = rec.routes
    assert routes.indices.shape == (3, 8, LAYERS, TOP_K)
    assert routes.layer_names == ["decoder.layers.0.mlp.router", "decoder.layers.1.mlp.router"]
    assert routes.mask.all()

    loss = model(tokens, pos, mask, labels=labels).mean()
    loss.backward()
    plain = grads(model)
    model.zero_grad(set_to_none=True)
    with replay_routes(model, routes):
        assert torch.equal(model(tokens, pos, mask), logits)
        replayed = model(tokens, pos, mask, labels=labels).mean()
        replayed.backward()
    assert torch.equal(replayed, loss)
    got = grads(model)
    assert plain.keys() == got.keys()
    assert all(torch.equal(plain[n], got[n]) for n in plain)
    assert all(got[f"decoder.layers.{i}.mlp.router.weight"].abs().sum() > 0 for i in range(LAYERS))


def test_replay_restores_recorded_experts_after_router_perturbation():
    model = tiny_gpt()
    tokens, pos, mask, labels = batch(b=4, s=12)
    with record_routes(model) as rec:
        model(tokens, pos, mask)
    routes = rec.routes
    perturb_routers(model)
    with record_routes(model) as live:
        model(tokens, pos, mask)
    change = expert_change(routes, live.routes)
    assert change.fraction > 0.05  # the perturbation moves some experts without replay

    seen, handles = capture_routing(model)
    try:
        with replay_routes(model, routes):
            model(tokens, pos, mask, labels=labels).mean().backward()
    finally:
        for h in handles:
            h.remove()
    for layer in range(LAYERS):
        assert torch.equal(seen[layer][0], as_map(routes, layer))
    assert all(r.weight.grad.abs().sum() > 0 for r in routers(model))


def test_unrecorded_positions_route_live():
    model = tiny_gpt()
    tokens, pos, mask, _ = batch(b=2, s=6)
    with record_routes(model) as rec:
        model(tokens, pos, mask)
    perturb_routers(model, seed=3)
    with record_routes(model) as live:
        model(tokens, pos, mask)
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[0, :3] = False  # e.g. left padding
    partial = Routes(rec.routes.indices, keep, rec.routes.layers)
    seen, handles = capture_routing(model)
    try:
        with replay_routes(model, partial):
            model(tokens, pos, mask)
    finally:
        for h in handles:
            h.remove()
    rows = keep.T.reshape(-1)
    for layer in range(LAYERS):
        assert torch.equal(seen[layer][0][rows], as_map(rec.routes, layer)[rows])
        assert torch.equal(seen[layer][0][~rows], as_map(live.routes, layer)[~rows])


@pytest.mark.parametrize("granularity", ["full", "selective"])
def test_activation_recompute_gradients_equal_the_plain_run(granularity):
    recompute = {"recompute_granularity": granularity}
    if granularity == "full":
        recompute.update(recompute_method="uniform", recompute_num_layers=1)
    else:
        recompute.update(recompute_modules=["moe"])
    plain, ckpt = tiny_gpt(), tiny_gpt(**recompute)
    tokens, pos, mask, labels = batch(b=4, s=10)
    with record_routes(plain) as rec:
        plain(tokens, pos, mask)
    routes = rec.routes
    for model in (plain, ckpt):
        perturb_routers(model)  # so live routing differs from the routes: a recompute routing live would show
    with record_routes(ckpt) as live:
        ckpt(tokens, pos, mask, labels=labels).mean().backward()  # recomputes are not recorded twice
    assert live.routes.batch_size == 4 and len(live.batches) == 1
    assert expert_change(routes, live.routes).fraction > 0.05
    for model in (plain, ckpt):
        model.zero_grad(set_to_none=True)
        model.train()
        with replay_routes(model, routes):
            loss = model(tokens, pos, mask, labels=labels).mean()
            loss.backward()
    a, b = grads(plain), grads(ckpt)
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-7, msg=name)


def test_micro_batches_with_recompute_replay_their_own_routes_in_the_backward():
    # Two micro-batches forward, then both backward (a pipeline schedule). Under recompute, the backward of
    # micro-batch 0 must replay micro-batch 0's routes, not the last ones set for the forward of micro-batch 1.
    from megatron.core.transformer.moe.router_replay import RouterReplayAction

    plain, ckpt, micro, routes = recompute_pair()
    assert not routes[0].equal(routes[1])

    def run(model, context):
        model.zero_grad(set_to_none=True)
        with context:
            losses = [model(t, p, m, labels=y).mean() for t, p, m, y in micro]
            for loss in losses:
                loss.backward()
        return grads(model)

    want = run(plain, replay_routes(plain, routes))
    got = run(ckpt, replay_routes(ckpt, routes))
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-5, atol=1e-7, msg=name)

    # the trap this guards against: megatron's REPLAY_FORWARD left on while the backward recomputes
    ckpt.zero_grad(set_to_none=True)
    losses = []
    for (t, p, m, y), r in zip(micro, routes, strict=True):
        for rr, rows in zip((x.router_replay for x in routers(ckpt)), to_layer_rows(r), strict=True):
            rr.set_target_indices(rows)
            rr.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        losses.append(ckpt(t, p, m, labels=y).mean())
    for loss in losses:
        loss.backward()
    for rr in (x.router_replay for x in routers(ckpt)):
        rr.clear_indices()
        rr.clear_router_replay_action()
    wrong = grads(ckpt)
    assert any(not torch.allclose(wrong[n], want[n], rtol=1e-3, atol=1e-6) for n in want)

    with pytest.raises(ReplayError, match="routes were given for 2 forwards but forward 3 ran"):
        with torch.no_grad(), replay_routes(plain, routes):
            for t, p, m, _ in [*micro, micro[0]]:
                plain(t, p, m)


@pytest.mark.parametrize(
    "setting",
    [
        {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 1},  # layer 0 only
        {"recompute_granularity": "selective", "recompute_modules": ["moe"], "eval": True},  # runs in eval too
        {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1, "queued": True},
    ],
    ids=["block-partial", "selective-eval", "megatron-queue-not-empty"],
)
def test_recompute_variants_give_the_plain_gradients(setting):
    setting = dict(setting)
    eval_mode, queued = setting.pop("eval", False), setting.pop("queued", False)
    plain, ckpt = tiny_gpt(), tiny_gpt(**setting)
    tokens, pos, mask, labels = batch(b=3, s=10)
    with record_routes(plain) as rec:
        plain(tokens, pos, mask)
    stale = []
    if queued:  # rows somebody queued through megatron's own API before the context opened
        for rr in (r.router_replay for r in routers(ckpt)):
            rr.set_target_indices(torch.zeros(30, 2, dtype=torch.long))
            stale.append(list(rr.replay_backward_list))
    for model in (plain, ckpt):
        perturb_routers(model)
        model.zero_grad(set_to_none=True)
        model.train(not eval_mode)
        with replay_routes(model, rec.routes):
            model(tokens, pos, mask, labels=labels).mean().backward()
    a, b = grads(plain), grads(ckpt)
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-5, atol=1e-7, msg=name)
    if queued:
        assert [list(r.router_replay.replay_backward_list) for r in routers(ckpt)] == stale


def test_leaving_replay_with_recomputes_pending_is_an_error():
    model = tiny_gpt(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    tokens, pos, mask, labels = batch()
    with record_routes(model) as rec:
        model(tokens, pos, mask)
    model.train()
    with pytest.raises(ReplayError, match="call loss.backward\\(\\) inside"):
        with replay_routes(model, rec.routes):
            loss = model(tokens, pos, mask, labels=labels).mean()
    with torch.no_grad(), replay_routes(model, rec.routes):  # a no-grad forward is never recomputed: fine
        model(tokens, pos, mask)
    del loss


def test_global_state_is_left_as_found_and_models_do_not_share_routes():
    from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

    a, b = tiny_gpt(seed=0), tiny_gpt(seed=1)
    instances = list(RouterReplay.global_router_replay_instances)
    b_replay = [r.router_replay for r in routers(b)]
    for rr in b_replay:  # somebody else's replay state on model b
        rr.set_router_replay_action(RouterReplayAction.RECORD)
        rr.recorded_topk_idx = torch.zeros(1, 2, dtype=torch.long)
    tokens, pos, mask, labels = batch()
    with record_routes(a) as rec:
        a(tokens, pos, mask)
    with replay_routes(a, rec.routes):
        a(tokens, pos, mask, labels=labels).mean().backward()
    assert RouterReplay.global_router_replay_instances == instances
    for rr in b_replay:
        assert rr.router_replay_action is RouterReplayAction.RECORD
        assert torch.equal(rr.recorded_topk_idx, torch.zeros(1, 2, dtype=torch.long))
    for rr in (r.router_replay for r in routers(a)):
        assert rr.router_replay_action is None and rr.target_topk_idx is None and rr.replay_backward_list == []
        assert "get_replay_topk" not in rr.__dict__

    for rr in b_replay:
        rr.clear_router_replay_action()
    seen, handles = capture_routing(b)
    try:
        b(tokens, pos, mask)  # b's live routing
        perturb_routers(a, scale=3.0)
        with replay_routes(a, rec.routes):  # a replays; b, run inside a's context, still routes live
            b(tokens, pos, mask)
            a(tokens, pos, mask)
    finally:
        for h in handles:
            h.remove()
    assert all(torch.equal(calls[0], calls[1]) for calls in seen)
    assert not all(torch.equal(seen[i][0], as_map(rec.routes, i)) for i in range(LAYERS))  # b differs from a


def test_hooks_removed_on_exit_and_when_forward_raises():
    model = tiny_gpt()
    counts = [(len(r._forward_pre_hooks), len(r._forward_hooks)) for r in routers(model)]
    tokens, pos, mask, _ = batch()
    with record_routes(model) as rec:
        model(tokens, pos, mask)
    with pytest.raises(ReplayError, match="routes hold B=3 sequences of T=8 positions"):
        with replay_routes(model, rec.routes):
            model(tokens[:2], pos[:2], mask[:2])
    assert [(len(r._forward_pre_hooks), len(r._forward_hooks)) for r in routers(model)] == counts
    assert len(model._forward_hooks) == 0 and len(model._forward_pre_hooks) == 0
    for rr in (r.router_replay for r in routers(model)):  # the replay state is back as well
        assert rr.router_replay_action is None and rr.replay_backward_list == [] and rr.target_topk_idx is None
        assert not [k for k in rr.__dict__ if k == "get_replay_topk" or k.startswith("_moe_replay")]


def test_refusals_name_the_fix():
    tokens, pos, mask, _ = batch()
    with pytest.raises(ValueError, match="moe_enable_routing_replay=True"):
        record_routes(tiny_gpt(moe_enable_routing_replay=False)).__enter__()
    sinkhorn = tiny_gpt(moe_router_load_balancing_type="sinkhorn", moe_router_topk=1)
    with pytest.raises(ValueError, match="sinkhorn"):
        record_routes(sinkhorn).__enter__()
    fused = tiny_gpt()
    for r in routers(fused):
        r.config.moe_router_fusion = True  # TE is absent here, so build unfused and flip the flag
    with pytest.raises(ValueError, match="moe_router_fusion"):
        replay_routes(fused, Routes.__new__(Routes)).__enter__()
    model = tiny_gpt()
    routers(model)[0].config.hybrid_context_parallel = True
    with pytest.raises(ValueError, match="hybrid_context_parallel=True"):
        record_routes(model).__enter__()
    model = tiny_gpt()  # under pipeline parallelism a router outside the decoder's MoE layers (e.g. MTP) has no column
    routers(model)[0].config.pipeline_model_parallel_size = 2
    routers(model)[1].layer_number = LAYERS + 1
    with pytest.raises(ValueError, match="layer_number=3.* cannot be placed among the whole model's 2 MoE layers"):
        record_routes(model).__enter__()
    forced = tiny_gpt()
    routers(forced)[0].config.moe_router_force_load_balancing = True
    with pytest.raises(ValueError, match="moe_router_force_load_balancing"):
        record_routes(forced).__enter__()
    with pytest.raises(ValueError, match="no megatron-core MoE router"):
        record_routes(torch.nn.Linear(2, 2)).__enter__()
    for flip, field in (  # megatron-core 0.19's settings, flipped on a built model (0.16 has none of them)
        (lambda r: setattr(r, "routing_type", "quantile_balancing"), "quantile_balancing"),
        (lambda r: setattr(r.config, "moe_router_force_biased", 0.5), "moe_router_force_biased"),
    ):
        model = tiny_gpt()
        flip(routers(model)[1])
        with pytest.raises(ValueError, match=f"router 'decoder.layers.[01].mlp.router'.*{field}"):
            record_routes(model).__enter__()
    repeated = SimpleNamespace(config=SimpleNamespace(mtp_use_repeated_layer=True, mtp_num_layers=2))
    assert "mtp_use_repeated_layer" in refusal(repeated, "mtp.layers.0.transformer_layer.mlp.router")
    assert refusal(repeated, "decoder.layers.0.mlp.router") is None  # (the decoder's routers run once)
    repeated.config.mtp_num_layers = 1
    assert refusal(repeated, "mtp.layers.0.transformer_layer.mlp.router") is None

    model = tiny_gpt()
    with record_routes(model) as rec:
        model(tokens, pos, mask)
    with pytest.raises(RuntimeError, match="cannot nest"):
        with record_routes(model), replay_routes(model, rec.routes):
            pass
    other = Routes(rec.routes.indices, rec.routes.mask, [LayerInfo(x.name, 8, 2) for x in rec.routes.layers])
    with pytest.raises(ReplayError, match="E=8, K=2 but router 'decoder.layers.0.mlp.router' has E=4, K=2"):
        replay_routes(model, other).__enter__()
    with pytest.raises(ReplayError, match="never replayed"):
        with replay_routes(model, rec.routes):
            pass


def test_wrapped_model_contexts_do_not_nest_and_inner_forwards_are_refused():
    model = tiny_gpt()
    wrapper = torch.nn.ModuleDict({"module": model})
    wrapper.forward = lambda *a, **k: model(*a, **k)
    tokens, pos, mask, _ = batch()
    with record_routes(model) as rec:
        model(tokens, pos, mask)
    with pytest.raises(RuntimeError, match="cannot nest"):
        with replay_routes(wrapper, rec.routes), record_routes(model):
            pass
    with pytest.raises(ReplayError, match="outside a forward of the ModuleDict"):
        with replay_routes(wrapper, rec.routes):
            model(tokens, pos, mask)  # the inner module, not the one the context is on
    with replay_routes(wrapper, rec.routes):
        wrapper(tokens, pos, mask)


def test_unrecorded_positions_may_hold_any_value():
    model = tiny_gpt()
    tokens, pos, mask, _ = batch(b=2, s=6)
    with record_routes(model) as rec:
        logits = model(tokens, pos, mask)
    indices = rec.routes.indices.clone()
    keep = torch.ones(2, 6, dtype=torch.bool)
    keep[1, :2] = False
    indices[1, :2] = 255  # e.g. another engine's fill value for padding
    with replay_routes(model, Routes(indices, keep, rec.routes.layers)):
        assert torch.equal(model(tokens, pos, mask), logits)  # the padding routes live, as recorded


def test_routes_from_another_engine_match_by_layer_order():
    model = tiny_gpt()
    tokens, pos, mask, _ = batch()
    with record_routes(model) as rec:
        logits = model(tokens, pos, mask)
    renamed = Routes(
        rec.routes.indices, rec.routes.mask, [LayerInfo(f"model.layers.{i}.mlp.gate", EXPERTS, TOP_K) for i in (0, 1)]
    )
    perturb_routers(model)
    with replay_routes(model, renamed):
        replayed = model(tokens, pos, mask)
    with replay_routes(model, rec.routes):
        assert torch.equal(model(tokens, pos, mask), replayed)
    assert not torch.equal(replayed, logits)  # the perturbed router still weighs the experts


def test_megatron_routes_replay_on_a_hugging_face_model_by_layer_order():
    """The other direction: routes recorded on megatron-core force the experts of a Hugging Face model with the same
    number of MoE layers, E and K (layers.match_layers maps them by order; the names share nothing)."""
    from helpers import tiny_qwen3_moe

    model = tiny_gpt()
    tokens, pos, mask, _ = batch()
    with record_routes(model) as rec:
        model(tokens, pos, mask)
    hf = tiny_qwen3_moe(layers=LAYERS, experts=EXPERTS, top_k=TOP_K)
    with moe_replay.record_routes(hf) as live:
        hf(tokens)
    differ = rec.routes.indices.sort(-1).values != live.routes.indices.sort(-1).values
    assert differ.any(-1).float().mean() > 0.2  # two unrelated models route differently
    with moe_replay.replay_routes(hf, rec.routes), moe_replay.record_routes(hf) as used:
        hf(tokens)
    assert torch.equal(used.routes.indices, rec.routes.indices)


def test_routes_save_load_and_top_level_dispatch(tmp_path):
    model = tiny_gpt()
    tokens, pos, mask, _ = batch()
    with moe_replay.record_routes(model) as rec:
        assert isinstance(rec, MegatronRouteRecorder)
        model(tokens, pos, mask)
    path = tmp_path / "megatron.routes.safetensors"
    rec.routes.save(path)
    loaded = Routes.load(path)
    assert loaded.equal(rec.routes) and loaded.layers == rec.routes.layers
    assert expert_change(loaded, rec.routes).fraction == 0.0
    with moe_replay.replay_routes(model, loaded):
        model(tokens, pos, mask)
    assert [s.name for s in find_routers(model)] == loaded.layer_names


def test_missing_megatron_says_how_to_install(monkeypatch):
    from moe_replay.engines import megatron

    monkeypatch.setitem(sys.modules, "megatron.core.transformer.moe.router", None)
    with pytest.raises(ImportError, match=r"pip install 'moe-replay\[megatron\]'"):
        megatron.find_routers(torch.nn.Linear(2, 2))


def test_old_integrations_path_warns_and_gives_the_engine():
    from moe_replay.engines import megatron
    from moe_replay.integrations import megatron as old

    with pytest.warns(DeprecationWarning, match=r"moved to moe_replay\.engines\.megatron\.record_routes"):
        assert old.record_routes is megatron.record_routes
    with pytest.warns(DeprecationWarning), pytest.raises(AttributeError):
        old.no_such_name  # noqa: B018


def test_engine_routes_replay_on_megatron():
    """SGLang-encoded routes (one column per decoder layer, int32, base64) of a megatron recording, imported with the
    model's own routers naming the layers (decoder layer i -> column i), replay to the recorded logits."""
    import base64

    from moe_replay.integrations.sglang import routes_from_sglang

    model = tiny_gpt()
    tokens, pos, mask, _ = batch()
    with record_routes(model) as rec:
        logits = model(tokens, pos, mask)
    routes = rec.routes
    responses = [
        {
            "meta_info": {
                "prompt_tokens": routes.seq_len,
                "completion_tokens": 1,  # all S positions were inputs: S + 1 - 1 rows
                "routed_experts": base64.b64encode(routes.indices[i].numpy().astype("<i4").tobytes()).decode(),
            }
        }
        for i in range(routes.batch_size)
    ]
    imported = routes_from_sglang(responses, model, seq_len=routes.seq_len)  # (the trainer's batch: S, not S + 1)
    assert imported.layer_names == ["decoder.layers.0.mlp.router", "decoder.layers.1.mlp.router"]
    assert imported.equal(routes)
    with replay_routes(model, imported):
        assert torch.equal(model(tokens, pos, mask), logits)
    perturb_routers(model)
    with replay_routes(model, imported):
        from_engine = model(tokens, pos, mask)
    with replay_routes(model, routes):
        assert torch.equal(model(tokens, pos, mask), from_engine)
    assert not torch.equal(model(tokens, pos, mask), from_engine)  # live routing moved: the replay mattered


def moved_slots(a: Routes, b: Routes, layer: int) -> int:
    """Expert slots of `layer` in `a` not among `b`'s at the same (recorded) position."""
    x, y = a.indices[:, :, layer].long(), b.indices[:, :, layer].long()
    kept = (x[..., :, None] == y[..., None, :]).any(-1).sum(-1)  # [B, T]
    return int((x.shape[-1] - kept)[a.mask & b.mask].sum())


def test_track_live_counts_the_replayed_experts_live_routing_would_change():
    """Beside each replayed call, the live pick: 0 moved for a model's own routes; after perturbing the routers, the
    first layer's count equals a live recording's difference exactly (the same input); recomputes are not counted;
    unrecorded positions are not compared."""
    tokens, pos, mask, _ = batch()
    model = tiny_gpt()
    with moe_replay.record_routes(model) as rec:
        model(tokens, pos, mask)
    routes = rec.routes
    with moe_replay.replay_routes(model, routes, track_live=True) as ctx:
        model(tokens, pos, mask)
    moved, compared = ctx.live_moved()
    assert moved.tolist() == [0] * LAYERS and compared.tolist() == [tokens.numel()] * LAYERS
    perturb_routers(model)
    with moe_replay.record_routes(model) as live:
        model(tokens, pos, mask)
    expected = moved_slots(routes, live.routes, 0)
    assert expected > 0  # (the perturbation moves some of layer 0's experts)
    with moe_replay.replay_routes(model, routes, track_live=True) as ctx:
        model(tokens, pos, mask).sum().backward()
    moved, compared = ctx.live_moved()
    assert int(moved[0]) == expected and int(moved[1]) > 0 and compared.tolist() == [tokens.numel()] * LAYERS

    recompute = tiny_gpt(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    perturb_routers(recompute)
    with moe_replay.replay_routes(recompute, routes, track_live=True) as ctx:
        recompute(tokens, pos, mask).sum().backward()  # each router also runs in the backward: not counted
    assert [t.tolist() for t in ctx.live_moved()] == [moved.tolist(), compared.tolist()]

    part = Routes(routes.indices, routes.mask.clone(), routes.layers)
    part.mask[0] = False  # sequence 0 routes live: its tokens are not compared
    with moe_replay.replay_routes(model, part, track_live=True) as ctx:
        model(tokens, pos, mask)
    assert ctx.live_moved()[1].tolist() == [tokens.numel() - tokens.shape[1]] * LAYERS
    with pytest.raises(ValueError, match="needs replay_routes\\(model, routes, track_live=True\\)"):
        with moe_replay.replay_routes(model, routes) as ctx:
            model(tokens, pos, mask)
        ctx.live_moved()
