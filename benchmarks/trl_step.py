"""What `routing_replay="rollout"` costs inside TRL's GRPOTrainer: the median training step (generation with recording,
the replayed old-log-prob pass, the replayed loss forward and backward) against `routing_replay=None`, with an A/A
row (None against None) for the timing noise. Writes benchmarks/results_trl.csv (or --csv).

    python benchmarks/trl_step.py            # the realistic model (8 layers, hidden 512, 64 experts, top-8)
    python benchmarks/trl_step.py --quick    # fewer, shorter runs
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
from datasets import Dataset
from run import REALISTIC, write_rows  # the benchmark's realistic model (benchmarks/run.py, beside this script)
from transformers import TrainerCallback
from trl import GRPOConfig

from moe_replay.integrations.trl import RoutingReplayGRPOTrainer
from moe_replay.tiny import tiny_moe, tiny_tokenizer


class StepTimes(TrainerCallback):
    """Wall time of every optimizer step (generation included: TRL generates inside the step)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def on_step_begin(self, *_: object, **__: object) -> None:
        self._t0 = time.perf_counter()

    def on_step_end(self, *_: object, **__: object) -> None:
        self.times.append(time.perf_counter() - self._t0)


def run(mode: str | None, steps: int, new: int, batch: int) -> list[float]:
    """The step times of `steps` GRPO steps on a fresh realistic model (seed 0), the first (warm-up) dropped."""
    model = tiny_moe(0, vocab=64, router_std=0.5, experts_implementation="grouped_mm", **REALISTIC)
    model.generation_config.eos_token_id = None  # every completion runs to max_completion_length: equal work
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=batch,
        num_generations=8,
        max_completion_length=new,
        num_iterations=2,
        max_steps=steps + 1,
        learning_rate=1e-5,
        beta=0.0,
        report_to=[],
        use_cpu=True,
        save_strategy="no",
        seed=0,
        disable_tqdm=True,
        logging_steps=1000,
    )
    ds = Dataset.from_dict({"prompt": [f"{i}+{i + 7}=" for i in range(256)]})
    times = StepTimes()
    trainer = RoutingReplayGRPOTrainer(
        model=model,
        reward_funcs=lambda completions, **_: [float(len(c)) for c in completions],
        args=args,
        train_dataset=ds,
        processing_class=tiny_tokenizer(),
        routing_replay=mode,
        callbacks=[times],
    )
    trainer.train()
    return times.times[1:]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--csv", type=Path, default=None)
    opts = ap.parse_args()
    rounds, steps, new, batch = (2, 2, 16, 8) if opts.quick else (3, 2, 32, 16)
    torch.set_num_threads(torch.get_num_threads())
    arms: dict[str, list[float]] = {"rollout": [], "none": [], "none (A/A)": []}
    for r in range(rounds):  # alternate the arms, flipping the order each round
        order = list(arms) if r % 2 == 0 else list(reversed(arms))
        for arm in order:
            arms[arm] += run(None if arm.startswith("none") else arm, steps, new, batch)
            print(f"  round {r + 1}/{rounds} {arm}: median step {statistics.median(arms[arm]):.3f} s", flush=True)
    base = statistics.median(arms["none"])
    rows = [
        {
            "metric": f"GRPOTrainer step, routing_replay='rollout', 8L h512 E64 k8, B{batch}, {new} new",
            "ours": statistics.median(arms["rollout"]),
            "baseline": base,
            "target": "ratio <= 1.03",
        },
        {
            "metric": "  noise floor: routing_replay=None against itself",
            "ours": statistics.median(arms["none (A/A)"]),
            "baseline": base,
            "target": "(A/A)",
        },
    ]
    for row in rows:
        row["ratio"] = row["ours"] / row["baseline"]
        print(f"{row['metric']}: {row['ours']:.3f} vs {row['baseline']:.3f} s (ratio {row['ratio']:.3f})")
    path = opts.csv or Path(__file__).with_name("results_trl_quick.csv" if opts.quick else "results_trl.csv")
    write_rows(path, rows, ["metric", "ours", "baseline", "ratio", "target"])


if __name__ == "__main__":
    main()
