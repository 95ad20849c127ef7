"""Expert change after one gradient update, as a function of learning rate, depth, number of experts and top-k.

Reproduces (in kind, not in scale) claim 1 of the GSPO paper (Zheng et al. 2025, arXiv 2507.18071): after one
gradient update about 10% of the experts activated for a response change, in the 48-layer Qwen3-30B-A3B.

How it differs from the paper: a tiny Qwen3-MoE-style policy (4-12 layers, hidden 96, 8-64 experts, top-1..8,
about 1M parameters) warm-started on 3-digit addition and trained on 2 CPU cores; one GRPO update here is one Adam
step on a whole batch of 16 prompts x 8 sampled answers (token-level loss, ε 0.2 / 0.27). The change is measured
teacher-forced on that batch, before vs after the update (`measure_update_drift`). Adam's first step moves every
weight by about lr, so updates 1..N are reported separately (the paper's runs are deep into training).

    python experiments/expert_change.py --preset quick   # 3 variants x 2 learning rates, a few minutes
    python experiments/expert_change.py --preset full    # the README's table, 3 seeds (about 15 minutes on 2 CPU cores)
    python experiments/expert_change.py --replot         # redraw the table and figures from the committed CSV

Writes experiments/results/expert_change.csv (tidy: variant, layers, experts, top_k, seed, lr, update, layer,
fraction), expert_change_summary.csv (per variant and lr: first update and later updates, mean and sd over seeds, %)
and expert_change_lr.png, expert_change_layers.png.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import pandas as pd
import torch
from matplotlib.figure import Figure

from moe_replay import measure_update_drift
from moe_replay.rl import Task, build_policy, group_advantages, policy_loss, warm_start
from moe_replay.rl.loop import answer_logp
from moe_replay.rl.policy import sample_answers

PRESETS = {
    "quick": {
        "variants": [(4, 16, 2), (8, 16, 2), (4, 64, 8)],
        "lrs": [1e-4, 1e-3],
        "updates": 2,
        "warm_steps": 150,
        "seeds": [0],
    },
    "full": {
        "variants": [(4, 16, 2), (8, 16, 2), (12, 16, 2), (4, 8, 2), (4, 64, 2), (4, 16, 1), (4, 16, 4), (4, 64, 8)],
        "lrs": [1e-4, 3e-4, 1e-3, 3e-3],
        "updates": 4,
        "warm_steps": 300,
        "seeds": [0, 1, 2],
    },
}


def warm_policy(layers: int, experts: int, top_k: int, steps: int, cache: Path, seed: int = 0) -> torch.nn.Module:
    """A warm-started policy of that shape (cached as a save_pretrained directory)."""
    from transformers import AutoModelForCausalLM

    path = cache / f"init_L{layers}_E{experts}_k{top_k}_seed{seed}"
    if not (path / "config.json").exists():
        model = build_policy(
            {"num_hidden_layers": layers, "num_experts": experts, "num_experts_per_tok": top_k}, seed=seed
        )
        warm_start(model, Task("addition", 3), steps=steps, target_reward=0.35, seed=seed)
        model.save_pretrained(path)
    return AutoModelForCausalLM.from_pretrained(path)


def drift_per_update(model: torch.nn.Module, lr: float, updates: int, seed: int = 0) -> list[pd.Series]:
    """Per-layer expert change of each of `updates` successive GRPO updates (one Adam step on a fresh batch each)."""
    task = Task("addition", 3)
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    out = []
    for _ in range(updates):
        prompts, answers = task.sample(16, g)
        prompts, answers = prompts.repeat_interleave(8, 0), answers.repeat_interleave(8, 0)
        model.eval()
        with torch.no_grad():
            seq = sample_answers(model, prompts, task.answer_len)
            old = answer_logp(model, seq, task.prompt_len)
        adv = group_advantages(task.reward(seq[:, task.prompt_len :], answers), 8)

        def update(seq: torch.Tensor = seq, old: torch.Tensor = old, adv: torch.Tensor = adv) -> None:
            model.train()
            logp = answer_logp(model, seq, task.prompt_len)
            loss, _ = policy_loss(logp, old, adv, torch.ones_like(logp, dtype=torch.bool))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)

        out.append(measure_update_drift(model, seq, None, update=update).per_layer)
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


def measure(p: dict, cache: Path) -> pd.DataFrame:
    """Warm-start each variant per seed and measure the per-layer change of each update at each learning rate."""
    rows = []
    for layers, experts, top_k in p["variants"]:
        for seed in p["seeds"]:
            base = warm_policy(layers, experts, top_k, p["warm_steps"], cache, seed=seed)
            for lr in p["lrs"]:
                torch.manual_seed(seed)
                per_update = drift_per_update(copy.deepcopy(base), lr, p["updates"], seed=seed)
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
    table.to_csv(out / "expert_change_summary.csv", index=False)
    print(table.to_string(index=False, formatters={"lr": "{:g}".format}, float_format=lambda v: f"{v:.2f}"))
    fig = Figure(figsize=(11, 4.4), layout="constrained")
    axes = fig.subplots(1, 2, sharey=True)
    panels = [("first", "first update"), ("later", "later updates (mean of 2..N)")]
    for ax, (col, which) in zip(axes, panels, strict=True):
        for variant, part in table.groupby("variant", sort=False):
            mean, sd = part[f"{col}_mean"], part[f"{col}_sd"]
            (line,) = ax.plot(part.lr, mean, marker="o", label=variant)
            ax.fill_between(part.lr, mean - sd, mean + sd, alpha=0.1, color=line.get_color())
        ax.axhline(10, color="k", lw=1, ls=":", label="GSPO paper: ~10%")
        ax.set_xscale("log")
        ax.set_xlabel("learning rate (Adam)")
        ax.set_title(which)
    axes[0].set_ylabel("routed experts changed by one update (%)")
    axes[0].legend(fontsize="small", ncol=2)
    fig.suptitle(f"Expert change after one GRPO update, tiny MoE, 3-digit addition (mean ± sd over {seeds} seeds)")
    fig.savefig(out / "expert_change_lr.png", dpi=120)

    lr = lrs[len(lrs) // 2]
    fig = Figure(figsize=(6.4, 3.8), layout="constrained")
    ax = fig.subplots()
    for variant, part in frame[(frame.lr == lr) & (frame.experts == 16) & (frame.top_k == 2)].groupby("variant"):
        curve = part.groupby("layer").fraction.mean() * 100
        ax.plot(curve.index, curve.values, marker="o", label=f"{variant} (mean of {updates} updates, seeds)")
    ax.set_xlabel("MoE layer index")
    ax.set_ylabel("routed experts changed (%)")
    ax.set_title(f"Expert change per layer, lr {lr:g}, by depth")
    ax.legend(fontsize="small")
    fig.savefig(out / "expert_change_layers.png", dpi=120)
    print(f"wrote {out}/expert_change.csv and two figures")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=list(PRESETS), default="full")
    ap.add_argument("--out", type=Path, default=Path("experiments/results"))
    ap.add_argument("--replot", action="store_true", help="redraw the table and figures from <out>/expert_change.csv")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    if args.replot:
        frame = pd.read_csv(args.out / "expert_change.csv")
    else:
        frame = measure(PRESETS[args.preset], Path("runs/expert_change"))
        frame.to_csv(args.out / "expert_change.csv", index=False)
    report(frame, args.out)


if __name__ == "__main__":
    main()
