"""The experiments' paired statistics (experiments/paired_stats.py) against scipy's own paired t-test and exact
binomial test, and their edge cases."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from scipy import stats

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "experiments"))
from paired_stats import detectable_effect, gap_columns, last_evaluations, paired, paired_table  # noqa: E402


@pytest.mark.parametrize("seed", range(5))
def test_paired_matches_scipy(seed):
    rng = np.random.default_rng(seed)
    a, b = rng.normal(0.4, 0.05, 6), rng.normal(0.38, 0.05, 6)
    r = paired(a - b)
    t = stats.ttest_rel(a, b)
    assert r["t"] == pytest.approx(t.statistic) and r["p_t"] == pytest.approx(t.pvalue)
    assert r["gap_se"] == pytest.approx(stats.sem(a - b))
    ahead = int((a > b).sum())
    assert r["seeds_ahead"] == f"{ahead}/6"
    assert r["p_sign"] == pytest.approx(stats.binomtest(ahead, 6, 0.5).pvalue)


def test_paired_edge_cases():
    one = paired([0.1])
    assert one["n"] == 1 and math.isnan(one["gap_se"]) and math.isnan(one["p_t"]) and one["seeds_ahead"] == "1/1"
    flat = paired([0.02, 0.02, 0.02])  # no spread: no t
    assert flat["gap_se"] == 0 and math.isnan(flat["t"]) and flat["p_sign"] == pytest.approx(0.25)
    missing = paired([0.1, float("nan"), 0.3])  # a seed missing in one arm is dropped
    assert missing["n"] == 2 and missing["gap_mean"] == pytest.approx(0.2)
    assert math.isnan(paired([0.0, 0.0])["p_sign"])  # ties only: no sign decides
    assert paired([-0.05] * 6)["p_sign"] == pytest.approx(2 / 2**6)
    assert set(gap_columns([0.1, 0.2], "gap")) == {
        "gap_mean", "gap_se", "gap_sd", "gap_seeds_ahead", "gap_p_t", "gap_p_sign"
    }  # fmt: skip


def test_tables_pair_seeds_and_take_the_last_evaluations():
    frame = pd.DataFrame({"arm": ["GRPO", "R2"] * 3, "seed": [0, 0, 1, 1, 2, 2], "x": [0.1, 0.2, 0.3, 0.3, 0.5, 0.4]})
    table = paired_table(frame, "x")
    assert table.arm.tolist() == ["R2"] and table.seeds_ahead.tolist() == ["1/3"]
    assert table.gap_mean.iloc[0] == pytest.approx(0.0)
    steps = pd.DataFrame({"arm": "a", "seed": 0, "step": range(6), "r": [0.1, None, 0.2, 0.3, None, 0.7]})
    assert last_evaluations(steps, "r", ["arm", "seed"]).iloc[0] == pytest.approx(0.4)


@pytest.mark.parametrize("n", [3, 6, 40])
def test_detectable_effect_is_found_with_about_the_power_asked(n):
    """At the effect it names, a two-sided 5% paired t-test has ~80% power by the noncentral t (the central-t sum
    it uses is a little optimistic at 3 seeds: 77%); under 2 seeds there is no sd."""
    gaps = np.random.default_rng(n).normal(0.0, 0.1, n)
    effect, df = detectable_effect(gaps), n - 1
    shift = effect / gaps.std(ddof=1) * math.sqrt(n)
    crit = stats.t.ppf(0.975, df)
    power = stats.nct.sf(crit, df, shift) + stats.nct.cdf(-crit, df, shift)
    assert 0.76 < power < 0.81
    assert math.isnan(detectable_effect([0.1])) and math.isnan(detectable_effect([0.1, float("nan")]))
