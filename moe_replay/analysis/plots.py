"""matplotlib figures of expert change. Each returns a Figure (not registered with pyplot: nothing is shown, saved
or kept alive implicitly); save it with `fig.savefig(path)`."""

from __future__ import annotations

import pandas as pd
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from .metrics import ExpertChange


def _short(name: str) -> str:
    """`model.layers.12.mlp.gate` -> `12`; other names are kept."""
    parts = name.split(".")
    digits = [p for p in parts if p.isdigit()]
    return ".".join(digits) + (name[name.index("#") :] if "#" in name else "") if digits else name


def per_layer(change: ExpertChange, *, title: str | None = None) -> Figure:
    """Bar chart of the share of routed experts that changed, per MoE layer, with the share of changed sets.

    Example:
        >>> fig = per_layer(expert_change(before, after)); fig.savefig("drift.png")  # doctest: +SKIP
    """
    fractions = change.layer_fractions().mul(100).tolist()
    sets = change.layer_set_changed().mul(100).tolist()
    x = range(len(change.layers))
    fig = Figure(figsize=(max(5.0, 0.35 * len(x) + 2), 3.6), layout="constrained")
    ax = fig.subplots()
    ax.bar([i - 0.2 for i in x], fractions, width=0.4, label="routed experts changed (1 − |A∩B|/K)")
    ax.bar([i + 0.2 for i in x], sets, width=0.4, label="expert sets changed", alpha=0.6)
    ax.axhline(change.fraction * 100, color="k", lw=1, ls="--", label=f"all layers: {change.fraction:.2%}")
    ax.set_xticks(list(x), [_short(n) for n in change.layers], rotation=90 if len(x) > 24 else 0)
    ax.set_xlabel("MoE layer")
    ax.set_ylabel("changed (%)")
    ax.set_title(title or f"Expert change per layer: {change.label} ({change.num_tokens} tokens, K={change.top_k})")
    ax.legend(fontsize="small")
    return fig


def over_training(
    frame: pd.DataFrame,
    *,
    x: str = "step",
    y: str = "value",
    metric: str | None = None,
    group: str | None = "arm",
    seed: str = "seed",
    ylabel: str | None = None,
    percent: bool = False,
    title: str | None = None,
    ax: Axes | None = None,
) -> Figure:
    """Curves of a metric over training: the mean over seeds per group, with a band of ± one standard deviation.

    `frame` is tidy: one row per (group, seed, step) with the value in column `y`; if it has a `metric` column,
    pass `metric=` to pick one. Missing `group` or `seed` columns mean one curve / no band. With `ax`, draws into
    that Axes (a panel of a larger figure) and returns its figure.

    Example:
        >>> fig = over_training(log, y="reward_mean", group="arm", ylabel="reward")  # doctest: +SKIP
    """
    data = frame
    if metric is not None:
        if "metric" not in data.columns:
            raise ValueError(f"metric={metric!r} given but the frame has no 'metric' column: {list(data.columns)}")
        data = data[data["metric"] == metric]
    for col in (x, y):
        if col not in data.columns:
            raise ValueError(f"column {col!r} not in the frame (columns: {list(data.columns)})")
    if data.empty:
        raise ValueError(f"no rows to plot (metric={metric!r})")
    groups = data.groupby(group, sort=False) if group and group in data.columns else [(None, data)]
    scale = 100.0 if percent else 1.0
    if ax is None:
        fig = Figure(figsize=(6.4, 3.8), layout="constrained")
        ax = fig.subplots()
    else:
        fig = ax.figure
    for name, part in groups:
        stats = part.groupby(x)[y].agg(["mean", "std", "count"]).sort_index()
        mean = stats["mean"] * scale
        (line,) = ax.plot(stats.index, mean, label=None if name is None else str(name))
        if seed in part.columns and part[seed].nunique() > 1:
            sd = stats["std"].fillna(0) * scale
            ax.fill_between(stats.index, mean - sd, mean + sd, color=line.get_color(), alpha=0.2, lw=0)
    label = ylabel or metric or y
    ax.set_xlabel(x)
    ax.set_ylabel(f"{label} (%)" if percent else label)
    seeds = data[seed].nunique() if seed in data.columns else 1
    ax.set_title(title or f"{label} over {x} (mean ± sd over {seeds} seed{'s' if seeds != 1 else ''})")
    if group and group in data.columns:
        ax.legend(fontsize="small")
    return fig
