"""Expert change after one gradient update, as a function of learning rate, depth, number of experts and top-k.

Reproduces (in kind, not in scale) claim 1 of the GSPO paper (Zheng et al. 2025, arXiv 2507.18071): after one
gradient update about 10% of the experts activated for a response change, in the 48-layer Qwen3-30B-A3B.

How it differs from the paper: a tiny Qwen3-MoE-style policy (4-12 layers, hidden 96, 8-64 experts, top-1..8,
about 1M parameters) warm-started on 3-digit addition and trained on 2 CPU cores; one GRPO update here is one Adam
step on a whole batch of 16 prompts x 8 sampled answers (token-level loss, ε 0.2 / 0.27). The change is measured
teacher-forced on that batch, before vs after the update (`measure_update_drift`). Adam's first step moves every
weight by about lr, so updates 1..N are reported separately (the paper's runs are deep into training).

    python experiments/expert_change.py --preset quick   # 2 small variants x 2 learning rates: a smoke test (~15 s)
    python experiments/expert_change.py --preset full    # the claim-1 table, 3 seeds (about 12 minutes)
    python experiments/expert_change.py --replot         # redraw the table and figures from the committed CSV

Writes experiments/results/expert_change.csv (tidy: variant, layers, experts, top_k, seed, lr, update, layer,
fraction), expert_change_summary.csv (per variant and lr: first update and later updates, mean and sd over seeds, %)
and expert_change_lr.png, expert_change_layers.png; warm starts are cached under --runs (default runs/warm_starts).
"""

from __future__ import annotations

import copy
from pathlib import Path

import pandas as pd
import torch
from common import WARM_STARTS, committed, parse_args, save_figure, warm_started, write_table
from matplotlib.figure import Figure

from moe_replay import measure_update_drift
from moe_replay.rl import Task, minibatch_update, rollout

PRESETS = {
    "quick": {
        "variants": [(2, 16, 2), (4, 16, 2)],
        "lrs": [1e-4, 1e-3],
        "updates": 2,
        "warm_steps": 10,
        "seeds": [0],
        "prompts": 8,
        "group_size": 4,
    },
    "full": {
        "variants": [(4, 16, 2), (8, 16, 2), (12, 16, 2), (4, 8, 2), (4, 64, 2), (4, 16, 1), (4, 16, 4), (4, 64, 8)],
        "lrs": [1e-4, 3e-4, 1e-3, 3e-3],
        "updates": 4,
        "warm_steps": 300,
        "seeds": [0, 1, 2],
    },
}


def drift_per_update(
    model: torch.nn.Module, lr: float, updates: int, seed: int = 0, *, prompts: int = 16, group_size: int = 8
) -> list[pd.Series]:
    """Per-layer expert change of each of `updates` successive GRPO updates (one Adam step on a fresh batch of
    `prompts` x `group_size` answers each, routing live)."""
    task = Task("addition", 3)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    out = []
    for _ in range(updates):
        prompt_ids, answers = task.sample(prompts, g)
        batch = rollout(model, task, prompt_ids, answers, group_size=group_size)
        change = measure_update_drift(
            model, batch.sequences, None, update=lambda b=batch: minibatch_update(model, opt, b)
        )
        out.append(change.per_layer)
    return out


def summary(frame: pd.DataFrame) -> pd.DataFrame:
    """Per variant and lr, in %: the first update's change and the mean of later updates, mean and sd over seeds."""
    per_seed = frame.groupby(["variant", "lr", "seed", "update"], sort=False).fraction.mean().reset_index()
    first = per_seed[per_seed["update"] == 1].groupby(["variant", "lr"], sort=False).fraction
    later = per_seed[per_seed["update"] > 1].groupby(["variant", "lr", "seed"], sort=False).fraction.mean()
    later = later.groupby(["variant", "lr"], sort=False)
    out = pd.DataFrame(
        {
            "first_mean": first.mean() * 100,
            "first_sd": first.std().fillna(0) * 100,
            "later_mean": later.mean() * 100,
            "later_sd": later.std().fillna(0) * 100,
            "seeds": first.size(),
        }
    )
    return out.reset_index()


def measure(p: dict, cache: Path, quiet: bool = False) -> pd.DataFrame:
    """Warm-start each variant per seed and measure the per-layer change of each update at each learning rate."""
    from transformers import AutoModelForCausalLM

    batch = {k: p[k] for k in ("prompts", "group_size") if k in p}
    rows = []
    for layers, experts, top_k in p["variants"]:
        for seed in p["seeds"]:
            init = warm_started(cache, layers=layers, experts=experts, top_k=top_k, steps=p["warm_steps"], seed=seed)
            base = AutoModelForCausalLM.from_pretrained(init)
            for lr in p["lrs"]:
                torch.manual_seed(seed)
                per_update = drift_per_update(copy.deepcopy(base), lr, p["updates"], seed=seed, **batch)
                for u, per_layer in enumerate(per_update, start=1):
                    for i, (name, frac) in enumerate(per_layer.items()):
                        rows.append(
                            {
                                "variant": f"L{layers} E{experts} k{top_k}",
                                "layers": layers,
                                "experts": experts,
                                "top_k": top_k,
                                "seed": seed,
                                "lr": lr,
                                "update": u,
                                "layer": i,
                                "layer_name": name,
                                "fraction": frac,
                            }
                        )
                overall = [s.mean() for s in per_update]
                if not quiet:
                    print(
                        f"L{layers:2d} E{experts:2d} k{top_k} seed {seed}  lr {lr:g}: "
                        + "  ".join(f"{f:.2%}" for f in overall)
                    )
    return pd.DataFrame(rows)


def report(frame: pd.DataFrame, out: Path) -> None:
    """Write the summary table and the two figures."""
    seeds = frame.seed.nunique()
    lrs = sorted(frame.lr.unique())
    updates = frame["update"].max()

    table = summary(frame)
    write_table(table, out / "expert_change_summary.csv")
    print(table.to_string(index=False, formatters={"lr": "{:g}".format}, float_format=lambda v: f"{v:.2f}"))
    fig = Figure(figsize=(11, 4.4), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    panels = [("first", "update 1: a fresh Adam (every weight moves by about lr)"),
              ("later", f"later updates (mean of 2..{updates})")]  # fmt: skip
    for ax, (col, which) in zip(axes, panels, strict=True):
        for variant, part in table.groupby("variant", sort=False):
            mean, sd = part[f"{col}_mean"], part[f"{col}_sd"]
            (line,) = ax.plot(part.lr, mean, marker="o", label=variant)
            ax.fill_between(part.lr, mean - sd, mean + sd, alpha=0.1, color=line.get_color())
        # the paper's number is another model's (48 layers, 128 experts, top-8) deep into training: a reference only
        ax.axhline(10, color="k", lw=1, ls=":", label="~10%: GSPO paper, Qwen3-30B-A3B (not this model)")
        ax.set_xscale("log")
        ax.set_xlabel("learning rate (Adam)")
        ax.set_title(which, fontsize="medium")
    axes[0].set_facecolor("#fff3e0")  # the fresh-Adam panel, shaded: its first step is not a steady-state update
    axes[0].text(0.03, 0.97, "shaded: a fresh Adam's first step,\nnot a step deep into training", ha="left",
                 va="top", transform=axes[0].transAxes, fontsize="small", color="#a0522d")  # fmt: skip
    axes[0].set_ylabel("routed experts changed by one update (%)")
    axes[1].legend(fontsize="small", ncol=2, loc="upper left")  # (the right panel's top left is empty)
    fig.suptitle(f"Expert change after one GRPO update, tiny MoE, 3-digit addition (mean ± sd over {seeds} seeds)")
    save_figure(fig, out / "expert_change_lr.png")

    lr = lrs[len(lrs) // 2]
    fig = Figure(figsize=(6.4, 3.8), layout="constrained")
    ax = fig.subplots()
    depth = frame[(frame.lr == lr) & (frame.experts == 16) & (frame.top_k == 2)].sort_values("layers", kind="stable")
    for variant, part in depth.groupby("variant", sort=False):  # legend in depth order
        per_seed = (part.groupby(["layer", "seed"]).fraction.mean() * 100).groupby("layer")  # mean of the updates
        mean, sd = per_seed.mean(), per_seed.std().fillna(0)
        (line,) = ax.plot(mean.index, mean.values, marker="o", label=variant)
        ax.fill_between(mean.index, mean - sd, mean + sd, alpha=0.15, color=line.get_color())
    ax.set_xlabel("MoE layer index")
    ax.set_ylabel(f"routed experts changed (%), mean of {updates} updates")
    ax.set_title(f"Expert change per layer, by depth (lr {lr:g}; mean ± sd over {seeds} seeds)\n"
                 f"updates 1-{updates} of a fresh Adam, update 1 included", fontsize="medium")  # fmt: skip
    ax.legend(fontsize="small")
    save_figure(fig, out / "expert_change_layers.png")
    print(f"wrote {out}/expert_change.csv and two figures")


def main() -> None:
    args = parse_args(__doc__, PRESETS, runs=WARM_STARTS)
    if args.replot:
        frame = committed("expert_change.csv")
    else:
        frame = measure(PRESETS[args.preset], args.runs, quiet=args.quiet)
        write_table(frame, args.out / "expert_change.csv")
    report(frame, args.out)


if __name__ == "__main__":
    main()
