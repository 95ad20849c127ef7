"""The statistics behind docs/findings.md's verdicts that no single experiment's summary holds, from the committed CSVs
(no runs): each "not reproduced" gap's 95% confidence interval, whose upper end is the largest effect the design
could have missed; the seeds a pre-registered +0.03 would have needed; the stress comparison pooled over all 12 seeds
it has, with the sweep's multiplicity; and the remedy's p-values adjusted for the comparisons made beside it (Holm).

    python experiments/verdicts.py                          # print the table (from the repository root)
    python experiments/verdicts.py --out experiments/results   # replace the committed verdicts.csv
"""

from __future__ import annotations

import argparse
import math
from pathlib import Path

import pandas as pd
from common import OUT, RESULTS, write_table
from paired_stats import paired
from scipy import stats

LAST = 16  # training reward: the mean of each run's last 16 steps (rounds 1-2's "final reward")
EFFECT = 0.03  # round 3's pre-registered prediction for R2 - GRPO


def interval(mean: float, se: float, n: int) -> tuple[float, float]:
    """The two-sided 95% t interval of a paired mean gap over n seeds."""
    half = stats.t.ppf(0.975, n - 1) * se
    return mean - half, mean + half


def seeds_for(sd: float, effect: float = EFFECT, power: float = 0.8) -> int:
    """The seeds a paired t-test (two-sided 0.05) needs to detect `effect` with `power`, for a paired sd `sd`."""
    n = 2
    while stats.t.ppf(0.975, n - 1) + stats.t.ppf(power, n - 1) > effect * math.sqrt(n) / sd:
        n += 1
    return n


def holm_adjusted(p: dict[str, float]) -> dict[str, float]:
    """Holm's step-down adjustment of the p-values of m comparisons (by name)."""
    adjusted, running = {}, 0.0
    for rank, key in enumerate(sorted(p, key=p.get)):
        running = max(running, min(1.0, (len(p) - rank) * p[key]))
        adjusted[key] = running
    return adjusted


def summary_row(name: str, arm: str, claim: str, column: str = "gap_to_grpo") -> dict:
    """A gap of a committed summary as a verdict row with its interval."""
    row = pd.read_csv(RESULTS / f"{name}_summary.csv").set_index("arm").loc[arm]
    mean, se, n = float(row[f"{column}_mean"]), float(row[f"{column}_se"]), int(row["seeds"])
    low, high = interval(mean, se, n)
    return {"claim": claim, "comparison": f"{arm} ({name})", "seeds": n, "gap_mean": mean, "gap_se": se,
            "ci95_low": low, "ci95_high": high, "p_t": float(row[f"{column}_p_t"])}  # fmt: skip


def final_rewards(name: str, setting: str | None, arms: tuple[str, str]) -> pd.Series:
    """Per seed, arm[0]'s minus arm[1]'s training reward (mean of the last LAST steps) in a committed steps CSV."""
    steps = pd.read_csv(RESULTS / f"{name}_steps.csv")
    if setting is not None:
        steps = steps[steps.setting == setting]
    last = steps[steps.step > steps.step.max() - LAST].groupby(["arm", "seed"]).reward_mean.mean()
    return last[arms[0]] - last[arms[1]]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT, help=f"default {OUT}; to commit: --out {RESULTS}")
    opts = ap.parse_args()
    rows = [
        summary_row("decisive", "GRPO + R2", "GRPO needs Routing Replay (round 3's decisive test)"),
        summary_row("fair_r3", "GRPO + R3, π_old sampler", "R3 improves on GRPO (selection-only sampler)"),
        summary_row("fair_r3", "GRPO + R3, π_old trainer", "R3 improves on GRPO (selection-only sampler)"),
        summary_row("mismatch", "GRPO + R3, π_old sampler", "R3 improves on GRPO (fp8 sampler)"),
    ]
    decisive = pd.read_csv(RESULTS / "decisive_summary.csv").set_index("arm").loc["GRPO + R2"]
    sd = float(decisive.gap_to_grpo_se) * math.sqrt(int(decisive.seeds))
    rows[0]["note"] = f"paired sd {sd:.3f}: +{EFFECT} at 80% power needs {seeds_for(sd)} seeds; the CI holds +{EFFECT}"

    # Replay under the full stress, all seeds: round 1 (sweep, 3), round 2 (stress, 3), round 3 (6), training reward
    parts = {
        "round 1": final_rewards("sweep", "stress", ("GRPO + replay", "GRPO")),
        "round 2": final_rewards("stress", "stress", ("GRPO + R3", "GRPO")),
        "round 3": final_rewards("why_replay_hurts", None, ("GRPO + R3", "GRPO")),
    }
    sweep_settings = pd.read_csv(RESULTS / "sweep_steps.csv").setting.nunique() - 1  # (base is the reference)
    for label, gaps in [("rounds 1-2", pd.concat([parts["round 1"], parts["round 2"]])),
                        ("rounds 1-3", pd.concat(parts.values()))]:  # fmt: skip
        stat = paired(gaps.tolist())
        low, high = interval(stat["gap_mean"], stat["gap_se"], stat["n"])
        rows.append({"claim": "replay hurts under the full stress", "comparison": f"R3 - GRPO, {label}",
                     "seeds": stat["n"], "gap_mean": stat["gap_mean"], "gap_se": stat["gap_se"], "ci95_low": low,
                     "ci95_high": high, "p_t": stat["p_t"], "seeds_ahead": stat["seeds_ahead"]})  # fmt: skip
    first = paired(parts["round 1"].tolist())
    rows[-2]["note"] = (
        f"round 1's stress gap was the most extreme of {sweep_settings} sweep comparisons (p_t {first['p_t']:.3f}, "
        f"Bonferroni {min(1.0, first['p_t'] * sweep_settings):.2f}); round 2 replicated its sign"
    )

    # The remedy, among the comparisons of its round (Holm over the distinct ones)
    why = pd.read_csv(RESULTS / "why_replay_hurts_summary.csv").set_index("arm")
    remedy = "R3, routes < 4 updates old"
    tis = "GRPO + TIS, no replay"

    def p_values(arm: str, column: str) -> tuple[float, float]:
        return float(why.loc[arm, f"{column}_p_t"]), float(why.loc[arm, f"{column}_p_sign"])

    tests = {
        f"{remedy} - R3": p_values(remedy, "gap_to_r3"),
        f"{remedy} - GRPO": p_values(remedy, "gap_to_grpo"),
        "GRPO + R3 - GRPO": p_values("GRPO + R3", "gap_to_grpo"),
        "TIS - R3": p_values(tis, "gap_to_r3"),
        "TIS - GRPO": p_values(tis, "gap_to_grpo"),
    }
    m = len(tests)
    holm = {which: holm_adjusted({k: float(v[which]) for k, v in tests.items()}) for which in (0, 1)}
    for key in (f"{remedy} - R3", f"{remedy} - GRPO"):
        (p_t, p_sign), holm_t, holm_sign = tests[key], holm[0][key], holm[1][key]
        column = "gap_to_r3" if key.endswith("R3") else "gap_to_grpo"
        mean, se = float(why.loc[remedy, f"{column}_mean"]), float(why.loc[remedy, f"{column}_se"])
        low, high = interval(mean, se, int(why.loc[remedy, "seeds"]))
        rows.append({"claim": "replaying only routes under 4 updates old helps", "comparison": key, "seeds": 6,
                     "gap_mean": mean, "gap_se": se, "ci95_low": low, "ci95_high": high, "p_t": p_t,
                     "p_sign": p_sign, "p_t_holm": holm_t, "p_sign_holm": holm_sign,
                     "seeds_ahead": why.loc[remedy, f"{column}_seeds_ahead"],
                     "note": f"Holm over the {m} comparisons of round 3's why_replay_hurts"})  # fmt: skip
    frame = pd.DataFrame(rows)
    with pd.option_context("display.width", 250, "display.max_columns", 20, "display.max_colwidth", 60):
        print(frame.round(4).to_string(index=False))
    print(f"wrote {write_table(frame, opts.out / 'verdicts.csv')}")


if __name__ == "__main__":
    main()
