"""The tables, the extrapolation and the figure of scaling.py, from its per-minibatch measurements.

Example (from scaling.py, or on the committed CSV):
    >>> frame = pd.read_csv("experiments/results/scaling_steps.csv")  # doctest: +SKIP
    >>> summarize(frame), extrapolate(frame)  # doctest: +SKIP
"""

from __future__ import annotations

import numpy as np
import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

SHAPE = ["setting", "varies", "layers", "experts", "top_k", "answer_len"]
METRICS = {"share_var": "log-ratio variance", "share_clip": "tokens outside the clip band"}
TARGET_LAYERS = 48  # the GSPO paper's Qwen3-30B-A3B: 48 layers, 128 experts, top-8
WIDE = "128 experts, top-8"
AXES = ("base", "depth", "experts", "length")


def per_seed(frame: pd.DataFrame) -> pd.DataFrame:
    """One row per setting and seed: the measured means, and routing's shares 1 − replayed / live."""
    g = frame.groupby([*SHAPE, "seed"], sort=False)
    out = g[["var_live", "var_replay", "clip_live", "clip_replay", "experts_changed", "kl_update"]].mean()
    out = out.join(g[["lr", "calibrated_kl"]].first()).reset_index()
    out["share_var"] = 1 - out.var_replay / out.var_live
    out["share_clip"] = 1 - out.clip_replay / out.clip_live.where(out.clip_live > 0)
    axis = out.varies.map({v: k for k, v in enumerate(AXES)})  # base, then each axis in its own order
    order = pd.DataFrame({"a": axis, "l": out.layers, "e": out.experts, "n": out.answer_len, "s": out.seed})
    return out.loc[order.sort_values(list(order.columns)).index].reset_index(drop=True)


GATE_CHANGE, GATE_SHARE = 0.08, 0.50  # round 3's gate (experiments/round3_plan.md), fixed before its run
GATE_WARM = 0.15  # a warm start below this per-digit reward has not learned its task (common.LEARNED)


def gate_verdict(frame: pd.DataFrame, warm: pd.DataFrame) -> pd.DataFrame:
    """Round 3's gate per setting and seed: the share of expert slots that moved after one update (minibatch 2, the
    first off-policy one, taken after one update since the rollout), averaged over the measured steps; routing's
    share of the log-ratio variance over minibatches 2..μ; the warm start's sampled reward (`warm`, per setting and
    seed); and whether all pass (>= GATE_CHANGE, >= GATE_SHARE, a warm start that learned: >= GATE_WARM)."""
    g = frame.groupby([*SHAPE, "seed"], sort=False)
    one = frame[frame.minibatch == 1].groupby([*SHAPE, "seed"], sort=False).experts_changed.mean()
    out = g[["var_live", "var_replay", "kl_update"]].mean().join(one.rename("change_per_update"))
    out = out.join(g[["lr"]].first()).reset_index()
    out["share_var"] = 1 - out.var_replay / out.var_live
    out = out.merge(warm[["setting", "seed", "warm_start_reward"]], on=["setting", "seed"], how="left")
    learned = out.warm_start_reward >= GATE_WARM
    out["passes"] = (out.change_per_update >= GATE_CHANGE) & (out.share_var >= GATE_SHARE) & learned
    return out


def summarize(frame: pd.DataFrame) -> pd.DataFrame:
    """Per setting: seeds, calibrated lr, the per-update KL reached, experts moved, and routing's shares (mean, sd)."""
    seeds = per_seed(frame)
    g = seeds.groupby(SHAPE, sort=False)
    summary = g.agg(
        seeds=("seed", "nunique"),
        lr=("lr", "mean"),
        kl_update=("kl_update", "mean"),
        experts_changed=("experts_changed", "mean"),
        share_var_mean=("share_var", "mean"),
        share_var_sd=("share_var", "std"),
        share_clip_mean=("share_clip", "mean"),
        share_clip_sd=("share_clip", "std"),
    )
    return summary.reset_index()


def extrapolate(frame: pd.DataFrame, draws: int = 4000, seed: int = 0) -> pd.DataFrame:
    """Fit share = a + b·log2(layers) on the depth axis (base and depth settings) and predict it at 48 layers; with
    the 128-expert top-8 setting, add its gap to the base measured at 4 layers (an additive model). The 90% interval
    draws each setting's mean from a normal with its standard error over seeds (zero with one seed)."""
    seeds = per_seed(frame)
    rng = np.random.default_rng(seed)
    rows = []
    for metric, label in METRICS.items():
        stats = seeds.groupby(SHAPE, sort=False)[metric].agg(["mean", "std", "count"]).reset_index()
        stats["se"] = (stats["std"] / np.sqrt(stats["count"])).fillna(0.0)
        depth = stats[stats.varies.isin(["base", "depth"])].sort_values("layers")
        if len(depth) < 2 or depth["mean"].isna().any():
            continue
        x = np.log2(depth.layers.to_numpy(float))

        def sample(row: pd.Series) -> np.ndarray:
            return rng.normal(row["mean"], row["se"], draws)

        ys = np.stack([sample(r) for _, r in depth.iterrows()])  # [settings, draws]
        slopes, intercepts = np.polyfit(x, ys, 1)
        b, a = np.polyfit(x, depth["mean"].to_numpy(), 1)
        at = np.log2(TARGET_LAYERS)
        cases = [(f"{TARGET_LAYERS} layers, 16 experts, top-2", a + b * at, intercepts + slopes * at)]
        wide, base = stats[stats.setting == WIDE], stats[stats.varies == "base"]
        if len(wide) and len(base):
            gap = wide.iloc[0]["mean"] - base.iloc[0]["mean"]
            gaps = sample(wide.iloc[0]) - sample(base.iloc[0])
            cases.append((f"{TARGET_LAYERS} layers, {WIDE}", a + b * at + gap, intercepts + slopes * at + gaps))
        cases.append(("slope per doubling of depth", b, slopes))
        for target, estimate, sampled in cases:
            low, high = np.quantile(sampled, [0.05, 0.95])
            rows.append({"metric": label, "target": target, "estimate": estimate, "low_90": low, "high_90": high})
    return pd.DataFrame(rows, columns=["metric", "target", "estimate", "low_90", "high_90"])


def figure(frame: pd.DataFrame, fit: pd.DataFrame, kl_target: float, at_chance: frozenset[str] = frozenset()) -> Figure:
    """Routing's shares along each axis (seeds as dots, mean ± sd as error bars) with the depth fit over the measured
    depths; in a panel of its own, shaded and with hollow markers, the fit's extrapolation to 48 layers with its 90%
    intervals (not a measurement); and the per-update KL each setting reached against the target (seeds as dots, the
    mean as a bar-free marker on a log axis). Settings in `at_chance` (whose warm start did not learn the task) are
    labelled so on the experts and answer axes."""
    seeds = per_seed(frame)
    stats = summarize(frame)
    fig = Figure(figsize=(18, 6.2), layout="constrained")
    axes = fig.subplots(1, 5, gridspec_kw={"width_ratios": [1.2, 0.75, 1.1, 0.8, 1.4]})
    depth_ax, extra_ax = axes[0], axes[1]
    extra_ax.sharey(depth_ax)  # (on the measured depths' scale)
    colors = {"share_var": "C0", "share_clip": "C1"}
    panels = [("depth", ["base", "depth"], axes[0]), ("experts / top-k", ["base", "experts"], axes[2]),
              ("answer", ["length"], axes[3])]  # fmt: skip
    for title, kinds, ax in panels:
        rows = stats[stats.varies.isin(kinds)]
        rows = rows.sort_values("layers") if title == "depth" else rows
        ax.set_title(f"along {title}" + (" (measured)" if title == "depth" else ""), fontsize="medium")
        if rows.empty:
            ax.text(0.5, 0.5, "not in this preset", ha="center", transform=ax.transAxes)
            continue
        if title == "depth":
            xs = np.log2(rows.layers.to_numpy(float))
            ax.set_xticks(xs, [str(t) for t in rows.layers])
            ax.set_xlim(xs.min() - 0.4, xs.max() + 0.4)
            ax.set_xlabel("layers (16 experts, top-2)")
        else:
            xs = np.arange(len(rows), dtype=float)
            names = rows.setting.str.replace("base", "16 experts, top-2" if title != "answer" else "base")
            labels = [n.replace(", ", "\n") + ("\n(warm start\nat chance)" if n in at_chance else "") for n in names]
            ax.set_xticks(xs, labels, fontsize="x-small")
            ax.set_xlim(-0.5, len(rows) - 0.5)
            ax.set_xlabel(
                "4 layers" + (",\n16 experts, top-2" if title == "answer" else ";\nE and top-k change together")
            )
        for k, (metric, label) in enumerate(METRICS.items()):
            off = (k - 0.5) * 0.08 if title == "depth" else (k - 0.5) * 0.2
            mean, sd = rows[f"{metric}_mean"].to_numpy() * 100, rows[f"{metric}_sd"].fillna(0).to_numpy() * 100
            ax.errorbar(xs + off, mean, sd, fmt="o-" if title == "depth" else "o", color=colors[metric], capsize=3,
                        label=f"share of {label} (measured; dots: seeds)")  # fmt: skip
            for x, name in zip(xs, rows.setting, strict=True):
                dots = seeds.loc[seeds.setting == name, metric] * 100
                ax.plot([x + off] * len(dots), dots, ".", color=colors[metric], alpha=0.35)
            if title == "depth":
                depth_fit(ax, fit[fit.metric == label], rows, colors[metric], off)
                extrapolated(extra_ax, fit[fit.metric == label], colors[metric], (k - 0.5) * 0.2)
        ax.axhline(50, color="gray", lw=0.8, ls=":", label="50%: routing half the noise")
        ax.set_ylabel("routing's share (%)")
    extra_ax.axhline(50, color="gray", lw=0.8, ls=":")
    extra_ax.set_facecolor("0.94")
    extra_ax.set_title(f"extrapolated to {TARGET_LAYERS} layers\n(the depth fit: not measured)", fontsize="medium")
    extra_ax.set_xticks([0, 1], [f"{TARGET_LAYERS} layers,\n16 experts,\ntop-2", f"{TARGET_LAYERS} layers,\n{WIDE}"],
                        fontsize="x-small")  # fmt: skip
    extra_ax.set_xlim(-0.6, 1.6)
    extra_ax.set_xlabel("128 experts: plus its gap\nto the base at 4 layers")
    kl = seeds.groupby("setting", sort=False).kl_update
    ax = axes[4]
    for i, (_name, values) in enumerate(kl):
        ax.plot([i] * len(values), values, ".", color="C2", alpha=0.5, label="seeds" if i == 0 else None)
        ax.plot([i], [values.mean()], "_", color="k", ms=14, mew=2, label="mean over seeds" if i == 0 else None)
    ax.axhline(kl_target, color="k", lw=0.8, ls="--", label=f"target {kl_target:g}")
    ax.set_xticks(range(kl.ngroups), list(kl.groups), rotation=45, ha="right", fontsize="x-small")
    ax.set_ylabel("KL per GRPO step (nats / token)")
    ax.set_yscale("log")
    ax.legend(fontsize="x-small")
    ax.set_title("per-update KL reached vs the target", fontsize="medium")
    handles = {}
    for a in axes[:4]:
        for h, lab in zip(*a.get_legend_handles_labels(), strict=True):
            handles.setdefault(lab, h)
    fig.legend(handles.values(), handles.keys(), loc="outside lower center", ncol=3, fontsize="small")
    n = sorted(set(stats.seeds))
    fig.suptitle(
        "Routing's share of GRPO's token-ratio noise (1 − replayed / live), matched per-update KL; "
        f"{'–'.join(map(str, n[:: max(len(n) - 1, 1)]))} seeds: mean ± sd; {TARGET_LAYERS} layers: extrapolated, "
        "90% intervals"
    )
    return fig


def depth_fit(ax: Axes, fit: pd.DataFrame, depth: pd.DataFrame, color: str, off: float) -> None:
    """The depth fit (share = a + b·log2(layers)) as a dashed line over the measured depths only."""
    at = np.log2(TARGET_LAYERS)
    slope = fit[fit.target.str.startswith("slope")].estimate
    narrow = fit[~fit.target.str.startswith("slope") & ~fit.target.str.contains("128")]
    if len(slope) and len(narrow):
        xs = np.log2([depth.layers.min(), depth.layers.max()])
        ys = (narrow.iloc[0].estimate + slope.iloc[0] * (xs - at)) * 100
        ax.plot(xs + off, ys, "--", color=color, lw=1, label="fit a + b·log2(layers)")


def extrapolated(ax: Axes, fit: pd.DataFrame, color: str, off: float) -> None:
    """The 48-layer predictions with their 90% intervals: hollow markers, dashed interval lines."""
    for _, row in fit[~fit.target.str.startswith("slope")].iterrows():
        wide = "128" in row.target
        err = np.array([[row.estimate - row.low_90], [row.high_90 - row.estimate]]) * 100
        bars = ax.errorbar([int(wide) + off], [row.estimate * 100], err, fmt="D" if wide else "s", color=color,
                           capsize=3, mfc="white", label="extrapolated, 90% interval")  # fmt: skip
        bars[2][0].set_linestyle("--")
