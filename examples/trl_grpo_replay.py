"""GRPO with TRL's GRPOTrainer on a tiny Qwen3-MoE (CPU, a few minutes), with each `routing_replay` setting.

The task is verifiable: the prompt is "a+b=" and the reward is 1 for the right sum, plus partial credit for the
share of the completion that is digits (so that a random model gets a signal at all). The model is a random
4-layer, 16-expert, top-2 Qwen3-MoE from a config; the point is the three lines a TRL user changes, and the routing
metrics TRL now logs.

    python examples/trl_grpo_replay.py                 # None, "rollout" (R3) and "old_logprob" (R2), 40 steps each
    python examples/trl_grpo_replay.py --steps 40 --modes rollout
"""

from __future__ import annotations

import argparse
import random
import tempfile

from datasets import Dataset
from trl import GRPOConfig

from moe_replay.integrations.trl import RoutingReplayGRPOTrainer
from moe_replay.tiny import tiny_moe, tiny_tokenizer


def sums_dataset(n: int, seed: int = 0) -> Dataset:
    rng = random.Random(seed)
    pairs = [(rng.randrange(50), rng.randrange(50)) for _ in range(n)]
    return Dataset.from_dict({"prompt": [f"{a}+{b}=" for a, b in pairs], "answer": [str(a + b) for a, b in pairs]})


def sum_reward(completions: list[str], answer: list[str], **_: object) -> list[float]:
    """1.0 for exactly the right sum, plus the share of the completion's characters that are digits."""
    return [
        float(c.strip() == a) + sum(ch.isdigit() for ch in c) / max(len(c), 1)
        for c, a in zip(completions, answer, strict=True)
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--modes", nargs="+", default=["none", "rollout", "old_logprob"])
    opts = parser.parse_args()
    for mode in opts.modes:
        model = tiny_moe(0, router_std=0.5)  # 4 layers, 16 experts, top-2, vocab 64
        model.generation_config.eos_token_id = 1
        args = GRPOConfig(
            output_dir=tempfile.mkdtemp(),
            per_device_train_batch_size=8,
            num_generations=8,
            max_completion_length=4,
            num_iterations=2,  # 2 updates per generation: old log-probs are computed, so R2 has something to replay
            max_steps=opts.steps,
            learning_rate=1e-2,
            beta=0.0,
            logging_steps=10,
            report_to=[],
            use_cpu=True,
            save_strategy="no",
            seed=0,
        )
        trainer = RoutingReplayGRPOTrainer(
            model=model,
            reward_funcs=sum_reward,
            args=args,
            train_dataset=sums_dataset(256),
            processing_class=tiny_tokenizer(),
            routing_replay=None if mode == "none" else mode,  # the one argument
        )
        trainer.train()
        rows = [row for row in trainer.state.log_history if "reward" in row]
        print(f"\nrouting_replay={mode!r}")
        for row in rows:
            moved = row.get("routing/routes_moved_since_rollout")
            mismatch = row.get("routing/mismatch/fraction")
            print(
                f"  step {row['step']:3d}  reward {row['reward']:.3f}"
                + (f"  routes_moved_since_rollout {moved:.4f}" if moved is not None else "")
                + (f"  mismatch {mismatch:.4f}" if mismatch is not None else "")
            )


if __name__ == "__main__":
    main()
