"""One rank of the 2-process TRL test (launched by test_trl_distributed.py with torch.distributed env vars)."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from trl_utils import agreement, make, same_routes_before


def main(out: str) -> None:
    trainer = make(Path(out) / "run", "rollout", max_steps=2, steps_per_generation=2)
    trainer.train()
    rank = trainer.accelerator.process_index
    used = []
    for replayed, rec in trainer.used:
        m = replayed.mask
        used.append(bool(m.any()) and torch.equal(rec.indices.sort(-1).values[m], replayed.indices.sort(-1).values[m]))
    agree, shifted, logps = [], [], []
    for gen in trainer.generated:
        agree.append(agreement(gen))
        shifted.append(agreement(gen, shift=1))
        ok = same_routes_before(gen) & gen["completion_mask"].bool()  # (all, unless a near-tie swapped)
        logps.append(float((gen["old_per_token_logps"] - gen["live_logps"])[ok].abs().max()))
    result = {
        "rank": rank,
        "world": trainer.accelerator.num_processes,
        "used": used,
        "agree": agree,
        "shifted": shifted,
        "logps": logps,
        "prompts": [row.tolist() for gen in trainer.generated for row in gen["prompt_ids"]],
        "moved": [r.get("routing/routes_moved_since_rollout") for r in trainer.state.log_history],
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    if torch.distributed.is_initialized():  # left to the interpreter's exit, gloo's threads can abort it (CI saw
        torch.distributed.barrier()  # "terminate called without an active exception" once)
        torch.distributed.destroy_process_group()
    # Freeing the trainer can still hang: its DDP reducer's process group joins a gloo thread that waits for the GIL
    # (to free a tensor) while the freeing thread holds it (seen once, stack read with py-spy). The results are
    # written and the group is gone: leave without tearing anything down.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main(sys.argv[1])
