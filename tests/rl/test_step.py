"""The public RL step: `rollout` picks the routes to replay per mode, `minibatch_update` trains under them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from rl_utils import SMALL, routed_live

from moe_replay.rl import Rollout, Task, build_policy, minibatch_update, rollout

TASK = Task("addition", 2)


@pytest.fixture(scope="module")
def policy():
    return build_policy(SMALL, seed=0)


def sampled(policy, replay: str) -> Rollout:
    """4 prompts x 2 answers, the same ones for every mode (sampling seeded)."""
    prompts, answers = TASK.sample(4, torch.Generator().manual_seed(0))
    torch.manual_seed(0)
    return rollout(policy, TASK, prompts, answers, group_size=2, replay=replay)


@pytest.mark.parametrize("replay", ["off", "rollout", "old_logprob"])
def test_rollout_shapes_and_the_routes_each_mode_replays(policy, replay):
    batch = sampled(policy, replay)
    n, tp, a = 8, TASK.prompt_len, TASK.answer_len
    assert len(batch) == n and batch.prompt_len == tp and batch.sequences.shape == (n, tp + a)
    assert batch.old_logp.shape == batch.mask.shape == (n, a) and batch.mask.all()
    assert batch.rewards.shape == batch.exact.shape == batch.advantages.shape == (n,)
    assert tuple(batch.routes.shape[:2]) == (n, tp + a)
    if replay == "off":
        assert batch.train_routes is None
    elif replay == "rollout":
        assert batch.train_routes is batch.routes
    else:  # recorded in the teacher-forced old-log-prob forward, which (unlike sampling) also feeds the last token
        assert batch.train_routes.mask.all() and not batch.routes.mask[:, -1].any()
    # fp32 sampler and trainer: every mode computes the same old log-probs (rollout: replaying generate's routes,
    # which hold the live experts but where float noise swapped a near-tie's, and then at the answer tokens after it)
    live = sampled(policy, "off").old_logp
    same = routed_live(policy, batch.sequences, batch.routes, tp) if replay == "rollout" else batch.mask
    assert same.any() and torch.equal(batch.old_logp[same], live[same])


def test_minibatch_update_replays_and_its_first_ratio_is_one(policy):
    """Right after the rollout the trained policy is π_old: every ratio is exactly 1 under rollout replay."""
    model = build_policy(SMALL, seed=0)
    model.load_state_dict(policy.state_dict())
    batch = dataclasses.replace(sampled(model, "rollout"), advantages=torch.tensor([1.0, -1.0] * 4))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    idx = torch.arange(4)
    before = [p.clone() for p in model.parameters()]
    m = minibatch_update(model, opt, batch, idx, max_grad_norm=1.0)
    assert m["ratio/min"] == pytest.approx(1.0, abs=1e-5) == m["ratio/max"] and m["grad_norm"] > 0
    assert {"loss", "grad_norm", "clip_ratio/region_mean", "abs_log_ratio/p99"} <= set(m)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert all(p.grad is None for p in model.parameters())  # zero_grad(set_to_none=True)
    with pytest.raises(ValueError, match="replay must be one of"):
        rollout(model, TASK, *TASK.sample(1, torch.Generator()), group_size=2, replay="yes")
