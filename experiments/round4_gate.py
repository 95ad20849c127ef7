"""Round 4's gate (experiments/round4_plan.md), run by `python experiments/decisive.py --preset gate4`: GRPO without
replay from a warm start of all 600 steps (no early stop at a sampled-reward target), every learning rate warmed up
over 20 steps, the routers at their own rate; after the warmup and 5 settling steps, 10 measured steps must show
routing drift, routing's share of the log-ratio noise, and stability. Candidates A, B, C are measured in order and
the first that passes is the round-4 setting.

    python experiments/decisive.py --preset gate4                  # A, then B if A fails, then C if B fails
    python experiments/decisive.py --preset gate4 --candidate B    # one candidate
    python experiments/decisive.py --preset gate4_quick            # seconds: a smoke test of the machinery

Writes <out>/<preset>.csv (per candidate: each figure, its threshold and whether it passes; the row "gate" passes
when all do), <preset>_steps.csv (per step) and <preset>.png.

Example (what decisive.py runs):
    >>> verdict, steps = run_gate("gate4", Path("runs/decisive_gate4"), progress=True)  # doctest: +SKIP
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import pandas as pd
import torch
from common import LEARNED, ROUND3_ARMS, replace_failed_warm_starts, warm_start_heldout
from matplotlib.figure import Figure
from scaling import routing_views
from torch import nn

from moe_replay.rl import Rollout, TrainConfig
from moe_replay.rl.loop import initial_policy, train

# the gate's thresholds (round4_plan.md, "Gate"), fixed before its run
DRIFT_MIN = 0.08  # experts changed per minibatch since the rollout (live routing vs sampled routes), minibatches 2..μ
SHARE_MIN = 0.50  # routing's share of the log-ratio variance, 1 − var(replayed) / var(live), minibatches 2..μ
GRAD_NORM_MAX = 50.0  # no step with a gradient norm (before clipping) above this
HELDOUT_DROP_MAX = 0.05  # held-out reward never more than this below the warm start's
GATE_SEED = 900  # the gate's seed: never used later (the decisive runs use 0.., the pilot 100..102)
HELDOUT = "eval/sampled/reward"
# common to the candidates: pair sums with 16-token answers, Qwen3-MoE of 4 layers (the policy's default) with 16
# experts top-2, a warm start of exactly 600 steps (the plan's: no stop at the loop's sampled-reward target), 8
# prompts x 8 answers, lr 1e-4 but for the routers, every rate warmed up over 20 steps, an fp32 sampler, 256 held-out
# prompts; GRPO without replay
ROUND4 = {
    "task": "pair_sum",
    "task_size": 16,
    "policy": {"num_experts": 16, "num_experts_per_tok": 2},
    "warm_start_steps": 600,
    "warm_start_target": None,  # every warm-start step runs (the loop's default stops at sampled reward 0.35)
    "prompts": 8,
    "group_size": 8,
    "lr": 1e-4,
    "lr_warmup_steps": 20,
    "rollout_dtype": "float32",
    "heldout_prompts": 256,
    **ROUND3_ARMS["GRPO"],
}
CANDIDATES = {
    "A": {"router_lr": 1e-3, "minibatches": 8},
    "B": {"router_lr": 3e-3, "minibatches": 8},
    "C": {"router_lr": 1e-3, "minibatches": 16},  # staler routes per step
}
GATE_PRESETS: dict[str, dict[str, Any]] = {
    "gate4": {"settle": 5, "measure": 10, "eval_every": 5, "learned": LEARNED, "train": {}, "minibatches": {}},
    "gate4_quick": {  # seconds: the machinery, not a measurement (its warm start is at chance: no exclusion)
        "settle": 1,
        "measure": 2,
        "eval_every": 1,
        "learned": 0.0,
        "train": {"warm_start_steps": 10, "prompts": 4, "group_size": 4, "heldout_prompts": 16, "lr_warmup_steps": 2},
        "minibatches": {"A": 2, "B": 2, "C": 4},
    },
}


def gate_config(preset: str, candidate: str, seed: int, runs: Path) -> TrainConfig:
    """The GRPO run of `candidate` at `seed` under `preset`: warmup, settling and measured steps, held-out evaluation
    every few steps, its warm start in `runs/init_seed<seed>_full<warm_start_steps>` (shared by the candidates;
    named apart from the warm starts that stopped at the loop's sampled-reward target).

    Example:
        >>> gate_config("gate4", "A", 900, Path("runs/decisive_gate4")).router_lr
        0.001
    """
    p = GATE_PRESETS[preset]
    settings = ROUND4 | p["train"] | CANDIDATES[candidate]
    settings["minibatches"] = p["minibatches"].get(candidate, settings["minibatches"])
    steps = settings["lr_warmup_steps"] + p["settle"] + p["measure"]
    return TrainConfig(
        output=str(runs / f"grpo_{candidate}_seed{seed}"),
        init=str(runs / f"init_seed{seed}_full{settings['warm_start_steps']}"),
        seed=seed,
        steps=steps,
        eval_every=p["eval_every"],
        checkpoint_every=5,
        **settings,
    )


def observe(model: nn.Module, batch: Rollout, j: int, idx: torch.Tensor) -> dict[str, float]:
    """The loop's observer: on minibatches 2..μ (j >= 1), before each trains, round 3's same-weight views of its
    log-ratio (`scaling.routing_views`: variance routed live and replaying the sampled routes, and the share of its
    own answers' experts that moved); nothing on minibatch 1 (the rollout's weights).

    Example:
        >>> train(cfg, observe=observe)  # doctest: +SKIP
    """
    return {} if j == 0 else routing_views(model, batch, idx)


def figures(cfg: TrainConfig, preset: str, warm: float) -> tuple[list[dict[str, Any]], pd.DataFrame]:
    """The gate's figures of the finished run `cfg` (its steps.csv and minibatches.csv) and the warm start's held-out
    reward `warm`: rows (figure, value, threshold, passes, in_verdict) and the per-step table.

    Example:
        >>> rows, per_step = figures(gate_config("gate4", "A", 900, runs), "gate4", warm=0.37)  # doctest: +SKIP
    """
    p = GATE_PRESETS[preset]
    out = Path(cfg.output)
    steps, mb = pd.read_csv(out / "steps.csv"), pd.read_csv(out / "minibatches.csv")
    first = cfg.lr_warmup_steps + p["settle"] + 1  # the first measured step (1-based)
    window = mb[mb.step >= first]
    later = window[window.minibatch >= 1]
    evals = steps.dropna(subset=[HELDOUT])
    rows = [
        ("drift", later.routes_moved_since_rollout.mean(), DRIFT_MIN, ">=", True),
        ("routing_share", 1 - later.var_replay.mean() / later.var_live.mean(), SHARE_MIN, ">=", True),
        ("max_grad_norm", window.grad_norm.max(), GRAD_NORM_MAX, "<=", True),
        ("heldout_drop", warm - evals[evals.step >= first][HELDOUT].min(), HELDOUT_DROP_MAX, "<=", True),
        # not in the verdict: the same over the whole run, and drift on each minibatch's own answers
        ("max_grad_norm_all_steps", mb.grad_norm.max(), GRAD_NORM_MAX, "<=", False),
        ("heldout_drop_all_evaluations", warm - evals[HELDOUT].min(), HELDOUT_DROP_MAX, "<=", False),
        ("drift_own_answers", later.experts_changed.mean(), DRIFT_MIN, ">=", False),
        ("warm_start_heldout", warm, p["learned"], ">=", False),
    ]
    table = [
        {
            "figure": name,
            "value": value,
            "threshold": threshold,
            "rule": rule,
            "passes": bool(value >= threshold if rule == ">=" else value <= threshold),
            "in_verdict": counted,
        }
        for name, value, threshold, rule, counted in rows
    ]
    g = mb[mb.minibatch >= 1].groupby("step")
    per_step = g[["routes_moved_since_rollout", "experts_changed", "var_live", "var_replay"]].mean()
    per_step["routing_share"] = 1 - per_step.var_replay / per_step.var_live
    per_step["max_grad_norm"] = mb.groupby("step").grad_norm.max()
    keep = ["step", "lr", "lr/routers", "reward_mean", HELDOUT, "policy/kl_consecutive"]
    per_step = steps[keep].merge(per_step.reset_index(), on="step", how="left")
    return table, per_step.assign(measured=per_step.step >= first, warm_start_heldout=warm)


def run_gate(
    preset: str, runs: Path, progress: bool, candidate: str | None = None
) -> tuple[pd.DataFrame, pd.DataFrame]:
    """Measure `candidate`, or A, then B only if A fails, then C only if B fails (the first that passes is the
    round-4 setting), at the gate seed (replaced by the next unused one if its warm start ends below 0.15: the
    exclusion rule). Runs resume if interrupted. Returns the verdict table and the per-step table.

    Example:
        >>> verdict, steps = run_gate("gate4_quick", Path("/tmp/gate"), progress=False)  # doctest: +SKIP
        >>> verdict[verdict.figure == "gate"][["candidate", "passes"]]  # doctest: +SKIP
    """

    @functools.cache
    def warm_reward(seed: int) -> float:
        cfg = gate_config(preset, "A", seed, runs)  # (the candidates share the warm start and held-out prompts)
        return warm_start_heldout(initial_policy(cfg, progress), cfg)

    (seed,), replaced = replace_failed_warm_starts([GATE_SEED], warm_reward, threshold=GATE_PRESETS[preset]["learned"])
    note = "; ".join(f"seed {s} replaced (warm start {r:.3f})" for s, r in replaced.items())
    tables, per_step = [], []
    for name in [candidate] if candidate else list(CANDIDATES):
        cfg = gate_config(preset, name, seed, runs)
        train(cfg, progress=progress, observe=observe)
        rows, steps = figures(cfg, preset, warm_reward(seed))
        counted = [r for r in rows if r["in_verdict"]]
        verdict = {"figure": "gate", "value": sum(r["passes"] for r in counted), "threshold": len(counted)}
        rows.append(verdict | {"rule": "all", "passes": all(r["passes"] for r in counted), "in_verdict": True})
        where = {"candidate": name, "router_lr": cfg.router_lr, "minibatches": cfg.minibatches, "seed": seed}
        where |= {"warm_start_steps": cfg.warm_start_steps, "warm_start_target": cfg.warm_start_target}
        tables.append(pd.DataFrame(rows).assign(**where, note=note))
        per_step.append(steps.assign(candidate=name, router_lr=cfg.router_lr, minibatches=cfg.minibatches))
        if rows[-1]["passes"]:
            break
    table = pd.concat(tables, ignore_index=True)
    first = ["candidate", "router_lr", "minibatches", "seed"]
    table = table[first + [c for c in table.columns if c not in first]]
    return table, pd.concat(per_step, ignore_index=True)


def verdict_line(table: pd.DataFrame) -> str:
    """The gate's verdict in words, from its table: the first candidate that passes, or "not testable".

    Example:
        >>> verdict_line(pd.read_csv("experiments/results/gate4.csv"))  # doctest: +SKIP
        'gate4: candidate A passes (drift 0.1 >= 0.08, ...)'
    """
    lines = []
    for name, part in table.groupby("candidate", sort=True):
        counted = part[part.in_verdict & (part.figure != "gate")]
        figs = ", ".join(
            f"{r.figure} {r.value:.4g} {r.rule} {r.threshold:g} ({'pass' if r.passes else 'FAIL'})"
            for r in counted.itertuples()
        )
        passed = bool(part[part.figure == "gate"].passes.iloc[0])
        lines.append(f"candidate {name}: {'passes' if passed else 'fails'}: {figs}")
    passing = sorted(table[(table.figure == "gate") & table.passes].candidate)
    if passing:
        lines.append(f"verdict: candidate {passing[0]} passes the gate; it is round 4's setting")
    elif set(table.candidate) == set(CANDIDATES):
        lines.append("verdict: all three candidates fail: not testable at this scale on this machine")
    else:
        lines.append(f"verdict: no candidate measured here passes ({', '.join(sorted(set(table.candidate)))})")
    return "\n".join(lines)


def figure(steps: pd.DataFrame) -> Figure:
    """Per candidate over the gate's steps: drift since the rollout, routing's share of the log-ratio variance, the
    largest gradient norm and the held-out reward, each with its threshold; the measured steps shaded.

    Example:
        >>> save_figure(figure(pd.read_csv("experiments/results/gate4_steps.csv")), Path("gate4.png"))  # doctest: +SKIP
    """
    fig = Figure(figsize=(14, 8), layout="constrained")
    axes = fig.subplots(2, 2).ravel()
    measured = steps[steps.measured]
    warm = steps.warm_start_heldout.iloc[0]
    panels = [
        ("routes_moved_since_rollout", 100, "experts changed since the rollout (%, minibatches 2..μ)", DRIFT_MIN * 100,
         f"gate: >= {DRIFT_MIN:.0%}"),
        ("routing_share", 100, "routing's share of the log-ratio variance (%)", SHARE_MIN * 100,
         f"gate: >= {SHARE_MIN:.0%}"),
        ("max_grad_norm", 1, "largest gradient norm in the step (before clipping)", GRAD_NORM_MAX,
         f"gate: <= {GRAD_NORM_MAX:g}"),
        (HELDOUT, 1, "held-out reward per digit (sampled, 256 prompts)", warm - HELDOUT_DROP_MAX,
         f"gate: >= warm start − {HELDOUT_DROP_MAX:g}"),
    ]  # fmt: skip
    for ax, (column, scale, label, threshold, rule) in zip(axes, panels, strict=True):
        for i, (name, part) in enumerate(steps.groupby("candidate", sort=True)):
            part = part.dropna(subset=[column])
            lr, mu = part.router_lr.iloc[0], part.minibatches.iloc[0]
            label_ = f"{name}: router lr {lr:g}, μ {mu}"
            ax.plot(part.step, part[column] * scale, "o-", ms=3, color=f"C{i}", label=label_)
        ax.axhline(threshold, color="k", ls="--", lw=0.8, label=rule)
        if column == HELDOUT:
            ax.axhline(warm, color="k", ls=":", lw=0.8, label=f"warm start {warm:.3f}")
        ax.axvspan(measured.step.min() - 0.5, measured.step.max() + 0.5, color="0.9", zorder=0, label="measured steps")
        ax.set(xlabel="step", ylabel=label)
        ax.legend(fontsize="small")
    axes[2].set_yscale("log")
    fig.suptitle("Round 4's gate: GRPO without replay, pair sums of 16 tokens, 4 layers, 16 experts top-2")
    return fig
