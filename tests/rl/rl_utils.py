"""What the RL tests share (the warm-started policy fixture, `init`, is in conftest.py): the small policy shape, the
small run and its `TrainConfig`."""

from __future__ import annotations

from typing import Any

from moe_replay.rl.config import TrainConfig

SMALL = {"num_hidden_layers": 2, "hidden_size": 32, "head_dim": 8, "moe_intermediate_size": 16, "num_experts": 8}
RUN = {"task_size": 2, "prompts": 4, "group_size": 4, "minibatches": 2}  # 2-digit sums, 4 prompts x 4 answers, μ 2


def config(tmp_path: Any, init: str | None, **kw: Any) -> TrainConfig:
    """A 3-step `RUN` from `init` into `tmp_path / "run"`, checkpointed every 2 steps; `kw` overrides any setting."""
    base = dict(output=str(tmp_path / "run"), init=init, steps=3, checkpoint_every=2, **RUN)
    return TrainConfig(**{**base, **kw})
