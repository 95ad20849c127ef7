#!/usr/bin/env bash
# Regenerates experiments/results/six_arms.csv: 50 steps of each of the six example configs (one seed, the shared
# warm start runs/init), and the columns of docs/rl.md's "Six arms, 50 steps" table. About 5 minutes on 2 CPU cores.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d)
arms="grpo grpo_replay grpo_replay_oldlp gspo gspo_replay gspo_token"
for c in $arms; do
  moe-replay train --config "configs/$c.toml" --output "$dir/$c" --fresh --quiet
done
python - "$dir" $arms <<'PY'
import sys
from pathlib import Path

import pandas as pd

root, arms = Path(sys.argv[1]), sys.argv[2:]
rows = []
for arm in arms:
    log = pd.read_csv(root / arm / "steps.csv")
    rows.append({
        "config": arm,
        "seconds_per_step_median": log.seconds.median(),
        "reward_first_step": log.reward_mean.iloc[0],
        "reward_last_10_steps": log.reward_mean.tail(10).mean(),
        "clipped_tokens": log["clip_ratio/region_mean"].mean(),
        "expert_change_per_update": log.expert_change.mean(),
    })
table = pd.DataFrame(rows)
table.to_csv("experiments/results/six_arms.csv", index=False)
print(table.to_string(index=False, float_format=lambda v: f"{v:.4g}"))
PY
