"""Does routing's share of GRPO's token-ratio noise grow with scale? Depth, experts / top-k and answer length, one
axis at a time, at a matched per-update KL, extrapolated to the GSPO paper's model (48 layers, 128 experts, top-8).

The mechanism (mechanism.py) measured it on one tiny model: on GRPO's off-policy minibatches, the token log-ratio
log π_θ/π_old computed twice at the same weights, routed live and replaying the experts π_old used; routing's share
is 1 − var(replayed) / var(live), and likewise for the tokens pushed outside the clip band. Here each setting first
gets a warm start (up to 300 supervised steps, stopping at sampled reward 0.35), then a learning rate calibrated so
that one GRPO step moves the policy by KL ≈ 1e-2 nats per token (10 steps at lr 1e-4, assuming KL ∝ lr², as for
Adam's sign-like steps), then 30 GRPO steps with rollout replay (R3) to get past Adam's start-up, then 10 measured
steps. The per-update KL actually reached is logged next to each measurement, so the match can be checked.

Hypothesis (issue 16, experiment 2): routing's share passes 50% before the paper's scale. If it stays flat, routing
drift alone cannot explain GRPO's failure there.

    python experiments/scaling.py --preset quick   # base and 8 layers, 1 seed, a few steps: a smoke test
    python experiments/scaling.py --preset full    # 8 settings x 3 seeds (2 at 32 layers); resumable, about 100 minutes
    python experiments/scaling.py --preset gate --out runs/gate   # round 3 gate, lr 3e-4 (experiments/round3_plan.md)

Writes <out>/scaling_steps.csv (one row per measured minibatch), scaling_summary.csv (per setting, mean ± sd over
seeds), scaling_fit.csv (the extrapolation), scaling_warm_starts.csv (each warm start's sampled reward) and
scaling.png.
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pandas as pd
import torch
from common import (
    HIGH,
    LEARNED,
    LOW,
    WARM_STARTS,
    committed,
    outside_clip,
    parse_args,
    publish,
    same_weight_views,
    warm_started,
    write_table,
)
from scaling_report import extrapolate, figure, gate_verdict, summarize
from torch import nn
from tqdm.auto import tqdm

from moe_replay.rl import Rollout, Task, answer_logp, minibatch_update, rollout, sampled_reward
from moe_replay.rl.diagnostics import k3_kl

GATE, GATE_FALLBACK = "gate: pair sum, 16 tokens, 64 experts top-1", "gate: pair sum, 16 tokens, 16 experts top-1"
BASE = {"varies": "base", "layers": 4, "experts": 16, "top_k": 2, "task": ("addition", 3)}  # 4-token answers
SETTINGS = {
    "base": BASE,
    **{f"{n} layers": BASE | {"varies": "depth", "layers": n} for n in (8, 16, 32)},
    **{f"{e} experts, top-8": BASE | {"varies": "experts", "experts": e, "top_k": 8} for e in (64, 128)},
    # the length axis changes the task, so it has its own short-answer control
    **{f"pair sum, {n} tokens": BASE | {"varies": "length", "task": ("pair_sum", n)} for n in (4, 32)},
    # round 3's gate (experiments/round3_plan.md): the most favourable regime for routing noise, at a fixed lr
    GATE: {"varies": "gate", "layers": 4, "experts": 64, "top_k": 1, "task": ("pair_sum", 16)},
    GATE_FALLBACK: {"varies": "gate", "layers": 4, "experts": 16, "top_k": 1, "task": ("pair_sum", 16)},
    # the search when the gate fails (at most one session): the fallback at a larger lr, top-2, and 8 layers
    **{
        f"gate search: {e} experts top-{k}, {n} layers, lr {lr:g}": {
            "varies": "gate",
            "layers": n,
            "experts": e,
            "top_k": k,
            "task": ("pair_sum", 16),
            "lr": lr,
        }
        for e, k, n, lr in (
            (16, 1, 4, 1e-3),
            (16, 2, 4, 1e-3),
            (16, 1, 8, 1e-3),
            (16, 1, 4, 3e-3),  # round 1 of the search
            (16, 2, 4, 3e-3),
            (64, 2, 4, 1e-3),
            (64, 2, 4, 3e-3),  # round 2: top-2 (top-1's share stayed ~0)
        )
    },
}
KL_TARGET = 1e-2  # nats per answer token per GRPO step: the median at lr 1e-4 in the base setting (mismatch runs)
LR0 = 1e-4  # the calibration's learning rate
PRESETS = {
    "quick": {
        "settings": ["base", "8 layers"],
        "seeds": {"default": [0]},
        "warm_steps": 10,
        "calibrate": 2,
        "settle": 1,
        "measure": 1,
        "batch": {"prompts": 4, "group_size": 4, "minibatches": 2},
    },
    "gate": {  # a fixed learning rate, the candidate batch shape of round 3 (8 prompts x 8 answers, 8 minibatches)
        "settings": [GATE],
        "seeds": {"default": [0]},
        "warm_steps": 300,
        "lr": 3e-4,
        "settle": 5,
        "measure": 10,
        "batch": {"prompts": 8, "group_size": 8, "minibatches": 8},
    },
    "gate_search": {},  # the gate's shape over the fallback and the search settings (below)
    "full": {
        "settings": [s for s in SETTINGS if not s.startswith("gate")],
        "seeds": {"default": [0, 1, 2], "32 layers": [0, 1]},  # 32 layers: ~15 minutes a seed
        "warm_steps": 300,
        "calibrate": 10,
        "settle": 30,
        "measure": 10,
        "batch": {"prompts": 16, "group_size": 8, "minibatches": 4},
    },
}


PRESETS["gate_search"] = PRESETS["gate"] | {
    "settings": [GATE_FALLBACK] + [s for s in SETTINGS if s.startswith("gate search")]
}


def grpo_step(
    model: nn.Module, opt: torch.optim.Optimizer, task: Task, g: torch.Generator, batch_size: dict, measure: bool
) -> tuple[list[dict], float]:
    """One GRPO step with rollout replay: the update, the routing views of its off-policy minibatches (2..μ, taken
    before each one trains; only if `measure`), and the per-token KL between the policies before and after it."""
    prompts, answers = task.sample(batch_size["prompts"], g)
    batch = rollout(model, task, prompts, answers, group_size=batch_size["group_size"], replay="rollout")
    rows = []
    for j, idx in enumerate(batch.minibatch_indices(batch_size["minibatches"], g)):
        if measure and j > 0:
            rows.append({"minibatch": j, **routing_views(model, batch, idx)})
        minibatch_update(model, opt, batch, idx, epsilon_low=LOW, epsilon_high=HIGH)
    model.eval()
    with torch.no_grad():
        after = answer_logp(model, batch.sequences, batch.prompt_len)
    return rows, k3_kl(batch.old_logp, after, batch.mask)


def routing_views(model: nn.Module, batch: Rollout, idx: torch.Tensor) -> dict[str, float]:
    """The token log-ratio of the minibatch `idx` at the current weights, routed live and replayed: its variance and
    share outside the clip band in each view, and the share of experts that moved since the rollout."""
    live, replayed, moved = same_weight_views(model, batch, idx)
    return {
        "var_live": float(live.var()),
        "var_replay": float(replayed.var()),
        "clip_live": outside_clip(live),
        "clip_replay": outside_clip(replayed),
        "experts_changed": moved,
    }


def fresh(init: Path, lr: float, seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    """The warm-started policy in `init` with a fresh Adam at `lr`."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(init)
    return model, torch.optim.Adam(model.parameters(), lr=lr)


def probe(name: str, seed: int, p: dict, cache: Path, progress: bool) -> pd.DataFrame:
    """Warm start, calibrate, settle and measure one setting for one seed; one row per measured minibatch."""
    cfg = SETTINGS[name]
    task = Task(*cfg["task"])
    shape = {k: cfg[k] for k in ("layers", "experts", "top_k")}
    init = warm_started(cache, **shape, steps=p["warm_steps"], seed=seed, task=task)
    steps = p.get("calibrate", 0) * ("lr" not in p and "lr" not in cfg) + p["settle"] + p["measure"]
    bar = tqdm(total=steps, desc=f"{name} seed {seed}", disable=not progress)

    lr, calibrated_kl = cfg.get("lr", p.get("lr")), float("nan")
    if lr is None:  # calibration: KL per step at LR0, its later half (past Adam's first steps)
        model, opt = fresh(init, LR0, seed)
        g = torch.Generator().manual_seed(seed)
        kls = []
        for _ in range(p["calibrate"]):
            kls.append(grpo_step(model, opt, task, g, p["batch"], measure=False)[1])
            bar.update()
        calibrated_kl = float(np.median(kls[len(kls) // 2 :]))
        lr = LR0 * min(max(math.sqrt(KL_TARGET / max(calibrated_kl, 1e-12)), 0.1), 30.0)

    model, opt = fresh(init, lr, seed)
    g = torch.Generator().manual_seed(seed + 1000)
    rows = []
    for step in range(p["settle"] + p["measure"]):
        measured, kl = grpo_step(model, opt, task, g, p["batch"], measure=step >= p["settle"])
        rows += [r | {"step": step, "kl_update": kl} for r in measured]
        bar.update()
        bar.set_postfix(lr=f"{lr:.2g}", kl=f"{kl:.2g}")
    bar.close()
    where = {"setting": name, "varies": cfg["varies"], **shape, "answer_len": task.answer_len, "seed": seed}
    return pd.DataFrame(rows).assign(**where, lr=lr, calibrated_kl=calibrated_kl)


def warm_rewards(p: dict, cache: Path) -> pd.DataFrame:
    """The sampled reward (per answer digit, 128 held-out prompts) of each setting's warm start, per seed: a setting
    whose warm start is at chance (0.1 per digit for sums) measures a policy that has not learned its task."""
    from transformers import AutoModelForCausalLM

    rows = []
    for name in p["settings"]:
        cfg = SETTINGS[name]
        task = Task(*cfg["task"])
        for seed in p["seeds"].get(name, p["seeds"]["default"]):
            shape = {k: cfg[k] for k in ("layers", "experts", "top_k")}
            model = AutoModelForCausalLM.from_pretrained(
                warm_started(cache, **shape, steps=p["warm_steps"], seed=seed, task=task)
            )
            reward = sampled_reward(model, task, n=128, seed=10_000 + seed)
            rows.append({"setting": name, "answer_len": task.answer_len, "seed": seed, "warm_start_reward": reward})
    return pd.DataFrame(rows)


def main() -> None:
    args = parse_args(__doc__, PRESETS, runs=lambda preset: Path(f"runs/scaling_{preset}"))
    p = PRESETS[args.preset]
    if args.replot:
        frame, warm = committed("scaling_steps.csv"), committed("scaling_warm_starts.csv")
        at_chance = frozenset(warm.groupby("setting").warm_start_reward.mean().loc[lambda r: r < LEARNED].index)
        fit = extrapolate(frame)
        write_table(fit, args.out / "scaling_fit.csv")
        publish(summarize(frame), figure(frame, fit, KL_TARGET, at_chance), args.out, "scaling")
        return
    frames = []
    every = sorted({s for seeds in p["seeds"].values() for s in seeds})
    for seed in every:  # seed by seed, so that a partial run already covers every setting
        for name in p["settings"]:
            if seed not in p["seeds"].get(name, p["seeds"]["default"]):
                continue
            done = args.runs / f"{name.replace(' ', '').replace(',', '_')}_seed{seed}.csv"
            if not done.exists():  # resumable: each setting and seed is kept as it finishes
                write_table(probe(name, seed, p, args.runs / WARM_STARTS.name, not args.quiet), done)
            frames.append(pd.read_csv(done))
    name = "scaling" if not args.preset.startswith("gate") else f"scaling_{args.preset}"  # (never the full run's files)
    warm = warm_rewards(p, args.runs / WARM_STARTS.name)
    write_table(warm, args.out / f"{name}_warm_starts.csv")
    at_chance = frozenset(warm.groupby("setting").warm_start_reward.mean().loc[lambda r: r < LEARNED].index)
    columns = ["setting", "varies", "layers", "experts", "top_k", "answer_len", "seed", "lr", "calibrated_kl"]
    frame = pd.concat(frames, ignore_index=True)
    frame = frame[columns + [c for c in frame.columns if c not in columns]]
    write_table(frame, args.out / f"{name}_steps.csv")
    if args.preset.startswith("gate"):  # round 3's gate: its verdict, not the scaling figure
        verdict = gate_verdict(frame, warm)
        write_table(verdict, args.out / f"{name}_verdict.csv")
        print(verdict.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
        return
    summary = summarize(frame)
    fit = extrapolate(frame)
    write_table(fit, args.out / "scaling_fit.csv")
    print(fit.to_string(index=False, float_format=lambda v: f"{v:.3g}"))
    publish(summary, figure(frame, fit, KL_TARGET, at_chance), args.out, "scaling")


if __name__ == "__main__":
    main()
