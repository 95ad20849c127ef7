#!/usr/bin/env bash
# Regenerates docs/drift.png and docs/drift.csv: expert change after one Adam step on the demo's tiny Qwen3-MoE.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=$(mktemp -d)
python -c "from moe_replay.cli.demo import tiny_moe; tiny_moe().save_pretrained('$dir/tiny-moe')"
moe-replay drift "$dir/tiny-moe" --batch 16 --length 64 --lr "${LR:-1e-4}" --plot docs/drift.png --csv docs/drift.csv
