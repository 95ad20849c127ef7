"""Where, if anywhere, does GRPO without Routing Replay degrade on a tiny MoE? GRPO with and without replay, over
seeds, one knob changed at a time from the compare.py setting, plus all stressors at once.

Tests the GSPO paper's claim that GRPO does not converge on an MoE model without Routing Replay (Zheng et al. 2025,
arXiv 2507.18071, §5.3), at toy scale, by turning up the knobs that should make routing drift matter: μ (more
minibatches per batch, so later minibatches sit further from π_old), learning rate (more experts change per
update), response length, depth, number of experts and top-k, router sharpness (the routers' weights scaled after
the warm start), and a bf16 sampler against an fp32 trainer (rollout-vs-trainer mismatch, which replay of the
rollout routes removes).

How it differs from the paper: the tiny Qwen3-MoE of compare.py (4 layers, 16 experts, top-2) on 3-digit addition,
16 prompts x 8 answers per step, a short horizon (80 steps), 3 seeds per arm; no knob was tuned to make a picture.

    python experiments/sweep.py --preset quick   # 2 settings, 1 seed, a few steps: a smoke test
    python experiments/sweep.py --preset full    # the sweep table (about 2 hours of training steps plus warm starts)
    python experiments/sweep.py --only mu16 bf16 # some settings (runs resume; results merge into the CSVs)

Writes <out>/sweep_steps.csv (every step of every run, tidy), sweep_summary.csv and sweep.png.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
from common import LEARNED, committed, parse_args, publish, running_mean, train_log, write_table
from matplotlib.figure import Figure
from paired_stats import gap_columns

from moe_replay.analysis import plots

ARMS = {"GRPO": "off", "GRPO + replay": "rollout"}
MOVED = "routes_moved_since_rollout/last_minibatch"
# One knob at a time from compare.py's setting (lr 1e-4, μ = 4, 3-digit addition, 4 layers, fp32 sampler).
SETTINGS: dict[str, dict] = {
    "base": {},
    "mu1": {"minibatches": 1},
    "mu16": {"minibatches": 16},
    "lr1e-3": {"lr": 1e-3},
    "long": {"task_size": 7},  # 8-token answers instead of 4
    "deep": {"policy": {"num_hidden_layers": 12}},
    "top1": {"policy": {"num_experts_per_tok": 1}},  # one expert per token: the most fragile choice
    "e64": {"policy": {"num_experts": 64}},  # 64 experts, top-2: narrower margins between experts
    "sharp": {"router_scale": 4.0},
    "flat": {"router_scale": 0.25},
    "bf16": {"rollout_dtype": "bfloat16"},
    "stress": {"lr": 1e-3, "minibatches": 16, "rollout_dtype": "bfloat16", "router_scale": 0.25},
}
TITLES = {  # what each panel changed, in words
    "base": "base (lr 1e-4, μ 4)",
    "mu1": "μ 1 (on-policy)",
    "mu16": "μ 16",
    "lr1e-3": "lr 1e-3",
    "long": "8-token answers",
    "deep": "12 layers",
    "top1": "top-1",
    "e64": "64 experts",
    "sharp": "sharper routers (×4)",
    "flat": "flatter routers (×0.25)",
    "bf16": "bf16 sampler",
    "stress": "stress (lr 1e-3, μ 16, bf16, flat)",
}
PRESETS = {
    "quick": {"settings": ["base", "bf16"], "seeds": [0], "steps": 4, "warm_start_steps": 40},
    "full": {"settings": list(SETTINGS), "seeds": [0, 1, 2], "steps": 80, "warm_start_steps": 300},
}


def init_dir(runs: Path, settings: dict, seed: int) -> Path:
    """The warm start a setting shares with the others of the same task and policy shape."""
    policy = settings.get("policy", {})
    layers = policy.get("num_hidden_layers", 4)
    shape = (policy.get("num_experts", 16), policy.get("num_experts_per_tok", 2))
    experts = "" if shape == (16, 2) else f"_E{shape[0]}_k{shape[1]}"
    return runs / f"init_add{settings.get('task_size', 3)}_L{layers}{experts}_seed{seed}"


def run_all(names: list[str], preset: str, runs: Path, progress: bool) -> pd.DataFrame:
    """Train both arms of every named setting for every seed (runs resume if interrupted); return the step logs."""
    p = PRESETS[preset]
    frames = []
    for name in names:
        for seed in p["seeds"]:
            for arm, replay in ARMS.items():
                settings = SETTINGS[name]
                log = train_log(
                    runs / f"{name}_{replay}_seed{seed}",
                    init_dir(runs, settings, seed),
                    progress,
                    seed=seed,
                    steps=p["steps"],
                    warm_start_steps=p["warm_start_steps"],
                    importance_sampling_level="token",
                    replay=replay,
                    **settings,
                )
                frames.append(log.assign(setting=name, arm=arm, seed=seed))
    return pd.concat(frames, ignore_index=True)


def summarize(frame: pd.DataFrame) -> pd.DataFrame:
    """Per setting: final reward (mean of the last 20% of steps) of each arm, mean ± sd over seeds; the paired gap
    replay − no replay per seed (mean, standard error, sd, seeds ahead, paired t and sign-test p); the largest drop
    from a run's best reward (a collapse shows here); expert change per update, rollout/trainer mismatch, clipped
    tokens and p99 |token log-ratio| without replay; how far the last minibatch's live routing is from the sampled
    one."""
    rows = []
    for name in frame.setting.unique():
        runs = frame[frame.setting == name]
        tail = runs[runs.step > runs.step.max() * 0.8]
        final = tail.groupby(["arm", "seed"]).reward_mean.mean().unstack("arm")
        gap = final["GRPO + replay"] - final["GRPO"]
        drop = (
            runs.assign(smooth=running_mean(runs))
            .groupby(["arm", "seed"])
            .smooth.agg(lambda r: r.max() - r.iloc[-1])
            .groupby("arm")
            .max()
        )
        off, rep = runs[runs.arm == "GRPO"], runs[runs.arm == "GRPO + replay"]
        rows.append(
            {
                "setting": name,
                "seeds": runs.seed.nunique(),
                "final_GRPO": final["GRPO"].mean(),
                "final_GRPO_sd": final["GRPO"].std(),
                "final_replay": final["GRPO + replay"].mean(),
                "final_replay_sd": final["GRPO + replay"].std(),
                **gap_columns(gap, "gap_replay_minus_off"),
                "max_drop_GRPO": drop.get("GRPO", float("nan")),
                "max_drop_replay": drop.get("GRPO + replay", float("nan")),
                "expert_change_per_update": off.expert_change.mean(),
                "mismatch": off["mismatch/fraction"].mean(),
                "clipped_GRPO": off["clip_ratio/region_mean"].mean(),
                "clipped_replay": rep["clip_ratio/region_mean"].mean(),
                "p99_log_ratio_GRPO": off["abs_log_ratio/p99"].mean(),
                "p99_log_ratio_replay": rep["abs_log_ratio/p99"].mean(),
                # experts of the last minibatch's live routing that differ from the sampled ones (logged since the
                # loop records it; NaN for runs made before)
                "moved_since_rollout_last_GRPO": off.get(MOVED, pd.Series(dtype=float)).mean(),
                "moved_since_rollout_last_replay": rep.get(MOVED, pd.Series(dtype=float)).mean(),
            }
        )
    return pd.DataFrame(rows)


def figure(frame: pd.DataFrame) -> Figure:
    """Reward over steps per setting, GRPO with and without replay, mean ± sd over seeds: step 1 (the warm start's
    rollouts, before any update: the same for both arms) as a marker of its own, then each run's 5-step running mean
    over steps 2.. (a running mean from step 1 would average the drop after it away)."""
    first = frame.step.min()
    later = frame[frame.step > first]
    later = later.assign(smooth=running_mean(later))
    names = list(frame.setting.unique())
    cols = min(5, len(names))
    rows = -(-len(names) // cols)
    fig = Figure(figsize=(3.2 * cols, 3.0 * rows + 0.6), layout="constrained")
    axes = fig.subplots(rows, cols, squeeze=False, sharey=True).flatten()
    for ax, name in zip(axes, names, strict=False):
        part = frame[frame.setting == name]
        title = TITLES.get(name, name)
        start = part[part.step == first].reward_mean.mean()
        early = part[(part.step > first) & (part.step <= first + 4)].reward_mean.mean()
        end = part[part.step > part.step.max() * 0.8].reward_mean.mean()
        # where each panel's reward went (both arms): step 1, steps 2-5, the last 20%; a flat one learned nothing
        title += f"\nreward: step 1 {start:.2f}, 2-5 {early:.2f} → end {end:.2f}"
        title += "\n(warm start at chance)" if start < LEARNED else ""
        plots.over_training(later[later.setting == name], y="smooth", group="arm", ylabel="reward", ax=ax, title=title)
        ax.title.set_fontsize("small")
        ax.plot([first], [start], "kD", ms=5, label=f"step {first}: before any update")
        if ax is axes[0]:
            ax.legend(fontsize="x-small")
        else:
            ax.get_legend().remove()
    for ax in axes[len(names) :]:
        ax.set_visible(False)
    fig.suptitle(
        f"GRPO with and without replay, one knob at a time ({frame.seed.nunique()} seeds, mean ± sd; step 1 on its "
        "own, then the 5-step mean of steps 2..)",
        fontsize="medium",
    )
    return fig


def options(ap: argparse.ArgumentParser) -> None:
    """sweep.py's own option: `--only`."""
    ap.add_argument("--only", nargs="+", choices=list(SETTINGS), help="run these settings and merge them into the CSVs")


def main() -> None:
    args = parse_args(__doc__, PRESETS, runs=lambda preset: Path(f"runs/sweep_{preset}"), extra=options)
    if args.replot:
        frame = committed("sweep_steps.csv")
        publish(summarize(frame), figure(frame), args.out, "sweep", dpi=100)
        return
    names = args.only or PRESETS[args.preset]["settings"]
    frame = run_all(names, args.preset, args.runs, progress=not args.quiet)
    steps_csv = args.out / "sweep_steps.csv"
    if args.only and steps_csv.exists():  # keep the other settings' results
        kept = pd.read_csv(steps_csv)
        frame = pd.concat([kept[~kept.setting.isin(names)], frame], ignore_index=True)
        order = [s for s in SETTINGS if s in set(frame.setting)]
        frame = frame.set_index("setting").loc[order].reset_index()
    write_table(frame, steps_csv)
    publish(summarize(frame), figure(frame), args.out, "sweep", dpi=100)


if __name__ == "__main__":
    main()
