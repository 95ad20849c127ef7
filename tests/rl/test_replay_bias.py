"""Why replay can hurt, measured inside a minibatch update: the replayed policy against the live one at the same
weights, the router gradient with and without replay (against a separate live backward), `replay_max_age`, and
that none of it changes the update."""

from __future__ import annotations

import copy
import dataclasses

import pandas as pd
import pytest
import torch
from rl_utils import SMALL, config, live_routes, same_but_near_ties

from moe_replay import Routes
from moe_replay.rl.config import TrainConfig
from moe_replay.rl.loop import train
from moe_replay.rl.losses import policy_loss
from moe_replay.rl.policy import build_policy
from moe_replay.rl.replay_bias import router_parameters
from moe_replay.rl.step import answer_logp, minibatch_update, rollout
from moe_replay.rl.tasks import Task

TASK = Task("addition", 2)


def _batch(model: torch.nn.Module, replay: str = "rollout"):
    torch.manual_seed(0)
    return rollout(model, TASK, *TASK.sample(4, torch.Generator().manual_seed(0)), group_size=4, replay=replay)


def _update(model, batch, **kw):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return minibatch_update(model, opt, batch, live_counterfactual=True, **kw)


def test_at_the_recorded_weights_replay_is_the_live_policy():
    """Routes sampled under generate hold the live experts but at near-ties, where float noise may swap them: taken
    there (and after a swapped one: `same_but_near_ties`) from the teacher-forced forward, replaying them is the live
    policy exactly."""
    model = build_policy(SMALL, seed=0)
    batch = _batch(model)
    live, ties = live_routes(model, batch.sequences)
    compared = same_but_near_ties(batch.routes, live, ties)
    sampled = batch.routes
    routes = Routes(torch.where(compared[..., None], sampled.indices, live.indices), sampled.mask, sampled.layers)
    m = _update(model, dataclasses.replace(batch, routes=routes, train_routes=routes), router_gradient=True)
    assert m["replay_bias/kl_k3"] == 0.0 and m["replay_bias/abs_log_ratio_mean"] == 0.0  # (replay is bit-exact)
    assert m["router/grad_cosine_live"] == pytest.approx(1.0, abs=1e-6)
    assert m["router/grad_norm_live"] == pytest.approx(m["router/grad_norm"], rel=1e-5) and m["router/grad_norm"] > 0


def test_moved_routers_give_a_bias_and_the_live_gradient_is_a_live_backward():
    model = build_policy(SMALL, seed=0)
    batch = _batch(model)
    with torch.no_grad():
        for p in router_parameters(model):
            p.add_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)) * 0.5)
    reference = copy.deepcopy(model).train()  # the live-routed loss's router gradient, by hand
    loss, _ = policy_loss(answer_logp(reference, batch.sequences, batch.prompt_len), batch.old_logp,
                          batch.advantages, batch.mask)  # fmt: skip
    loss.backward()
    by_hand = torch.cat([p.grad.reshape(-1) for p in router_parameters(reference)])
    before = copy.deepcopy(model)
    m = _update(model, batch, router_gradient=True)
    assert m["replay_bias/kl_k3"] > 0 and m["replay_bias/abs_log_ratio_mean"] > 1e-3
    assert m["router/grad_norm_live"] == pytest.approx(float(by_hand.norm()), rel=1e-5)
    assert m["router/grad_cosine_live"] < 0.999
    # the check leaves the update as it was
    _update(before, batch, router_gradient=False)
    for a, b in zip(model.parameters(), before.parameters(), strict=True):
        assert torch.equal(a, b)


def test_replay_max_age_routes_later_minibatches_live(tmp_path, init):
    out = train(config(tmp_path, init, steps=1, minibatches=2, replay="rollout", replay_max_age=1), progress=False)
    mb = pd.read_csv(out / "minibatches.csv")
    assert mb.loc[0, "replay_bias/kl_k3"] >= 0 and pd.isna(mb.loc[1, "replay_bias/kl_k3"])  # minibatch 1: live
    step = pd.read_csv(out / "steps.csv").iloc[0]
    assert step["replay_bias/kl_k3"] == pytest.approx(mb.loc[0, "replay_bias/kl_k3"])  # (the mean of those it has)
    live = train(config(tmp_path / "live", init, steps=1, minibatches=2), progress=False)
    aged = train(config(tmp_path / "aged", init, steps=1, minibatches=2, replay="rollout", replay_max_age=2),
                 progress=False)  # fmt: skip
    assert pd.read_csv(aged / "minibatches.csv")["replay_bias/kl_k3"].notna().all()
    assert "replay_bias/kl_k3" not in pd.read_csv(live / "minibatches.csv")
    with pytest.raises(ValueError, match="replay_max_age=1 needs replay on"):
        TrainConfig(replay_max_age=1)
    for bad in (1.5, "2", True):
        with pytest.raises(ValueError, match="replay_max_age must be an int"):
            TrainConfig(replay="rollout", replay_max_age=bad)
