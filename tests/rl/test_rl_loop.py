"""The RL loop: every arm runs, runs are deterministic, a killed run resumes to the same log, the CLI works."""

from __future__ import annotations

import pandas as pd
import pytest
import torch
from helpers import near_ties
from rl_utils import RUN, SMALL, config, same_but_near_ties

from moe_replay import expert_change
from moe_replay.cli import main
from moe_replay.rl.config import TrainConfig, load_config
from moe_replay.rl.loop import initial_policy, train
from moe_replay.rl.policy import build_policy, sampled_reward, warm_start
from moe_replay.rl.step import answer_logp
from moe_replay.rl.tasks import Task


def steps_log(out) -> pd.DataFrame:
    return pd.read_csv(out / "steps.csv").drop(columns=["seconds", "seconds_rollout"])


def assert_mismatch_at_near_ties_only(logged, seen) -> None:  # noqa: ANN001
    """Each step's logged share of experts that differ between the sampled and the teacher-forced routes (`logged`,
    one per step) is the share `mismatch_seen` finds, and these differ at no (token, layer) pair but the
    teacher-forced forward's near-ties (and what follows one that came out otherwise: `same_but_near_ties`)."""
    assert len(logged) == len(seen)
    for value, step in zip(logged, seen, strict=True):
        same_but_near_ties(step["routes"], step["live"], step["near_ties"])
        assert value == pytest.approx(expert_change(step["routes"], step["live"]).fraction, abs=1e-12)


@pytest.mark.parametrize("level", ["token", "sequence", "sequence_token"])
@pytest.mark.parametrize("replay", ["off", "rollout", "old_logprob"])
def test_every_arm_runs_and_logs(tmp_path, init, replay, level, mismatch_seen):
    out = train(config(tmp_path, init, replay=replay, importance_sampling_level=level, steps=2), progress=False)
    log = pd.read_csv(out / "steps.csv")
    mb = pd.read_csv(out / "minibatches.csv")
    assert list(log.step) == [1, 2] and len(mb) == 4
    for col in (
        "reward_mean",
        "exact_match",
        "clip_ratio/region_mean",
        "ratio/max",
        "abs_log_ratio/p99",
        "expert_change",
        "mismatch/fraction",
        "grad_norm",
        "seconds",
    ):
        assert col in log.columns and log[col].notna().all(), col
    # fp32 sampler and trainer route identically (but where float noise may swap a near-tie's experts)
    assert_mismatch_at_near_ties_only(log["mismatch/fraction"], mismatch_seen)
    assert (mb.expert_change >= 0).all() and (mb.grad_norm > 0).all()


def test_replay_makes_the_first_minibatch_on_policy(tmp_path, init, mismatch_seen):
    """With rollout replay in fp32 the old log-probs and the first minibatch agree: every ratio is 1."""
    out = train(config(tmp_path, init, replay="rollout", steps=1), progress=False)
    minibatches = pd.read_csv(out / "minibatches.csv")
    first = minibatches.iloc[0]
    assert first["ratio/max"] == pytest.approx(1.0, abs=1e-5) and first["ratio/min"] == pytest.approx(1.0, abs=1e-5)
    # the model of the first minibatch routes exactly as sampled (but at near-ties); the next one trained after an
    # update
    assert_mismatch_at_near_ties_only([first["routes_moved_since_rollout"]], mismatch_seen)
    step = pd.read_csv(out / "steps.csv").iloc[0]
    assert step["routes_moved_since_rollout/last_minibatch"] == minibatches.iloc[-1]["routes_moved_since_rollout"]


def test_bf16_rollout_against_fp32_trainer(tmp_path, init):
    out = train(config(tmp_path, init, rollout_dtype="bfloat16", replay="rollout", steps=1), progress=False)
    log = pd.read_csv(out / "steps.csv")
    assert 0.0 <= log["mismatch/fraction"].item() < 0.5


def test_runs_are_deterministic_and_resume_to_the_same_log(tmp_path, init):
    a = steps_log(train(config(tmp_path / "a", init, steps=4), progress=False))
    b = steps_log(train(config(tmp_path / "b", init, steps=4), progress=False))
    pd.testing.assert_frame_equal(a, b)
    killed = config(tmp_path / "c", init, steps=4)
    train(killed, progress=False, stop_after=3)  # dies after step 3; its last checkpoint is step 2
    assert len(pd.read_csv(tmp_path / "c" / "run" / "steps.csv")) == 3
    resumed = steps_log(train(killed, progress=False))
    pd.testing.assert_frame_equal(resumed, a)
    mb_a = pd.read_csv(tmp_path / "a" / "run" / "minibatches.csv")
    mb_c = pd.read_csv(tmp_path / "c" / "run" / "minibatches.csv")
    pd.testing.assert_frame_equal(mb_a, mb_c)
    # found by review: a resume with other settings continued the old run under the new config.json, or wrote rows
    # of another width under the old header; only steps may change
    with pytest.raises(ValueError, match=r"started with seed=0 \(now 5\), replay='off' \(now 'rollout'\)"):
        train(config(tmp_path / "c", init, steps=5, seed=5, replay="rollout"), progress=False)
    assert '"seed": 0' in (tmp_path / "c" / "run" / "config.json").read_text()
    assert len(steps_log(train(config(tmp_path / "c", init, steps=5), progress=False))) == 5


def test_train_command_and_config_errors(tmp_path, init, capsys):
    path = tmp_path / "run.toml"
    path.write_text(
        f'output = "{tmp_path / "cli"}"\ninit = "{init}"\nsteps = 2\nprompts = 4\ngroup_size = 4\n'
        'minibatches = 2\ntask_size = 2\nreplay = "rollout"\n'
    )
    assert main(["train", "--config", str(path), "--quiet"]) == 0
    assert "2 steps, reward" in capsys.readouterr().out
    for argv, message in (  # bad input: a usage error naming it, exit status 2, no traceback
        (["train", "--config", str(tmp_path / "missing.toml")], "No such file or directory"),
        (["train", "--config", str(path), "--steps", "0"], "argument --steps: must be at least 1, got 0"),
        (["drift", init, "--batch", "0"], "argument --batch: must be at least 1, got 0"),
        (["drift", init, "--prompts", str(tmp_path / "missing.txt")], "No such file or directory"),
    ):
        with pytest.raises(SystemExit) as exit_:
            main(argv)
        assert exit_.value.code == 2 and message in capsys.readouterr().err
    path.write_text("stpes = 3\n")
    with pytest.raises(ValueError, match=r"unknown settings \['stpes'\]"):
        load_config(path)
    with pytest.raises(ValueError, match="replay must be one of"):
        TrainConfig(replay="yes")
    with pytest.raises(ValueError, match="minibatches=3 must divide"):
        TrainConfig(minibatches=3)


def test_warm_start_reaches_a_useful_reward():
    torch.manual_seed(0)
    task = Task("addition", 2)
    model = build_policy(SMALL, seed=1)
    before = sampled_reward(model, task, n=128)
    log = warm_start(model, task, steps=40, batch=64, seed=1)
    after = sampled_reward(model, task, n=128)
    assert log[-1]["loss"] < log[0]["loss"] and after > before + 0.1


def test_another_family_as_policy(tmp_path):
    """Any transformers MoE family works as the policy: a tiny Mixtral, warm-started by the run itself."""
    mixtral = {
        "model_type": "mixtral",
        "num_local_experts": 8,
        "num_experts_per_tok": 2,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "head_dim": 8,
    }
    cfg = config(tmp_path, None, policy=mixtral, warm_start_steps=5, steps=1, replay="rollout")
    out = train(cfg, progress=False)
    assert (out / "init" / "config.json").read_text().count('"mixtral"') == 1
    assert len(pd.read_csv(out / "steps.csv")) == 1


def test_router_scale_keeps_the_choice_and_sharpens_or_flattens_the_weights(tmp_path, init):
    from transformers import AutoModelForCausalLM

    from moe_replay import record_routes
    from moe_replay.rl.policy import scale_routers

    x = Task("addition", 2).sample(8, torch.Generator().manual_seed(0))[0]
    model = AutoModelForCausalLM.from_pretrained(init)
    before = [r.weight.clone() for r in (layer.mlp.gate for layer in model.model.layers)]
    with record_routes(model) as rec:
        logits = model(x, output_router_logits=True).router_logits
    scale_routers(model, 0.25)
    after = [layer.mlp.gate.weight for layer in model.model.layers]
    assert all(torch.equal(a, 0.25 * b) for a, b in zip(after, before, strict=True))  # a power of 2: exact
    with record_routes(model) as rec_scaled:
        model(x)
    # the top-k of scaled logits is the same choice (the softmax of 0.25 x logits may round a near-tie to a tie)
    assert torch.equal(rec_scaled.routes.mask, rec.routes.mask)
    same_but_near_ties(rec_scaled.routes, rec.routes, near_ties(logits, rec.routes.top_k, tuple(x.shape)))
    with pytest.raises(ValueError, match="router_scale must be > 0, got 0"):
        TrainConfig(router_scale=0)
    out = train(config(tmp_path, init, steps=1, router_scale=4.0), progress=False)
    assert pd.read_csv(out / "steps.csv").shape[0] == 1


def test_a_fresh_start_forgets_the_last_runs_checkpoint_and_a_resume_keeps_its_steps(tmp_path, init):
    """Found by review: a fresh start (`--fresh`) kept the old run's checkpoint, so a later resume of the new run,
    killed before its first checkpoint, continued the old one under the new config.json with no error; resuming
    with fewer steps than done relabelled the run; an equivalent spelling of the output was refused."""
    train(config(tmp_path, init, steps=2), progress=False)  # seed 0, checkpointed at step 2
    fresh = config(tmp_path, init, steps=3, seed=1, checkpoint_every=10)
    train(fresh, resume=False, progress=False, stop_after=1)  # killed before any checkpoint of its own
    resumed = steps_log(train(fresh, progress=False))
    whole = steps_log(train(config(tmp_path / "whole", init, steps=3, seed=1), progress=False))
    pd.testing.assert_frame_equal(resumed, whole)
    with pytest.raises(ValueError, match=r"holds a run of 3 steps; resuming it with steps=2"):
        train(config(tmp_path, init, steps=2, seed=1, checkpoint_every=10), progress=False)
    again = config(tmp_path, init, steps=3, seed=1, checkpoint_every=10, output=f"{tmp_path}/./run")
    pd.testing.assert_frame_equal(steps_log(train(again, progress=False)), whole)


def test_an_init_warm_started_with_other_settings_is_refused_or_made_again(tmp_path):
    """Found by review: an existing `init` was used whatever policy, seed or task the run asked for (a run's result
    then depended on which run made the shared init first). A shared one is refused naming the settings; a run's own
    (`<output>/init`) is warm-started again for a fresh start with other settings."""
    kw = dict(steps=1, policy=SMALL, warm_start_steps=3, **RUN)
    shared = str(tmp_path / "shared")
    train(TrainConfig(output=str(tmp_path / "a"), init=shared, **kw), progress=False)
    with pytest.raises(ValueError, match=r"init .*shared was warm-started with seed=0 \(now 1\)"):
        train(TrainConfig(output=str(tmp_path / "b"), init=shared, seed=1, **kw), progress=False)
    own = tmp_path / "c"
    train(TrainConfig(output=str(own), **kw), progress=False)
    train(TrainConfig(output=str(own), seed=1, **kw), resume=False, progress=False)
    assert '"seed": 1' in (own / "init" / "warm_start.json").read_text()


@pytest.mark.parametrize(
    "kw, message",
    [
        (dict(group_size=1), "group_size must be >= 2"),
        (dict(checkpoint_every=0), "checkpoint_every must be >= 1"),
        (dict(warm_start_steps=0), "warm_start_steps must be >= 1"),
        (dict(prompts=0), "prompts must be >= 1"),
        (dict(steps=0), "steps must be >= 1"),
        (dict(epsilon_low=1.5), r"needs 0 <= epsilon_low < 1"),
    ],
)
def test_settings_that_crashed_or_learned_nothing_are_refused_at_once(kw, message):
    """Found by review: these crashed mid-run (after the warm start) with a traceback, or trained on zero advantages."""
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kw)


def test_drift_on_a_device_this_machine_lacks_is_a_usage_error(init, capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(SystemExit) as exit_:
        main(["drift", init, "--device", "cuda"])
    assert exit_.value.code == 2 and "has no CUDA device" in capsys.readouterr().err


def test_an_observer_sees_each_minibatch_at_the_weights_it_trains_and_changes_nothing(tmp_path, init):
    """`train(observe=...)` is called before each minibatch update (the log-ratio it sees is 0 on the first, the
    rollout's weights, and not after an update), logs what it returns per minibatch and as the step's mean, and
    leaves the run as it was."""
    calls = []

    def observe(model, batch, j, idx):  # noqa: ANN001, ANN202
        model.eval()
        with torch.no_grad():
            ratio = answer_logp(model, batch.sequences[idx], batch.prompt_len) - batch.old_logp[idx]
        calls.append((j, len(idx)))
        return {"observed/abs_log_ratio": float(ratio.abs().max())}

    seen = train(config(tmp_path / "seen", init, steps=2), progress=False, observe=observe)
    assert calls == [(0, 8), (1, 8)] * 2  # 16 answers in 2 minibatches, 2 steps
    mb = pd.read_csv(seen / "minibatches.csv").set_index(["step", "minibatch"])["observed/abs_log_ratio"]
    assert (mb.xs(0, level="minibatch") < 1e-4).all() and (mb.xs(1, level="minibatch") > 1e-4).all()
    log = steps_log(seen)
    assert log["observed/abs_log_ratio"].tolist() == pytest.approx(mb.groupby(level="step").mean().tolist())
    plain = steps_log(train(config(tmp_path / "plain", init, steps=2), progress=False))
    pd.testing.assert_frame_equal(log.drop(columns=["observed/abs_log_ratio"]), plain)


def test_initial_policy_is_the_warm_start_a_run_then_reuses(tmp_path):
    cfg = TrainConfig(output=str(tmp_path / "run"), init=str(tmp_path / "init"), steps=1, policy=SMALL,
                      warm_start_steps=3, **RUN)  # fmt: skip
    model = initial_policy(cfg)
    assert (tmp_path / "init" / "warm_start.json").exists() and not (tmp_path / "run").exists()
    made = (tmp_path / "init" / "model.safetensors").stat().st_mtime_ns
    train(cfg, progress=False)  # starts from it: not warm-started again
    assert (tmp_path / "init" / "model.safetensors").stat().st_mtime_ns == made
    again = initial_policy(cfg)
    for a, b in zip(model.parameters(), again.parameters(), strict=True):
        assert torch.equal(a, b)
