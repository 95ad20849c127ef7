#!/usr/bin/env bash
# Regenerates docs/drift.png and experiments/results/drift.csv (lr 1e-4) and experiments/results/drift_lr1e-3.csv:
# expert change after one Adam step on the demo's tiny Qwen3-MoE (docs/analysis.md shows the figure, quotes both CSVs).
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d)
python -c "from moe_replay.cli.demo import tiny_moe; tiny_moe().save_pretrained('$dir/tiny-moe')"
moe-replay drift "$dir/tiny-moe" --batch 16 --length 64 --lr "${LR:-1e-4}" --plot docs/drift.png \
  --csv experiments/results/drift.csv
# the same step at lr 1e-3 (the figure's text quotes its overall fraction): experiments/results/drift_lr1e-3.csv
moe-replay drift "$dir/tiny-moe" --batch 16 --length 64 --lr 1e-3 --csv experiments/results/drift_lr1e-3.csv
