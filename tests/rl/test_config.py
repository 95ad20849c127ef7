"""TrainConfig validation at load, before any work: types, ranges, [policy] keys, TOML syntax errors (issue 44).

Each refusal is a ValueError whose message names the setting and the value as given.
"""

from __future__ import annotations

import glob
import importlib.util
import inspect
import math
import re
import sys
from pathlib import Path

import pandas as pd
import pytest
from rl_utils import SMALL

from moe_replay.rl.config import TrainConfig, load_config

ROOT = Path(__file__).resolve().parents[2]


def refused(kw: dict, *names: str) -> str:
    """TrainConfig(**kw)'s ValueError message, asserting it names each of `names`."""
    with pytest.raises(ValueError) as e:
        TrainConfig(**kw)
    message = str(e.value)
    for name in names:
        assert name in message, (name, message)
    return message


@pytest.mark.parametrize(
    "kw, names",
    [
        # found by issue 44: accepted, and every gradient negated (Adam then climbs the loss) / zeroed
        (dict(max_grad_norm=-1.0), ["max_grad_norm", "-1.0", "inf"]),
        (dict(max_grad_norm=0.0), ["max_grad_norm", "0.0"]),
        (dict(max_grad_norm=math.nan), ["max_grad_norm", "nan"]),
        # a token_mask between clip_min > clip_max zeroes every weight: nothing is ever updated
        (
            dict(sampler_correction="token_mask", sampler_correction_clip_min=2.0, sampler_correction_clip_max=0.5),
            ["sampler_correction_clip_min=2.0", "sampler_correction_clip_max=0.5"],
        ),
        # a negative bound negates the loss (truncated weights all equal to it) or zeroes every weight
        (
            dict(sampler_correction="token_truncate", sampler_correction_clip_max=-3.0),
            ["sampler_correction_clip_max", "-3.0"],
        ),
        (
            dict(sampler_correction="sequence_mask", sampler_correction_clip_min=-1.0),
            ["sampler_correction_clip_min", "-1.0"],
        ),
        # a mask band without 1 masks every token the sampler and the trainer agree on
        (dict(sampler_correction="token_mask", sampler_correction_clip_max=0.9), ["sampler_correction_clip_max=0.9"]),
    ],
)
def test_settings_that_train_backwards_or_not_at_all_are_refused(kw, names):
    refused(kw, *names)


@pytest.mark.parametrize(
    "kw, names",
    [
        (dict(lr="1e-4"), ["lr", "'1e-4'", "a number", "without quotes"]),  # a string where a number belongs
        (dict(seed="0"), ["seed", "'0'", "an int"]),
        (dict(steps=50.0), ["steps", "50.0", "an int", "write 50"]),  # a float where an int belongs (even integral)
        (dict(prompts=2.5), ["prompts", "2.5", "an int"]),
        (dict(partial_credit="false"), ["partial_credit", "'false'", "a bool", "without quotes"]),  # "false" string
        (dict(diagnostics=1), ["diagnostics", "1", "a bool"]),  # an int is no bool
        (dict(warm_start_steps=True), ["warm_start_steps", "True", "an int"]),  # nor a bool an int
        (dict(lr=True), ["lr", "True", "a number"]),
        (dict(epsilon_high="0.3"), ["epsilon_high", "'0.3'", "a number or None"]),
        (dict(init=3), ["init", "3", "a string or None"]),
        (dict(replay=None), ["replay", "None", "a string"]),
        (dict(policy=["num_experts", 8]), ["policy", "a table"]),
        (dict(policy={"num_experts": "16"}), ["policy.num_experts", "'16'", "an int"]),
        (dict(policy={"norm_topk_prob": "false"}), ["policy.norm_topk_prob", "'false'", "a bool"]),
        (dict(policy={"head_dim": 8.0}), ["policy.head_dim", "8.0", "an int"]),
    ],
)
def test_a_value_of_the_wrong_type_is_refused(kw, names):
    refused(kw, *names)


def test_an_int_is_a_float_and_inf_turns_gradient_clipping_off():
    cfg = TrainConfig(lr=1, warm_start_target=1, output=Path("runs/x"))
    assert cfg.lr == 1.0 and isinstance(cfg.lr, float) and isinstance(cfg.warm_start_target, float)
    assert TrainConfig(warm_start_target=None).warm_start_target is None  # (the warm start runs all its steps)
    assert cfg.output == "runs/x"  # (a path is stored as the string config.json can hold)
    assert TrainConfig(**TrainConfig(max_grad_norm=math.inf).to_dict()).max_grad_norm == math.inf
    refused(dict(max_grad_norm=None), "max_grad_norm", "None", "a number")


@pytest.mark.parametrize(
    "kw, names",
    [
        (dict(lr=0), ["lr", "0"]),
        (dict(lr=-1e-4), ["lr", "-0.0001"]),
        (dict(warm_start_lr=-3e-3), ["warm_start_lr", "-0.003"]),
        (dict(lr=math.inf), ["lr", "inf"]),
        (dict(router_scale=math.nan), ["router_scale", "nan"]),
        (dict(warm_start_target=0), ["warm_start_target", "0"]),
        (dict(warm_start_target=1.5), ["warm_start_target", "1.5"]),
        (dict(epsilon_low=-0.2), ["epsilon_low=-0.2"]),
        (dict(epsilon_high=-0.1), ["epsilon_high=-0.1"]),
        (dict(off_policy_mask_threshold=math.nan), ["off_policy_mask_threshold", "nan"]),
        (dict(group_size=1), ["group_size", "1"]),
        (dict(minibatches=0), ["minibatches=0"]),
        (dict(heldout_prompts=-1), ["heldout_prompts", "-1"]),
        (dict(eval_every=-2), ["eval_every", "-2"]),
        (dict(task_size=0), ["task_size=0"]),
        (dict(task="sorting"), ["task='sorting'"]),
        (dict(output=""), ["output", "''"]),
        (dict(seed=2**64), ["seed", str(2**64)]),
        (dict(replay="rollouts"), ["replay", "'rollouts'", "did you mean 'rollout'"]),
    ],
)
def test_a_value_out_of_range_is_refused(kw, names):
    refused(kw, *names)


def test_more_heldout_prompts_than_the_task_offers_are_refused_before_the_warm_start():
    """Found by issue 44: refused only by Task.heldout, after the warm start (minutes into the run)."""
    refused(dict(task_size=1, heldout_prompts=51), "heldout_prompts=51", "at most 50")
    refused(dict(task="sort", task_size=2, heldout_prompts=51), "heldout_prompts=51", "at most 50")
    assert TrainConfig(task_size=1, heldout_prompts=50).heldout_prompts == 50  # (what Task.heldout takes)


@pytest.mark.parametrize(
    "policy, names",
    [
        # found by issue 44: silently ignored, so a 16-expert policy trained
        ({"num_expert": 8}, ["'num_expert'", "did you mean 'num_experts'"]),
        ({"num_hidden_layer": 2}, ["'num_hidden_layer'", "did you mean 'num_hidden_layers'"]),
        ({"model_type": "mixtral", "num_local_expert": 8}, ["'num_local_expert'", "did you mean 'num_local_experts'"]),
        ({"model_type": "mixtrl"}, ["policy.model_type", "'mixtrl'", "did you mean 'mixtral'"]),
        ({"steps": 3}, ["'steps'", "a run setting", "[policy]"]),  # a TOML key written after the [policy] header
        ({"experts": 8}, ["policy.experts=8", "write num_experts = 8"]),  # tiny_moe: "given twice" at build time
        ({"vocab_size": 64}, ["policy.vocab_size=64", "set by the run"]),  # overwritten by build_policy, unsaid
        ({"num_experts": 0}, ["policy.num_experts", "0"]),
        ({"num_experts_per_tok": 20}, ["policy.num_experts_per_tok=20", "16 experts"]),
        ({"dense_layers": [4]}, ["policy.mlp_only_layers", "[4]"]),
        ({"router_std": -0.5}, ["policy.router_std", "-0.5"]),
        ({"router_aux_loss_coef": "0.01"}, ["policy.router_aux_loss_coef", "'0.01'"]),
    ],
)
def test_a_bad_policy_key_or_value_is_refused_with_the_nearest_valid_name(policy, names):
    refused(dict(policy=policy), *names)


def test_valid_policies_pass():
    """The model config's fields (and head_dim, which Qwen3-MoE reads with a default), the tiny-policy short names that
    do not repeat a default field, tiny_moe's own keywords, and another family's fields."""
    mixtral = {"model_type": "mixtral", "num_local_experts": 8, "num_experts_per_tok": 2, "head_dim": 8}
    for policy in (SMALL, {"dense_layers": [1], "router_std": 0.5, "experts_implementation": "eager"}, mixtral):
        assert TrainConfig(policy=policy).policy == policy


def test_toml_syntax_error_names_the_file_and_the_line(tmp_path):
    path = tmp_path / "bad.toml"
    path.write_text('steps = 5\nreplay = "rollout\nlr = 1e-4\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}, line 2, column 18: not valid TOML")):
        load_config(path)
    with pytest.raises(FileNotFoundError, match="missing.toml"):
        load_config(tmp_path / "missing.toml")


def test_load_config_names_the_file_and_the_nearest_key(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text("stpes = 3\n")
    with pytest.raises(ValueError, match=r"unknown settings \['stpes'\]; did you mean 'steps' for 'stpes'\?"):
        load_config(path)
    path.write_text("steps = 3\n[policy]\nnum_expert = 8\n")
    with pytest.raises(ValueError, match=f"{re.escape(str(path))}: policy: unknown .* did you mean 'num_experts'"):
        load_config(path)
    path.write_text('steps = "3"\n')
    with pytest.raises(ValueError, match=re.escape(f"{path}: steps must be an int, got '3' (a str)")):
        load_config(path)
    path.write_text("steps = 3\nmax_grad_norm = inf\n[policy]\nnum_experts = 8\n")  # TOML's inf: no clipping
    cfg = load_config(path)
    assert cfg.max_grad_norm == math.inf and cfg.policy == {"num_experts": 8}


@pytest.mark.parametrize("path", sorted(glob.glob(str(ROOT / "configs" / "*.toml"))))
def test_every_committed_config_loads(path):
    assert load_config(path).output.startswith("runs/")


def test_every_experiment_config_is_valid(monkeypatch, tmp_path):
    """Every TrainConfig the experiments' `run_all` makes (every preset) passes: `train` and the warm starts are
    stubbed, so nothing trains."""
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    made: list[TrainConfig] = []

    def fake_train(cfg: TrainConfig, **kw) -> Path:
        made.append(cfg)
        out = tmp_path / f"run{len(made)}"
        out.mkdir()
        pd.DataFrame({"step": [1], "reward_mean": [0.0]}).to_csv(out / "steps.csv", index=False)
        return out

    common = importlib.import_module("common")  # experiments/common.py: its `train_log` trains every run
    assert Path(common.__file__).parent == ROOT / "experiments", common.__file__
    monkeypatch.setattr(common, "train", fake_train)
    for name in ("compare", "long_answers", "mismatch", "stress", "sweep"):
        spec = importlib.util.spec_from_file_location(f"experiment_{name}", ROOT / "experiments" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, spec.name, module)
        spec.loader.exec_module(module)
        if hasattr(module, "warm_started"):
            monkeypatch.setattr(module, "warm_started", lambda *a, **k: tmp_path / "init")
        for preset in module.PRESETS:
            before = len(made)
            first = next(iter(inspect.signature(module.run_all).parameters))
            args = (list(module.SETTINGS), preset, tmp_path, False) if first == "names" else (preset, tmp_path, False)
            module.run_all(*args)
            assert len(made) > before, (name, preset)
