"""Smoke tests: `experiments/compare.py` and `experiments/sweep.py --preset quick` run and write well-formed outputs
(not claims)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import matplotlib.image as mpimg
import pandas as pd

ROOT = Path(__file__).resolve().parents[2]


def test_compare_quick_preset(tmp_path):
    cmd = [
        sys.executable,
        str(ROOT / "experiments" / "compare.py"),
        "--preset",
        "quick",
        "--out",
        str(tmp_path / "out"),
        "--runs",
        str(tmp_path / "runs"),
        "--quiet",
    ]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    steps = pd.read_csv(tmp_path / "out" / "compare_steps.csv")
    assert set(steps.arm) == {"GRPO", "GRPO + replay", "GSPO", "GSPO + replay"}
    assert steps.groupby("arm").step.max().eq(8).all() and steps.reward_mean.between(0, 1).all()
    summary = pd.read_csv(tmp_path / "out" / "compare_summary.csv")
    assert len(summary) == 4 and summary.final_reward_mean.between(0, 1).all()
    # GSPO clips whole answers at ε 3e-4 / 4e-4: far more tokens than GRPO's token-level clip at 0.2 / 0.27
    grpo, gspo = (summary.set_index("arm").loc[a, "clipped_tokens"] for a in ("GRPO", "GSPO"))
    assert gspo > grpo
    image = mpimg.imread(tmp_path / "out" / "compare.png")
    assert image.shape[0] > 500 and image.shape[1] > 800


def test_sweep_quick_preset(tmp_path):
    cmd = [sys.executable, str(ROOT / "experiments" / "sweep.py"), "--preset", "quick", "--quiet"]
    cmd += ["--out", str(tmp_path / "out"), "--runs", str(tmp_path / "runs")]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    steps = pd.read_csv(tmp_path / "out" / "sweep_steps.csv")
    assert set(steps.setting) == {"base", "bf16"} and set(steps.arm) == {"GRPO", "GRPO + replay"}
    summary = pd.read_csv(tmp_path / "out" / "sweep_summary.csv").set_index("setting")
    assert summary.loc["base", "mismatch"] == 0.0  # an fp32 sampler routes exactly like the fp32 trainer
    assert summary.loc["bf16", "mismatch"] > 0.0  # a bf16 sampler does not
    assert (tmp_path / "out" / "sweep.png").stat().st_size > 10_000
