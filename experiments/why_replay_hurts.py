"""Why replay can hurt: under the full stress, where R3 fell behind GRPO in 6/6 pooled seeds (rounds 1 and 2), measure
what replay does inside each minibatch update, and test two remedies against today's replay.

The setting is stress.py's full stress (lr 1e-3, 16 minibatches per step, a bf16 sampler, routers × 0.25), 80 steps,
with a held-out evaluation on 256 prompts every 10 steps (the metric: the mean of the last 3). At every replayed
minibatch the loop measures, at the minibatch's weights (`moe_replay.rl.replay_bias`): KL(replayed ‖ live) and the
mean |log-ratio| between the replayed and the live-routed policy on the same tokens (the bias replay introduces),
the router gradient's norm, and the norm and direction (cosine) of the router gradient the same loss would have had
routed live; the minibatch index is the routes' staleness (updates since the rollout). Arms, 6 paired seeds each,
π_old from the trainer's recompute in all:

- GRPO (no replay) and GRPO + R3 (today's replay: the sampler's routes, gating weights recomputed live);
- remedy 1, GRPO + R3 replaying only routes under 4 updates old (`replay_max_age` 4; later minibatches route live);
- remedy 2, on-policy ratios with the importance-sampling correction instead of replay (GRPO + TIS: per-token
  weights exp(log p_trainer − log p_sampler) truncated at 3, no replay).

Prediction (written before the runs): if replay hurts through the bias it introduces, that bias (KL replayed ‖ live)
grows with the minibatch index, the replayed router gradient turns away from the live one as the routes age
(cosine falling with the index), and both remedies close R3's gap to GRPO (remedy − R3 > 0).

    python experiments/why_replay_hurts.py --preset quick             # every arm, 1 seed, 1 step: a smoke test
    python experiments/why_replay_hurts.py --preset full --shard 0/2  # half the seeds (1/2 beside it; resumable)
    python experiments/why_replay_hurts.py --preset full              # the rest, then the tables and the figure

Writes <out>/why_replay_hurts_steps.csv (every step), why_replay_hurts_staleness.csv (per arm, seed and minibatch
index: the medians over steps), why_replay_hurts_summary.csv and why_replay_hurts.png.
"""

from __future__ import annotations

from pathlib import Path

import matplotlib
import pandas as pd
from common import WARM_STARTS, committed, parse_args, publish, shard_option, warm_started, write_table
from matplotlib.figure import Figure
from paired_stats import gap_columns, last_evaluations
from stress import STRESS

from moe_replay.analysis import plots
from moe_replay.rl import TrainConfig, train

R3 = "GRPO + R3"
ARMS = {
    "GRPO": {"replay": "off"},
    R3: {"replay": "rollout", "router_gradient_check": True},
    "R3, routes < 4 updates old": {"replay": "rollout", "replay_max_age": 4, "router_gradient_check": True},
    "GRPO + TIS, no replay": {"replay": "off", "sampler_correction": "token_truncate"},
}
HELDOUT = "eval/sampled/reward"
STALENESS = ("loss", "replay_bias/kl_k3", "replay_bias/abs_log_ratio_mean", "router/grad_norm",
             "router/grad_norm_live", "router/grad_cosine_live", "clip_ratio/region_mean")  # fmt: skip
PRESETS = {
    "quick": {
        "seeds": [0],
        "steps": 1,
        "warm_start_steps": 10,
        "train": {"prompts": 4, "group_size": 4, "heldout_prompts": 8, "eval_every": 1},
    },  # fmt: skip
    "full": {
        "seeds": list(range(6)),
        "steps": 80,
        "warm_start_steps": 300,
        "train": {"heldout_prompts": 256, "eval_every": 10},
    },  # fmt: skip
}


def run_all(preset: str, runs: Path, progress: bool, shard: tuple[int, int] = (0, 1)) -> tuple[pd.DataFrame, ...]:
    """Train this shard's runs (seeds s with s % `shard[1]` == `shard[0]`; runs resume if interrupted); with the
    whole plan (one shard) return every run's step log and its per-minibatch-index medians over the steps (else two
    empty frames)."""
    p = PRESETS[preset]
    k, n = shard
    steps, stale = [], []
    for seed in (s for s in p["seeds"] if s % n == k):
        init = warm_started(runs / WARM_STARTS.name, steps=p["warm_start_steps"], seed=seed)
        for arm, settings in ARMS.items():
            tag = arm.lower().replace(" + ", "_").replace(",", "").replace(" < ", "_lt").replace(" ", "_")
            cfg = TrainConfig(output=str(runs / f"{tag}_seed{seed}"), init=str(init), seed=seed, steps=p["steps"],
                              **STRESS, **p["train"], **settings)  # fmt: skip
            out = train(cfg, progress=progress)
            steps.append(pd.read_csv(out / "steps.csv").assign(arm=arm, seed=seed))
            mb = pd.read_csv(out / "minibatches.csv")
            columns = [c for c in STALENESS if c in mb]
            # medians over the steps: a few gradient-norm spikes would dominate a mean
            stale.append(mb.groupby("minibatch")[columns].median().reset_index().assign(arm=arm, seed=seed))
    if n > 1:
        return pd.DataFrame(), pd.DataFrame()
    return pd.concat(steps, ignore_index=True), pd.concat(stale, ignore_index=True)


def summarize(frame: pd.DataFrame, stale: pd.DataFrame) -> pd.DataFrame:
    """Per arm: the held-out reward (mean of the last 3 evaluations) mean ± sd over seeds, its paired gaps to GRPO
    and to R3 (mean, standard error, sd, seeds ahead, paired t and sign-test p), and the replay's bias and router
    gradient at the first and the last replayed minibatch index (the staleness): the mean over seeds of each seed's
    median over steps."""
    last = last_evaluations(frame, HELDOUT, ["arm", "seed"])
    rows = []
    for arm in ARMS:
        mine = last.xs(arm, level="arm")
        row: dict[str, object] = {"arm": arm, "seeds": len(mine), "heldout_last3_mean": mine.mean(),
                                  "heldout_last3_sd": mine.std()}  # fmt: skip
        for base, name in (("GRPO", "gap_to_grpo"), (R3, "gap_to_r3")):
            if arm != base:
                row.update(gap_columns((mine - last.xs(base, level="arm")).dropna(), name))
        part = stale[(stale.arm == arm)]
        for column in ("replay_bias/kl_k3", "router/grad_cosine_live", "router/grad_norm", "loss"):
            if column in part and part[column].notna().any():
                replayed = part.dropna(subset=[column])
                first, latest = replayed.minibatch.min(), replayed.minibatch.max()
                row[f"{column}@first"] = replayed[replayed.minibatch == first][column].mean()
                row[f"{column}@last"] = replayed[replayed.minibatch == latest][column].mean()
        rows.append(row)
    return pd.DataFrame(rows)


def figure(frame: pd.DataFrame, stale: pd.DataFrame) -> Figure:
    """Held-out reward (with the warm start's step-1 rollout reward as a line) and its paired gap to R3 over training;
    the replay's bias, the router gradient's cosine with the live one, and the loss against the minibatch index (the
    routes' age). Mean ± sd over seeds."""
    fig = Figure(figsize=(15, 8), layout="constrained")
    axes = fig.subplots(2, 3).flatten()
    evals = frame.dropna(subset=[HELDOUT])
    _plot(evals, y=HELDOUT, ylabel="held-out reward (256 prompts)", ax=axes[0], title="held-out reward")
    # the log has no held-out evaluation of the warm start (the first is at step 10): its step-1 rollouts (before any
    # update; the same in every arm) stand in, the mean over seeds
    first = frame[frame.step == frame.step.min()].groupby("seed").reward_mean.first()
    axes[0].axhline(first.mean(), color="k", lw=1, ls="--")
    axes[0].annotate(f"warm start {first.mean():.3f}: step-1 rollout reward, mean of {len(first)} seeds",
                     (1, first.mean()), xycoords=("axes fraction", "data"), xytext=(-4, -3),
                     textcoords="offset points", ha="right", va="top", fontsize="x-small")  # fmt: skip
    low, high = axes[0].get_ylim()
    axes[0].set_ylim(low - 0.25 * (high - low), max(high, first.mean()) + 0.05 * (high - low))  # (room: the legend)
    axes[0].legend(fontsize="x-small", loc="lower left", ncol=2)
    axes[0].set_title(f"held-out reward (first evaluation: step {evals.step.min()})")
    wide = evals.pivot_table(index=["seed", "step"], columns="arm", values=HELDOUT)
    gap = wide.sub(wide[R3], axis=0).reset_index().melt(id_vars=["seed", "step"], var_name="arm", value_name="gap")
    _plot(gap.dropna(), y="gap", ylabel="arm − R3, same seed", ax=axes[1], title="held-out reward gap to R3 (paired)")
    axes[1].axhline(0.0, color="grey", lw=0.8)
    panels = (("replay_bias/kl_k3", "KL(replayed ‖ live), same tokens and weights", "the bias replay introduces"),
              ("router/grad_cosine_live", "cosine(replayed, live router gradient)", "router gradient direction"),
              ("router/grad_norm", "router gradient norm (before clipping)", "router gradient norm"),
              ("loss", "policy loss", "loss against the routes' age"))  # fmt: skip
    for ax, (column, ylabel, title) in zip(axes[2:], panels, strict=True):
        part = stale.dropna(subset=[column]) if column in stale else stale.iloc[:0]
        _plot(part.rename(columns={"minibatch": "step"}), y=column, ylabel=ylabel, ax=ax, title=title)
        ax.set_xlabel("minibatch index in the step (updates since the rollout)")
    fig.suptitle(f"Why replay can hurt: the full stress, π_old from the trainer ({frame.seed.nunique()} seeds, "
                 "mean ± sd)")  # fmt: skip
    return fig


def _plot(data: pd.DataFrame, **kw: object) -> None:
    """`plots.over_training` by arm, each arm in its own colour in every panel (whichever arms the panel has)."""
    palette = matplotlib.rcParams["axes.prop_cycle"].by_key()["color"]
    cycle = [palette[list(ARMS).index(arm)] for arm in dict.fromkeys(data.arm)]
    kw["ax"].set_prop_cycle(color=cycle)
    plots.over_training(data, group="arm", **kw)


def main() -> None:
    args = parse_args(__doc__, PRESETS, runs=lambda preset: Path(f"runs/why_replay_hurts_{preset}"), extra=shard_option)
    if args.replot:
        frame, stale = committed("why_replay_hurts_steps.csv"), committed("why_replay_hurts_staleness.csv")
    else:
        k, n = args.shard
        frame, stale = run_all(args.preset, args.runs, not args.quiet, (k, n))
        if frame.empty:
            print(f"shard {k}/{n} done; run without --shard to collect")
            return
        write_table(frame, args.out / "why_replay_hurts_steps.csv")
        write_table(stale, args.out / "why_replay_hurts_staleness.csv")
    publish(summarize(frame, stale), figure(frame, stale), args.out, "why_replay_hurts", dpi=100)


if __name__ == "__main__":
    main()
