"""Training-mode router noise (DBRX input jitter, PhiMoE jitter and Gumbel sampling) must not defeat replay."""

from __future__ import annotations

import pytest
import torch
from families import router_modules, tiny_config
from helpers import perturb
from transformers import AutoModelForCausalLM

from moe_replay import record_routes, replay_routes


def noisy(family: str):
    torch.manual_seed(0)
    cfg = tiny_config(family)
    if family == "dbrx":
        cfg.ffn_config.moe_jitter_eps = 0.5
    else:
        cfg.input_jitter_noise, cfg.router_jitter_noise = 0.5, 0.5
    model = AutoModelForCausalLM.from_config(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("router.layer.weight", "router.weight")):
                p.normal_(0, 0.5)
    return model


@pytest.mark.parametrize("family", ["dbrx", "phimoe"])
def test_noise_is_active_in_training_but_replay_holds(family):
    model = noisy(family)
    ids = torch.randint(5, 100, (4, 10), generator=torch.Generator().manual_seed(1))
    with record_routes(model) as rec:  # eval: no noise
        model(ids)
    routes = rec.routes
    model.train()
    live = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        with record_routes(model) as r:
            model(ids)
        live.append(r.routes)
    # the noise is real: two training-mode forwards route some tokens differently
    assert not live[0].equal(live[1])
    for seed in (1, 2):
        torch.manual_seed(seed)
        with replay_routes(model, routes), record_routes(model) as used:
            model(ids, labels=ids).loss.backward()
        assert used.routes.equal(routes)  # every forward used exactly the recorded experts


def test_phimoe_in_training_replays_its_own_routes_bit_for_bit_and_keeps_moved_picks_selectable():
    """PhiMoE in training samples its picks (Gumbel) below a threshold `max` that is the top score, not the pick:
    replay forces the picks and keeps that threshold live, so a training forward replaying its own routes gives the
    same logits (found by review: the threshold was forced to the pick's score, moving the band of experts that
    survive, 2.8e-3 off with jitter 0.01 and 16 experts). After the router moves, a recorded pick the live band
    would mask out keeps its score as the threshold: its routing weight stays above zero."""
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("phimoe", num_experts=16), dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("router.weight"):
                p.normal_(0, 0.5)
    weights = []
    for _, router in router_modules(model, "phimoe"):
        router.register_forward_hook(lambda m, a, out: weights.append(out[1].detach()))
    ids = torch.randint(5, 100, (16, 32), generator=torch.Generator().manual_seed(1))
    model.train()
    torch.manual_seed(7)
    with record_routes(model) as rec:
        expected = model(ids).logits
    torch.manual_seed(7)
    with replay_routes(model, rec.routes):
        assert torch.equal(model(ids).logits, expected)
    perturb(model, scale=2.0)
    weights.clear()
    with torch.no_grad(), replay_routes(model, rec.routes), record_routes(model) as used:
        model(ids)
    assert used.routes.equal(rec.routes) and all(bool((w > 0).all()) for w in weights)
