"""The RL loop's optimizer: routers at their own learning rate (a parameter group of the modules `find_routers`
finds) and a linear warmup over the first steps, logged per step and kept across a resume."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from rl_utils import config

from moe_replay import find_routers
from moe_replay.rl.loop import train
from moe_replay.rl.optim import ROUTERS, parameter_groups


def test_routers_take_their_own_rate_after_a_linear_warmup(tmp_path, init):
    out = train(config(tmp_path, init, steps=3, lr=1e-4, router_lr=1e-3, lr_warmup_steps=2), progress=False)
    steps = pd.read_csv(out / "steps.csv")
    # step s (1-based) runs at base x min(1, s / 2): half the rate first, then the whole rate
    assert steps["lr"].tolist() == pytest.approx([5e-5, 1e-4, 1e-4], rel=1e-12)
    assert steps["lr/routers"].tolist() == pytest.approx([5e-4, 1e-3, 1e-3], rel=1e-12)
    resumed = train(config(tmp_path, init, steps=4, lr=1e-4, router_lr=1e-3, lr_warmup_steps=2), progress=False)
    assert pd.read_csv(resumed / "steps.csv")["lr/routers"].tolist() == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3])


def test_the_router_group_holds_exactly_the_routers_parameters(tmp_path, init):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(init)
    groups = parameter_groups(model, config(tmp_path, init, router_lr=1e-3))
    routers = {id(p) for site in find_routers(model) for p in site.router.parameters()}
    (mine,) = [g for g in groups if g["name"] == ROUTERS]
    assert {id(p) for p in mine["params"]} == routers and mine["base_lr"] == 1e-3
    assert sum(len(g["params"]) for g in groups) == len(list(model.parameters()))
    (everything,) = parameter_groups(model, config(tmp_path, init))  # no router_lr: one group, as before
    assert len(everything["params"]) == len(list(model.parameters())) and everything["base_lr"] == 1e-4
    torch.optim.Adam(groups, lr=1e-4)  # (the groups are an optimizer's)


@pytest.mark.parametrize(
    "kw, match",
    [({"router_lr": 0.0}, "router_lr must be > 0"), ({"lr_warmup_steps": -1}, "lr_warmup_steps must be >= 0"),
     ({"lr_warmup_steps": 2.0}, "lr_warmup_steps must be an int")],
)  # fmt: skip
def test_bad_rates_are_refused(tmp_path, kw, match):
    with pytest.raises(ValueError, match=match):
        config(tmp_path, None, **kw)
