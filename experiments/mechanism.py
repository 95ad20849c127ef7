"""How much of GRPO's token-ratio noise comes from routing changes: the same update, with and without Routing Replay.

Reproduces the mechanism behind the GSPO paper's MoE argument (Zheng et al. 2025, arXiv 2507.18071, §5.3): after
updates, a token whose experts changed is computed by another sub-network, so its ratio π_θ/π_old jumps for reasons
that are not the policy shift. Here, on each off-policy minibatch (2..μ) of GRPO training, the per-token log-ratio is
computed twice at the *same* weights: routing live, and replaying the experts π_old used. The difference is caused by
routing alone. Reported: the variance of the log-ratio, its 99th percentile, and the share of tokens outside GRPO's
clip band [1 − 0.2, 1 + 0.27], with and without replay.

How it differs from the paper: a tiny Qwen3-MoE (4 layers, 16 experts, top-2) warm-started on 3-digit addition,
16 prompts × 8 answers per step, μ = 4 minibatches, the update itself taken with replay (so both views see the same
weights), on 2 CPU cores.

    python experiments/mechanism.py --preset quick    # 1 learning rate, 2 steps (about a minute)
    python experiments/mechanism.py --preset full     # 3 learning rates x 3 seeds x 5 steps (about 5 minutes)

Writes experiments/results/mechanism.csv and mechanism.png.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch
from matplotlib.figure import Figure

from moe_replay import expert_change, record_routes, teacher_forced_routes
from moe_replay.rl import Task, group_advantages, policy_loss
from moe_replay.rl.loop import answer_logp
from moe_replay.rl.policy import sample_answers

PRESETS = {
    "quick": {"lrs": [1e-3], "seeds": [0], "steps": 2},
    "full": {"lrs": [1e-4, 3e-4, 1e-3], "seeds": [0, 1, 2], "steps": 5},
}
LOW, HIGH = 0.2, 0.27


def run(lr: float, seed: int, steps: int, init: Path) -> list[dict]:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(init)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    task, g = Task("addition", 3), torch.Generator().manual_seed(seed)
    rows = []
    for step in range(steps):
        prompts, answers = task.sample(16, g)
        prompts, answers = prompts.repeat_interleave(8, 0), answers.repeat_interleave(8, 0)
        model.eval()
        with torch.no_grad(), record_routes(model) as rec:
            seq = sample_answers(model, prompts, task.answer_len)
        routes, tp = rec.routes, task.prompt_len
        adv = group_advantages(task.reward(seq[:, tp:], answers), 8)
        with torch.no_grad():
            old = answer_logp(model, seq, tp, routes)
        for j, idx in enumerate(torch.randperm(seq.shape[0], generator=g).chunk(4)):
            if j > 0:  # off-policy: the weights moved since π_old
                model.eval()
                with torch.no_grad():
                    live = answer_logp(model, seq[idx], tp) - old[idx]
                    replayed = answer_logp(model, seq[idx], tp, routes[idx]) - old[idx]
                moved = expert_change(routes[idx], teacher_forced_routes(model, seq[idx]))
                for view, lr_tok in (("live routing", live), ("routing replay", replayed)):
                    ratio = lr_tok.exp()
                    rows.append(
                        {
                            "lr": lr,
                            "seed": seed,
                            "step": step,
                            "minibatch": j,
                            "view": view,
                            "var_log_ratio": float(lr_tok.var()),
                            "p99_abs_log_ratio": float(lr_tok.abs().quantile(0.99)),
                            "outside_clip": float(((ratio < 1 - LOW) | (ratio > 1 + HIGH)).float().mean()),
                            "experts_changed": moved.fraction,
                        }
                    )
            model.train()
            logp = answer_logp(model, seq[idx], tp, routes[idx])
            loss, _ = policy_loss(logp, old[idx], adv[idx], torch.ones_like(logp, dtype=torch.bool))
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", choices=list(PRESETS), default="full")
    ap.add_argument("--out", type=Path, default=Path("experiments/results"))
    ap.add_argument(
        "--init",
        type=Path,
        default=Path("runs/expert_change/init_L4_E16_k2"),
        help="a warm-started policy (made by experiments/expert_change.py if missing)",
    )
    args = ap.parse_args()
    if not (args.init / "config.json").exists():
        from expert_change import warm_policy

        warm_policy(4, 16, 2, 300, args.init.parent)
    p = PRESETS[args.preset]
    rows = [r for lr in p["lrs"] for s in p["seeds"] for r in run(lr, s, p["steps"], args.init)]
    frame = pd.DataFrame(rows)
    args.out.mkdir(parents=True, exist_ok=True)
    frame.to_csv(args.out / "mechanism.csv", index=False)
    summary = frame.groupby(["lr", "view"]).agg(
        var_log_ratio=("var_log_ratio", "mean"),
        p99=("p99_abs_log_ratio", "mean"),
        outside_clip=("outside_clip", "mean"),
        experts_changed=("experts_changed", "mean"),
    )
    print(summary.to_string(float_format=lambda v: f"{v:.4g}"))
    live = summary.xs("live routing", level="view")
    rep = summary.xs("routing replay", level="view")
    print(
        "share of log-ratio variance caused by routing:",
        (1 - rep.var_log_ratio / live.var_log_ratio).round(3).to_dict(),
    )

    fig = Figure(figsize=(9, 3.4), layout="constrained")
    axes = fig.subplots(1, 3)
    lrs = sorted(frame.lr.unique())
    for ax, col, label in zip(
        axes,
        ["var_log_ratio", "p99_abs_log_ratio", "outside_clip"],
        ["variance of token log-ratio", "p99 of |token log-ratio|", "tokens outside clip band (%)"],
        strict=True,
    ):
        for k, view in enumerate(["live routing", "routing replay"]):
            per = frame[frame.view == view].groupby(["lr", "seed"])[col].mean().groupby("lr")
            mean, sd = per.mean(), per.std().fillna(0)
            scale = 100 if col == "outside_clip" else 1
            xs = [i + (k - 0.5) * 0.38 for i in range(len(lrs))]
            ax.bar(xs, mean.values * scale, width=0.38, yerr=sd.values * scale, label=view, capsize=2)
        ax.set_xticks(range(len(lrs)), [f"{lr:g}" for lr in lrs])
        ax.set_xlabel("learning rate")
        ax.set_ylabel(label)
    axes[0].legend(fontsize="small")
    fig.suptitle("GRPO minibatches 2-4: the same weights, routing live vs replayed (mean ± sd over seeds)")
    fig.savefig(args.out / "mechanism.png", dpi=120)
    print(f"wrote {args.out}/mechanism.csv and mechanism.png")


if __name__ == "__main__":
    main()
