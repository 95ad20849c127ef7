"""The sampler that differs from the trainer only in routing (`rollout_selection_noise`): its gating weights and
logits are the trainer's, its choices are noisy, the recorder sees the choices it made under `generate`, replaying
them (R3) gives the sampler's log-probs exactly, and bad settings are refused."""

from __future__ import annotations

import copy

import pandas as pd
import pytest
import torch
from rl_utils import SMALL, config

from moe_replay import expert_change, record_routes, teacher_forced_routes
from moe_replay.rl.config import TrainConfig
from moe_replay.rl.loop import train
from moe_replay.rl.policy import build_policy
from moe_replay.rl.route_noise import add_selection_noise
from moe_replay.rl.sampler import make_sampler
from moe_replay.rl.step import rollout
from moe_replay.rl.tasks import Task

TASK = Task("addition", 2)


def _router_outputs(model: torch.nn.Module, ids: torch.Tensor) -> list[tuple[torch.Tensor, ...]]:
    out: list[tuple[torch.Tensor, ...]] = []
    hooks = [m.mlp.gate.register_forward_hook(lambda _m, _a, o: out.append(o)) for m in model.model.layers]
    try:
        model(ids)
    finally:
        for h in hooks:
            h.remove()
    return out


@pytest.mark.parametrize("norm", [False, True])
def test_noise_moves_choices_only(norm):
    model = build_policy({**SMALL, "norm_topk_prob": norm}, seed=0).eval()
    noisy = add_selection_noise(copy.deepcopy(model), 0.5, torch.Generator().manual_seed(0))
    h = torch.randn(64, SMALL["hidden_size"], generator=torch.Generator().manual_seed(0))
    moved = 0
    for plain, perturbed in zip(model.model.layers, noisy.model.layers, strict=True):
        logits, _, idx = plain.mlp.gate(h)
        n_logits, n_weights, n_idx = perturbed.mlp.gate(h)
        assert torch.equal(logits, n_logits)  # the aux loss's logits are unperturbed
        probs = torch.softmax(logits.float(), -1).gather(-1, n_idx)
        if norm:
            probs = probs / probs.sum(-1, keepdim=True)
        torch.testing.assert_close(n_weights, probs, rtol=0, atol=0)  # the trainer's weights at the chosen experts
        moved += int((n_idx.sort(-1).values != idx.sort(-1).values).any(-1).sum())
    assert moved > 0
    zero = add_selection_noise(copy.deepcopy(model), 0.0, torch.Generator())
    for plain, same in zip(model.model.layers, zero.model.layers, strict=True):
        assert all(torch.equal(x, y) for x, y in zip(plain.mlp.gate(h), same.mlp.gate(h), strict=True))


def test_recorded_choices_are_the_noisy_ones_and_replay_removes_the_mismatch():
    model = build_policy(SMALL, seed=0).eval()
    sampler = make_sampler(model, selection_noise=0.3, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    batch = rollout(model, TASK, *TASK.sample(4, torch.Generator().manual_seed(0)), group_size=4, sampler=sampler,
                    replay="rollout", old_logprob_source="sampler")  # fmt: skip
    live = teacher_forced_routes(model, batch.sequences)
    assert expert_change(batch.routes, live).fraction > 0.05  # the sampler routed differently
    # R3: the trainer replaying the sampler's routes has the sampler's log-probs (weights recomputed live = exact)
    torch.testing.assert_close(batch.trainer_logp, batch.sampler_logp, rtol=0, atol=1e-5)
    plain = rollout(model, TASK, *TASK.sample(4, torch.Generator().manual_seed(0)), group_size=4, sampler=sampler)
    assert (plain.trainer_logp - plain.sampler_logp).abs().max() > 1e-3  # without replay it does not
    # the recorder sees exactly the choices the noisy forward made
    with record_routes(sampler) as rec:
        outputs = _router_outputs(sampler, batch.sequences)
    recorded = rec.routes.indices.sort(-1).values  # [N, T, L, K]
    for layer, (_, _, idx) in enumerate(outputs):
        assert torch.equal(recorded[:, :, layer].reshape(-1, idx.shape[-1]), idx.sort(-1).values)


def test_the_loop_logs_the_mismatch_and_settings_are_checked(tmp_path, init):
    cfg = config(tmp_path, init, steps=1, rollout_selection_noise=0.3, replay="rollout", old_logprob_source="sampler")
    log = pd.read_csv(train(cfg, progress=False) / "steps.csv").iloc[0]
    assert log["mismatch/fraction"] > 0.05 and log["sampler/kl_k3"] < 1e-6  # R3 aligned the trainer
    for bad in (-0.1, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="rollout_selection_noise must be a finite std >= 0"):
            TrainConfig(rollout_selection_noise=bad)
    with pytest.raises(ValueError, match="perturbs Qwen3-MoE's router .* not 'mixtral'"):
        TrainConfig(rollout_selection_noise=0.1, policy={"model_type": "mixtral"})
    from moe_replay.tiny import tiny_moe

    small = dict(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2)
    mixtral = tiny_moe(0, model_type="mixtral", num_key_value_heads=1, num_local_experts=4, **small)
    with pytest.raises(ValueError, match="supports Qwen3MoeTopKRouter .* got MixtralTopKRouter"):
        add_selection_noise(mixtral, 0.1, torch.Generator())
