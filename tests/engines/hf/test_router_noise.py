"""Training-mode router noise (DBRX input jitter, PhiMoE jitter and Gumbel sampling) must not defeat replay."""

from __future__ import annotations

import pytest
import torch
from families import tiny_config
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
