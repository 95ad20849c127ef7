"""Round 3's decisive test of "GRPO on MoE needs Routing Replay": GRPO against GRPO + R2 with 6 paired seeds, GSPO
with 3, in the most favourable regime for routing noise found by the gate (experiments/round3_plan.md).

The gate failed in every setting searched (runs/gate, scaling.py --preset gate / gate_search): no setting reached both
8% of experts changed per update and a 50% routing share of the log-ratio variance. This runs the setting closest to
passing, labelled "gate failed": pair sums with 16-token answers, 4 layers, 16 experts top-2, lr 1e-3 (routing's share
52%, 5.2% of experts changed per update), fp32 sampler, 8 prompts x 8 answers, 8 minibatches per step, 300 steps,
held-out evaluation on 256 prompts every 10 steps. π_old's log-probs come from the trainer in every arm (R2: the
trainer's no-grad forward at the sampling weights, whose routes the update replays).

    python experiments/decisive.py --preset quick            # 1 seed, 2 steps: a smoke test
    python experiments/decisive.py --preset full --shard 0/2  # half the runs (two shards run side by side; resumable)
    python experiments/decisive.py --preset full              # the rest, then the summary and figure
    python experiments/decisive.py --preset gate4 [--candidate A|B|C]  # round 4's gate (round4_gate.py)

Writes <out>/decisive_steps.csv, decisive_summary.csv (held-out reward, the mean of the last 3 evaluations, and its
paired gap to GRPO: mean, standard error, seeds ahead, paired t and sign-test p; p99 |log-ratio| and clipped tokens
in the first and last 50 steps) and decisive.png. The gate presets (gate4, gate4_quick) write <out>/<preset>.csv,
<preset>_steps.csv and <preset>.png (round4_gate.py).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
from common import (
    CHANCE,
    ROUND3_ARMS,
    committed,
    parse_args,
    publish,
    running_mean,
    save_figure,
    seed_lines,
    shard_option,
    sharded_steps,
    train_log,
    write_table,
)
from matplotlib.figure import Figure
from paired_stats import paired_table
from round4_gate import CANDIDATES, GATE_PRESETS, run_gate, verdict_line
from round4_gate import figure as gate_figure

ARMS = ROUND3_ARMS  # GRPO, GRPO + R2 and GSPO
HELDOUT = "eval/sampled/reward"
UNBOUNDED = "ratio/unbounded_negative_mean"
SETTING = {"task": "pair_sum", "task_size": 16, "policy": {"num_experts": 16, "num_experts_per_tok": 2}, "lr": 1e-3}
PRESETS = {
    "quick": {
        "seeds": {"GRPO": [0], "GRPO + R2": [0], "GSPO": [0]},
        "steps": 2,
        "warm_start_steps": 10,
        "train": {"prompts": 4, "group_size": 4, "minibatches": 2, "heldout_prompts": 16, "eval_every": 1},
    },
    "full": {
        "seeds": {"GRPO": [0, 1, 2, 3, 4, 5], "GRPO + R2": [0, 1, 2, 3, 4, 5], "GSPO": [0, 1, 2]},
        "steps": 300,
        "warm_start_steps": 600,
        "train": {"prompts": 8, "group_size": 8, "minibatches": 8, "heldout_prompts": 256, "eval_every": 10},
    },
}


def plan(preset: str) -> list[tuple[int, str]]:
    """Every (seed, arm) run, seed by seed so that a partial run already pairs the arms."""
    seeds = PRESETS[preset]["seeds"]
    return [(s, arm) for s in sorted({s for v in seeds.values() for s in v}) for arm in ARMS if s in seeds[arm]]


def run_all(preset: str, runs: Path, progress: bool, shard: tuple[int, int] = (0, 1)) -> pd.DataFrame | None:
    """Train this shard's runs (the seeds s with s % `shard[1]` == `shard[0]`, so that each seed's warm start is
    made by one process; runs resume if interrupted); with the whole plan (one shard) collect every run's log."""
    p = PRESETS[preset]
    k, n = shard
    frames = []
    for seed, arm in plan(preset):
        if seed % n != k:
            continue
        tag = arm.lower().replace(" + ", "_").replace(" ", "_")
        log = train_log(
            runs / f"{tag}_seed{seed}",
            runs / f"init_seed{seed}",  # one warm start per seed, shared by the arms
            progress,
            seed=seed,
            steps=p["steps"],
            warm_start_steps=p["warm_start_steps"],
            **SETTING,
            **p["train"],
            **ARMS[arm],
        )
        frames.append(log.assign(arm=arm, seed=seed))
    return pd.concat(frames, ignore_index=True) if n == 1 else None


def summarize(frame: pd.DataFrame) -> pd.DataFrame:
    """Per arm: the held-out reward (mean of the last 3 evaluations) mean ± sd over seeds; its paired gap to GRPO
    (mean, standard error, sd, seeds ahead, paired t and sign-test p); p99 |log-ratio| and clipped tokens over the
    first and the last 50 steps (whether the ratio tails grow over training)."""
    evals = frame.dropna(subset=[HELDOUT]).sort_values("step")
    last3 = evals.groupby(["arm", "seed"], sort=False)[HELDOUT].apply(lambda v: v.tail(3).mean()).rename("heldout")
    per_seed = last3.reset_index()
    gaps = paired_table(per_seed, "heldout").set_index("arm")
    early, late = frame[frame.step < 50], frame[frame.step >= frame.step.max() - 49]
    rows = []
    for arm in ARMS:
        if arm not in set(frame.arm):
            continue
        mine = per_seed[per_seed.arm == arm].heldout
        gap = gaps.loc[arm] if arm in gaps.index else None
        rows.append(
            {
                "arm": arm,
                "seeds": len(mine),
                "heldout_last3_mean": mine.mean(),
                "heldout_last3_sd": mine.std(),
                **(
                    {}
                    if gap is None
                    else {
                        f"gap_to_grpo_{k.removeprefix('gap_')}": gap[k]
                        for k in ("gap_mean", "gap_se", "seeds_ahead", "p_t", "p_sign")
                    }
                ),
                "p99_log_ratio_first50": early[early.arm == arm]["abs_log_ratio/p99"].mean(),
                "p99_log_ratio_last50": late[late.arm == arm]["abs_log_ratio/p99"].mean(),
                "clipped_first50": early[early.arm == arm]["clip_ratio/region_mean"].mean(),
                "clipped_last50": late[late.arm == arm]["clip_ratio/region_mean"].mean(),
                # A < 0 with r > 1 + ε: logged since round 3's runs (NaN in a log made before)
                "unbounded_negative_first50": early[early.arm == arm].get(UNBOUNDED, pd.Series(dtype=float)).mean(),
                "unbounded_negative_last50": late[late.arm == arm].get(UNBOUNDED, pd.Series(dtype=float)).mean(),
                "expert_change_per_update": frame[frame.arm == arm].expert_change.mean(),
            }
        )
    return pd.DataFrame(rows)


def figure(frame: pd.DataFrame) -> Figure:
    """Held-out reward from its first evaluation (step 10) with each seed's warm start (its step-1 rollout reward: the
    log has no held-out evaluation before step 10) and chance; the training reward of the first 30 steps (the drop
    after step 1); the paired gap to GRPO, p99 |log-ratio| and clipped tokens. Each seed thin, the mean bold (no sd
    band: it hides bimodal seeds), every arm labelled with its seed count."""
    fig = Figure(figsize=(16, 8), layout="constrained")
    axes = fig.subplot_mosaic([["heldout", "heldout", "early"], ["gap", "p99", "clipped"]])
    colors = {arm: f"C{i}" for i, arm in enumerate(ARMS)}
    evals = frame.dropna(subset=[HELDOUT])
    ax = axes["heldout"]
    seed_lines(ax, evals, HELDOUT, colors=colors)
    warm = frame[frame.step == frame.step.min()].groupby("seed").reward_mean.first()
    label = f"warm start, per seed (step-1 rollouts, {len(warm)} seeds)"
    ax.plot([0] * len(warm), warm.values, "kx", ms=7, label=label)
    ax.axhline(CHANCE, color="k", lw=0.8, ls=":", label=f"chance ({CHANCE:g} per digit)")
    ax.set(xlabel="step", ylabel="held-out reward (256 prompts)")
    ax.set_title(f"held-out reward (first evaluation: step {evals.step.min()}; x at 0: the warm start's rollouts)")
    ax.legend(fontsize="small", loc="upper left")
    ax = axes["early"]
    seed_lines(ax, frame[frame.step <= 30], "reward_mean", colors=colors)
    ax.axhline(CHANCE, color="k", lw=0.8, ls=":", label=f"chance ({CHANCE:g})")
    ax.set(xlabel="step", ylabel="sampled reward of the training batch (64 answers)")
    ax.set_title("training reward, steps 1-30 (step 1: the warm start)")
    ax.legend(fontsize="x-small")
    wide = evals.pivot_table(index=["seed", "step"], columns="arm", values=HELDOUT)
    gap = wide.sub(wide["GRPO"], axis=0).reset_index().melt(id_vars=["seed", "step"], var_name="arm", value_name="gap")
    ax = axes["gap"]
    seed_lines(ax, gap[gap.arm != "GRPO"].dropna(), "gap", colors=colors)
    ax.axhline(0.0, color=colors["GRPO"], lw=0.8, label="GRPO (0)")
    ax.set(xlabel="step", ylabel="arm − GRPO, same seed", title="held-out reward gap to GRPO (paired)")
    ax.legend(fontsize="small")
    smooth = frame.assign(p99=running_mean(frame, "abs_log_ratio/p99", 10))
    smooth = smooth.assign(clipped=running_mean(frame, "clip_ratio/region_mean", 10))
    seed_lines(axes["p99"], smooth, "p99", colors=colors)
    axes["p99"].set(xlabel="step", ylabel="p99 |token log-ratio| (10-step mean)", title="ratio tails")
    seed_lines(axes["clipped"], smooth, "clipped", scale=100, colors=colors)
    axes["clipped"].set(xlabel="step", ylabel="clipped tokens (10-step mean, %)", title="clipped tokens")
    for name in ("p99", "clipped"):
        axes[name].legend(fontsize="small")
    fig.suptitle(
        "Round 3, gate failed: pair sums of 16 tokens, 4 layers, 16 experts top-2, lr 1e-3 "
        "(each seed thin, mean over seeds bold; seeds per arm in the legends)"
    )
    return fig


def options(ap: argparse.ArgumentParser) -> None:
    """`--shard K/N` (`shard_option`) and the gate's `--candidate A|B|C` (default: A, then B, then C as they fail).

    Example:
        >>> args = parse_args(__doc__, PRESETS | GATE_PRESETS, runs=Path("runs/x"), extra=options)  # doctest: +SKIP
    """
    shard_option(ap)
    ap.add_argument("--candidate", choices=list(CANDIDATES), help="gate presets: measure this candidate only")


def gate(args: argparse.Namespace) -> None:
    """The gate presets: measure (or with --replot, redraw from the committed CSVs), write <out>/<preset>.csv (with
    --candidate, its rows replace that candidate's in a table already there; without, the run in order A, B, C
    replaces the whole table, so no row of an earlier run stays), the steps and the figure, and print the verdict.

    Example:
        >>> gate(parse_args(__doc__, GATE_PRESETS, runs=Path("runs/g"), argv=["--preset", "gate4"]))  # doctest: +SKIP
    """
    name = args.preset
    if args.replot:
        table, steps = committed(f"{name}.csv"), committed(f"{name}_steps.csv")
    else:
        table, steps = run_gate(name, args.runs, not args.quiet, args.candidate)
        for new, path in ((table, args.out / f"{name}.csv"), (steps, args.out / f"{name}_steps.csv")):
            before = pd.read_csv(path) if path.exists() and args.candidate else new.iloc[:0]
            merged = pd.concat([before[~before.candidate.isin(new.candidate)], new], ignore_index=True)
            write_table(merged.sort_values("candidate", kind="stable"), path)
        table, steps = pd.read_csv(args.out / f"{name}.csv"), pd.read_csv(args.out / f"{name}_steps.csv")
    print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
    print(verdict_line(table))
    save_figure(gate_figure(steps), args.out / f"{name}.png", dpi=110)
    print(f"wrote {args.out}/{name}.csv, {name}_steps.csv, {name}.png")


def main() -> None:
    presets = PRESETS | GATE_PRESETS
    args = parse_args(__doc__, presets, runs=lambda preset: Path(f"runs/decisive_{preset}"), extra=options)
    if args.preset in GATE_PRESETS:
        if args.shard != (0, 1):
            raise SystemExit("--shard is for the decisive runs; the gate measures one candidate at a time")
        gate(args)
        return
    if args.candidate:
        raise SystemExit("--candidate is for the gate presets (gate4, gate4_quick)")
    frame = sharded_steps(args, "decisive", run_all)
    if frame is not None:
        publish(summarize(frame), figure(frame), args.out, "decisive", dpi=110)


if __name__ == "__main__":
    main()
