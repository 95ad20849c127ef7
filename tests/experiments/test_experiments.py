"""Smoke tests: every experiment script's `--preset quick` runs on a fresh checkout and writes well-formed outputs
(not claims) into tmp_path, never into the committed experiments/results."""

from __future__ import annotations

import json
import math
import os
import runpy
import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg
import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_quick(script: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch | None = None) -> Path:
    """Run `experiments/<script> --preset quick` writing into tmp_path; returns the output folder. With `monkeypatch`
    the script runs in this process as `__main__` (what `python <script>` runs, without another interpreter start-up
    and torch import: seconds per script), else as a subprocess."""
    args = ["--preset", "quick", "--quiet", "--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs")]
    if monkeypatch is None:
        cmd = [sys.executable, str(ROOT / "experiments" / script), *args]
        # one OpenMP thread, as in the test process: two spinning threads on a busy 2-core machine stall for minutes
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
        assert done.returncode == 0, done.stderr[-2000:]
    else:
        monkeypatch.chdir(ROOT)
        monkeypatch.syspath_prepend(str(ROOT / "experiments"))
        monkeypatch.setattr(sys, "argv", [script, *args])
        runpy.run_path(str(ROOT / "experiments" / script), run_name="__main__")
    return tmp_path / "out"


def assert_figure(path: Path, height: int, width: int) -> None:
    """The PNG at `path` is more than `height` x `width` pixels."""
    shape = mpimg.imread(path).shape
    assert shape[0] > height and shape[1] > width, (path, shape)


@pytest.mark.slow  # (opt in: python -m pytest -m slow; .ci/run runs them)
def test_compare_quick_preset(tmp_path):
    run_quick("compare.py", tmp_path)
    steps = pd.read_csv(tmp_path / "out" / "compare_steps.csv")
    assert set(steps.arm) == {"GRPO", "GRPO + replay", "GSPO", "GSPO + replay"}
    assert steps.groupby("arm").step.max().eq(4).all() and steps.reward_mean.between(0, 1).all()
    summary = pd.read_csv(tmp_path / "out" / "compare_summary.csv")
    assert len(summary) == 4 and summary.final_reward_mean.between(0, 1).all()
    # GSPO clips whole answers at ε 3e-4 / 4e-4: far more tokens than GRPO's token-level clip at 0.2 / 0.27
    grpo, gspo = (summary.set_index("arm").loc[a, "clipped_tokens"] for a in ("GRPO", "GSPO"))
    assert gspo > grpo
    assert_figure(tmp_path / "out" / "compare.png", 500, 800)


@pytest.mark.slow  # (opt in: python -m pytest -m slow; .ci/run runs them)
def test_sweep_quick_preset(tmp_path, monkeypatch):
    run_quick("sweep.py", tmp_path, monkeypatch)
    steps = pd.read_csv(tmp_path / "out" / "sweep_steps.csv")
    assert set(steps.setting) == {"base", "bf16"} and set(steps.arm) == {"GRPO", "GRPO + replay"}
    summary = pd.read_csv(tmp_path / "out" / "sweep_summary.csv").set_index("setting")
    # an fp32 sampler routes like the fp32 trainer but where float noise between generate and a full forward swaps a
    # near-tie (a machine-dependent handful of pairs at most: ~1e-4 each; a misaligned batch would be ~0.5)
    assert summary.loc["base", "mismatch"] < 0.01
    assert summary.loc["bf16", "mismatch"] > 0.0  # a bf16 sampler does not
    assert (tmp_path / "out" / "sweep.png").stat().st_size > 10_000


def test_expert_change_quick_preset(tmp_path, monkeypatch):
    out = run_quick("expert_change.py", tmp_path, monkeypatch)
    frame = pd.read_csv(out / "expert_change.csv")
    assert list(frame.columns) == [
        "variant", "layers", "experts", "top_k", "seed", "lr", "update", "layer", "layer_name", "fraction",
    ]  # fmt: skip
    # 2 variants (2 and 4 MoE layers) x 2 learning rates x 2 updates, one row per layer
    assert len(frame) == (2 + 4) * 2 * 2 and frame.fraction.between(0, 1).all()
    summary = pd.read_csv(out / "expert_change_summary.csv")
    assert len(summary) == 4 and summary.first_mean.between(0, 100).all() and summary.later_mean.notna().all()
    for name in ("expert_change_lr.png", "expert_change_layers.png"):
        assert_figure(out / name, 300, 500)
    assert (tmp_path / "runs" / "init_L4_E16_k2_w10_seed0" / "config.json").exists()  # the warm start, cached


def test_mechanism_quick_preset(tmp_path, monkeypatch):
    """Runs without --init on a fresh checkout: the warm start is made under --runs."""
    out = run_quick("mechanism.py", tmp_path, monkeypatch)
    frame = pd.read_csv(out / "mechanism.csv")
    assert list(frame.columns) == [
        "lr", "seed", "step", "minibatch", "view", "var_log_ratio", "p99_abs_log_ratio", "outside_clip",
        "experts_changed",
    ]  # fmt: skip
    # minibatches 2..4 of one step, each seen routed live and replayed
    assert sorted(frame.minibatch.unique()) == [1, 2, 3] and len(frame) == 6
    assert set(frame.view) == {"live routing", "routing replay"}
    assert frame.outside_clip.between(0, 1).all() and frame.experts_changed.between(0, 1).all()
    assert (frame.var_log_ratio >= 0).all()
    assert_figure(out / "mechanism.png", 300, 800)


@pytest.mark.slow  # (opt in: python -m pytest -m slow; .ci/run runs them)
def test_mismatch_quick_preset(tmp_path, monkeypatch):
    run_quick("mismatch.py", tmp_path, monkeypatch)
    steps = pd.read_csv(tmp_path / "out" / "mismatch_steps.csv")
    assert steps.arm.nunique() == 10 and set(steps.source) == {"trainer", "sampler"}
    assert steps["eval/sampled/reward"].between(0, 1).all() and (steps["mismatch/fraction"] > 0).all()
    summary = pd.read_csv(tmp_path / "out" / "mismatch_summary.csv")
    by_arm = summary.set_index("arm")  # (a baseline has no gap to itself: NaN)
    assert len(summary) == 10 and pd.isna(by_arm.loc["GRPO, π_old sampler", "gap_to_grpo_mean"])
    assert by_arm.loc["GRPO + R3, π_old sampler", "gap_to_grpo_seeds_ahead"] in {"0/1", "1/1"}
    assert_figure(tmp_path / "out" / "mismatch.png", 300, 800)


@pytest.mark.slow  # (opt in: python -m pytest -m slow; .ci/run runs them)
def test_stress_quick_preset(tmp_path, monkeypatch):
    run_quick("stress.py", tmp_path, monkeypatch)
    steps = pd.read_csv(tmp_path / "out" / "stress_steps.csv")
    assert set(steps.setting) == {"stress", "stress − lr 1e-3"}
    assert set(steps[steps.setting == "stress"].arm) == {"GRPO", "GRPO + R3", "GRPO + R2"}
    assert set(steps[steps.setting != "stress"].arm) == {"GRPO", "GRPO + R3"}  # R2 only where everything is on
    summary = pd.read_csv(tmp_path / "out" / "stress_summary.csv").set_index(["setting", "arm"])
    assert len(summary) == 5 and pd.isna(summary.loc[("stress", "GRPO"), "gap_to_grpo_mean"])
    # the full stress has the bf16 sampler, so a sampler/trainer routing mismatch in every step
    assert steps[steps.setting == "stress"]["mismatch/fraction"].gt(0).all()
    # replayed arms log the live counterfactual clip fraction; GRPO has no replayed routes to compare with
    assert summary.loc[("stress", "GRPO + R3"), "clipped_live_counterfactual"] >= 0
    assert_figure(tmp_path / "out" / "stress.png", 300, 500)


@pytest.mark.slow  # (opt in: python -m pytest -m slow; .ci/run runs them)
def test_scaling_quick_preset(tmp_path, monkeypatch):
    out = run_quick("scaling.py", tmp_path, monkeypatch)
    steps = pd.read_csv(out / "scaling_steps.csv")
    assert set(steps.setting) == {"base", "8 layers"} and set(steps.minibatch) == {1}  # μ 2: one off-policy minibatch
    assert (steps.var_live >= 0).all() and steps.kl_update.ge(0).all() and steps.lr.gt(0).all()
    assert steps.experts_changed.between(0, 1).all() and steps.clip_live.between(0, 1).all()
    summary = pd.read_csv(out / "scaling_summary.csv").set_index("setting")
    assert list(summary.index) == ["base", "8 layers"] and summary.layers.tolist() == [4, 8]
    # two depths fit a line exactly: its prediction at 48 layers is where the line through both points goes
    fit = pd.read_csv(out / "scaling_fit.csv").set_index(["metric", "target"]).estimate
    a, b = summary.share_var_mean
    assert fit[("log-ratio variance", "48 layers, 16 experts, top-2")] == pytest.approx(a + (b - a) * math.log2(12))
    assert (tmp_path / "runs" / "warm_starts" / "init_L8_E16_k2_w10_seed0" / "config.json").exists()
    assert mpimg.imread(out / "scaling.png").shape[1] > 1000


@pytest.mark.slow  # (opt in: python -m pytest -m slow; .ci/run runs them)
def test_long_answers_quick_preset(tmp_path, monkeypatch):
    out = run_quick("long_answers.py", tmp_path, monkeypatch)
    steps = pd.read_csv(out / "long_answers_steps.csv")
    assert set(steps.answer_len) == {4, 16} and set(steps.arm) == {"GRPO", "GRPO + R2", "GSPO"}
    summary = pd.read_csv(out / "long_answers_summary.csv").set_index(["answer_len", "arm"])
    assert len(summary) == 6 and summary.loc[(slice(None), "GRPO"), "gap_to_grpo_mean"].isna().all()
    assert summary.heldout_reward_mean.between(0, 1).all() and summary.clipped_mean.between(0, 1).all()
    assert (tmp_path / "runs" / "init_pair_sum16_seed0" / "config.json").exists()  # one warm start per length
    assert mpimg.imread(out / "long_answers.png").shape[1] > 1000


def test_decisive_quick_preset(tmp_path, monkeypatch):
    out = run_quick("decisive.py", tmp_path, monkeypatch)
    steps = pd.read_csv(out / "decisive_steps.csv")
    assert set(steps.arm) == {"GRPO", "GRPO + R2", "GSPO"} and steps["eval/sampled/reward"].between(0, 1).all()
    summary = pd.read_csv(out / "decisive_summary.csv").set_index("arm")
    assert pd.isna(summary.loc["GRPO", "gap_to_grpo_mean"])  # (the baseline has no gap to itself)
    assert summary.loc["GRPO + R2", "gap_to_grpo_seeds_ahead"] in {"0/1", "1/1"}
    assert mpimg.imread(out / "decisive.png").shape[1] > 1000
    # sharded runs leave the collecting to a run without --shard
    monkeypatch.setattr(sys, "argv", ["decisive.py", "--preset", "quick", "--quiet", "--shard", "1/2",
                                      "--out", str(tmp_path / "shard"), "--runs", str(tmp_path / "runs")])  # fmt: skip
    runpy.run_path(str(ROOT / "experiments" / "decisive.py"), run_name="__main__")
    assert not (tmp_path / "shard" / "decisive_steps.csv").exists()


def test_fair_r3_quick_preset(tmp_path, monkeypatch):
    out = run_quick("fair_r3.py", tmp_path, monkeypatch)
    steps = pd.read_csv(out / "fair_r3_steps.csv")
    assert steps.arm.nunique() == 8 and (steps["mismatch/fraction"] > 0).all()  # the sampler routes differently
    r3 = steps[steps.method == "GRPO + R3"]
    assert (r3["sampler/kl_k3"] < 1e-6).all()  # replaying its choices leaves no mismatch: the weights are exact
    assert (steps[steps.method == "GRPO"]["sampler/kl_k3"] > r3["sampler/kl_k3"].max()).all()
    summary = pd.read_csv(out / "fair_r3_summary.csv").set_index("arm")
    assert pd.isna(summary.loc["GRPO, π_old sampler", "gap_to_grpo_mean"]) and len(summary) == 8
    assert mpimg.imread(out / "fair_r3.png").shape[1] > 800


def test_why_replay_hurts_quick_preset(tmp_path, monkeypatch):
    out = run_quick("why_replay_hurts.py", tmp_path, monkeypatch)
    stale = pd.read_csv(out / "why_replay_hurts_staleness.csv")
    replayed = stale[stale.arm == "GRPO + R3"]
    cosine = replayed["router/grad_cosine_live"].dropna()  # (NaN where a minibatch's advantages are all 0)
    assert replayed["replay_bias/kl_k3"].notna().all() and len(cosine) > 8 and cosine.between(-1, 1).all()
    aged = stale[stale.arm == "R3, routes < 4 updates old"].set_index("minibatch")
    assert aged.loc[:3, "replay_bias/kl_k3"].notna().all() and aged.loc[4:, "replay_bias/kl_k3"].isna().all()
    assert "replay_bias/kl_k3" not in stale[stale.arm == "GRPO"].dropna(axis=1)
    summary = pd.read_csv(out / "why_replay_hurts_summary.csv").set_index("arm")
    assert summary.loc["GRPO + TIS, no replay", "gap_to_r3_seeds_ahead"] in {"0/1", "1/1"}
    assert mpimg.imread(out / "why_replay_hurts.png").shape[1] > 1000


def test_sampler_mismatch_quick_preset(tmp_path, monkeypatch):
    out = run_quick("sampler_mismatch.py", tmp_path, monkeypatch)
    frame = pd.read_csv(out / "sampler_mismatch.csv").set_index("sampler")
    assert list(frame.index) == [
        "float32", "bfloat16", "float16", "float32 + fp8_e4m3", "bfloat16 + fp8_e4m3", "bfloat16 + fp8_e5m2",
    ]  # fmt: skip
    assert frame.routing_mismatch.between(0, 1).all() and (frame["sampler/kl_k3"] >= 0).all()
    # the fp32 sampler is the trainer (but for float noise); an fp8 round trip moves experts and log-probs
    assert frame.loc["float32", "sampler/kl_k3"] < 1e-9 and frame.loc["bfloat16 + fp8_e5m2", "sampler/kl_k3"] > 1e-6
    assert (tmp_path / "runs" / "init_L4_E16_k2_w10_seed0" / "config.json").exists()  # the warm start, cached


def test_decisive_gate4_quick_preset(tmp_path, monkeypatch):
    """The round-4 gate's machinery (round4_gate.py) in seconds: A, then B only if A failed, then C only if B did;
    each figure against its threshold; --candidate measures one and replaces only its rows."""
    monkeypatch.chdir(ROOT)
    monkeypatch.syspath_prepend(str(ROOT / "experiments"))
    out, runs = tmp_path / "out", tmp_path / "runs"

    def gate(*extra: str) -> pd.DataFrame:
        argv = ["decisive.py", "--preset", "gate4_quick", "--quiet", "--out", str(out), "--runs", str(runs), *extra]
        monkeypatch.setattr(sys, "argv", argv)
        runpy.run_path(str(ROOT / "experiments" / "decisive.py"), run_name="__main__")
        return pd.read_csv(out / "gate4_quick.csv")

    table = gate()
    verdicts = table[table.figure == "gate"].set_index("candidate").passes
    measured = list(verdicts.index)
    assert measured == ["A", "B", "C"][: len(measured)] and not verdicts.iloc[:-1].any()
    assert verdicts.iloc[-1] or measured[-1] == "C"  # the first that passes ends it
    figures = table[table.figure != "gate"]
    assert set(figures.figure) >= {"drift", "routing_share", "max_grad_norm", "heldout_drop", "warm_start_heldout"}
    above = figures.value >= figures.threshold
    assert (figures.passes == above.where(figures.rule == ">=", figures.value <= figures.threshold)).all()
    for name, part in table.groupby("candidate"):
        counted = part[part.in_verdict & (part.figure != "gate")]
        assert len(counted) == 4 and part[part.figure == "gate"].passes.item() == counted.passes.all(), name
    assert (table.seed == 900).all() and set(table.minibatches) <= {2, 4}
    # the warm start runs all its steps (no stop at a sampled-reward target), in a directory named for that
    assert (table.warm_start_steps == 10).all() and table.warm_start_target.isna().all()
    saved = json.loads((runs / "init_seed900_full10" / "warm_start.json").read_text())
    assert saved["warm_start_steps"] == 10 and saved["warm_start_target"] is None
    steps = pd.read_csv(out / "gate4_quick_steps.csv")
    assert steps.groupby("candidate").measured.sum().eq(2).all() and steps.routing_share.notna().all()
    assert_figure(out / "gate4_quick.png", 500, 800)
    again = gate("--candidate", "B")  # (its run is done: resumed, not trained again)
    pd.testing.assert_frame_equal(again.sort_values(["candidate", "figure"]).reset_index(drop=True),
                                  pd.read_csv(out / "gate4_quick.csv").sort_values(["candidate", "figure"])
                                  .reset_index(drop=True))  # fmt: skip
    assert set(again.candidate) == set(measured) | {"B"}
    stale = again[again.candidate == "B"].assign(candidate="Z")  # a row no run in order A, B, C writes
    pd.concat([again, stale]).to_csv(out / "gate4_quick.csv", index=False)
    assert set(gate().candidate) == set(measured)  # without --candidate the table is replaced whole
