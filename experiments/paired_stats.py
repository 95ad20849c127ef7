"""The statistics of every comparison in the experiments' summary tables: the paired gap between two arms over seeds
with its standard error, a sign count and two p-values (a paired t-test and an exact two-sided sign test).

A gap's spread over seeds (sd) says how much one seed varies; whether the mean gap differs from zero is a question for
its standard error (sd / √n) and the t-test. With n seeds a sign count of n/n has sign-test p = 2 / 2ⁿ (0.031 at 6
seeds, 0.0625 at 5, 0.25 at 3): few seeds cannot reach p < 0.05 by signs alone.

Example (in an experiment script, run as `python experiments/<name>.py`, whose folder is then on sys.path):
    >>> from paired_stats import paired  # doctest: +SKIP
    >>> paired([0.03, 0.05, 0.01, 0.04])["seeds_ahead"]  # doctest: +SKIP
    '4/4'
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pandas as pd
from scipy import stats


def paired(gaps: Sequence[float]) -> dict[str, float | int | str]:
    """The paired gaps of one comparison (arm − baseline, one per seed): their mean, sd and standard error, how many
    seeds are ahead (k/n), the paired t statistic and its two-sided p, and the exact two-sided sign-test p (ties
    dropped). NaN where n is too small (one seed: no sd; all gaps equal: no t).

    Example:
        >>> r = paired([0.03, 0.05, 0.01, 0.04])
        >>> round(r["gap_mean"], 3), round(r["gap_se"], 4), r["seeds_ahead"], round(r["p_sign"], 3)
        (0.033, 0.0085, '4/4', 0.125)
    """
    x = np.asarray([g for g in gaps if g == g], dtype=float)  # (a seed missing in one arm: dropped)
    n = len(x)
    mean = float(x.mean()) if n else math.nan
    sd = float(x.std(ddof=1)) if n > 1 else math.nan
    se = sd / math.sqrt(n) if n > 1 else math.nan
    t = mean / se if n > 1 and se > 0 else math.nan
    p_t = float(2 * stats.t.sf(abs(t), n - 1)) if t == t else math.nan
    ahead, behind = int((x > 0).sum()), int((x < 0).sum())
    decided = ahead + behind
    p_sign = float(min(1.0, 2 * stats.binom.cdf(min(ahead, behind), decided, 0.5))) if decided else math.nan
    return {
        "n": n,
        "gap_mean": mean,
        "gap_sd": sd,
        "gap_se": se,
        "seeds_ahead": f"{ahead}/{n}",
        "t": t,
        "p_t": p_t,
        "p_sign": p_sign,
    }


def detectable_effect(gaps: Sequence[float] | pd.Series, alpha: float = 0.05, power: float = 0.8) -> float:
    """The smallest true mean gap a paired t-test over these seeds would find (two-sided `alpha`) with probability
    `power`, were the gaps' sd the one observed: (t_{1−α/2, n−1} + t_{power, n−1}) × sd / √n. NaN under 2 seeds.

    Example:
        >>> round(detectable_effect([0.03, 0.05, 0.01, 0.04]), 3)
        0.036
    """
    x = np.asarray([g for g in gaps if g == g], dtype=float)
    n = len(x)
    if n < 2:
        return math.nan
    df = n - 1
    return float((stats.t.ppf(1 - alpha / 2, df) + stats.t.ppf(power, df)) * x.std(ddof=1) / math.sqrt(n))


def gap_columns(gaps: Sequence[float] | pd.Series, name: str = "gap_to_grpo") -> dict[str, float | str]:
    """`paired(gaps)` as a summary table's columns, prefixed by `name`: mean, standard error, sd, seeds ahead (k/n),
    the paired t-test's p and the sign test's p.

    Example:
        >>> gap_columns([0.03, 0.05, 0.01, 0.04])["gap_to_grpo_seeds_ahead"]
        '4/4'
    """
    r = paired(list(gaps))
    return {
        f"{name}_mean": r["gap_mean"],
        f"{name}_se": r["gap_se"],
        f"{name}_sd": r["gap_sd"],
        f"{name}_seeds_ahead": r["seeds_ahead"],
        f"{name}_p_t": r["p_t"],
        f"{name}_p_sign": r["p_sign"],
    }


def paired_table(
    frame: pd.DataFrame, value: str, *, arm: str = "arm", base: str = "GRPO", by: Sequence[str] = (), seed: str = "seed"
) -> pd.DataFrame:
    """Per group of `by` (e.g. a setting) and per arm other than `base`: `paired` of `value` minus the base arm's at
    the same seed. `frame` holds one row per (group, arm, seed).

    Example:
        >>> paired_table(per_seed, "heldout_last3", by=["setting"])  # doctest: +SKIP
    """
    rows = []
    groups = frame.groupby(list(by), sort=False) if by else [((), frame)]
    for key, group in groups:
        key = key if isinstance(key, tuple) else (key,)
        wide = group.pivot_table(index=seed, columns=arm, values=value, aggfunc="first")
        if base not in wide:
            continue
        for other in [a for a in group[arm].unique() if a != base]:
            rows.append({**dict(zip(by, key, strict=True)), arm: other, "vs": base, **paired(wide[other] - wide[base])})
    return pd.DataFrame(rows)


def last_evaluations(frame: pd.DataFrame, value: str, keys: Sequence[str], n: int = 3, step: str = "step") -> pd.Series:
    """The mean of the last `n` non-missing `value`s per run (`keys`, e.g. setting, arm and seed): the primary metric,
    less noisy than one evaluation.

    Example:
        >>> last_evaluations(steps, "heldout_reward", ["arm", "seed"])  # doctest: +SKIP
    """
    done = frame.dropna(subset=[value]).sort_values(step)
    return done.groupby(list(keys), sort=False)[value].apply(lambda v: v.tail(n).mean())
