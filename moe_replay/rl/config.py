"""Training-run settings, read from a small TOML file."""

from __future__ import annotations

import tomllib
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

REPLAY_MODES = ("off", "rollout", "old_logprob")
LEVELS = ("token", "sequence", "sequence_token")


@dataclass
class TrainConfig:
    """One RL run. `replay`: "off", "rollout" (replay the routes recorded while sampling) or "old_logprob" (record
    them when the old log-probs are recomputed, then replay); `importance_sampling_level`: "token" (GRPO),
    "sequence" (GSPO) or "sequence_token" (GSPO-token).

    Example (a TOML file; every key optional):
        steps = 50
        replay = "rollout"
        importance_sampling_level = "token"
        [policy]
        num_hidden_layers = 4
    """

    output: str = "runs/default"
    seed: int = 0
    task: str = "addition"
    task_size: int = 3
    partial_credit: bool = True
    policy: dict[str, Any] = field(default_factory=dict)
    init: str | None = None  # the warm-started policy (save_pretrained dir), made there if missing; None: <output>/init
    warm_start_steps: int = 300
    warm_start_target: float = 0.35
    warm_start_lr: float = 3e-3
    steps: int = 50
    prompts: int = 16
    group_size: int = 8
    minibatches: int = 4
    lr: float = 1e-4
    max_grad_norm: float = 1.0
    importance_sampling_level: str = "token"
    epsilon_low: float | None = None
    epsilon_high: float | None = None
    replay: str = "off"
    rollout_dtype: str = "float32"
    router_scale: float = 1.0  # multiply the warm-started routers' weights: > 1 sharper routing, < 1 flatter
    diagnostics: bool = True
    checkpoint_every: int = 10

    def __post_init__(self) -> None:
        if self.replay not in REPLAY_MODES:
            raise ValueError(f"replay must be one of {REPLAY_MODES}, got {self.replay!r}")
        if self.importance_sampling_level not in LEVELS:
            raise ValueError(
                f"importance_sampling_level must be one of {LEVELS}, got {self.importance_sampling_level!r}"
            )
        if self.rollout_dtype not in ("float32", "bfloat16"):
            raise ValueError(f"rollout_dtype must be 'float32' or 'bfloat16', got {self.rollout_dtype!r}")
        if not self.router_scale > 0:
            raise ValueError(f"router_scale must be > 0, got {self.router_scale}")
        n = self.prompts * self.group_size
        if self.minibatches < 1 or n % self.minibatches:
            raise ValueError(
                f"minibatches={self.minibatches} must divide prompts x group_size = {self.prompts} x {self.group_size}"
            )

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_config(path: str | Path, **overrides: Any) -> TrainConfig:
    """Read a TOML file into a `TrainConfig`; unknown keys are an error naming them and the known ones.

    Example:
        >>> cfg = load_config("configs/grpo_replay.toml", steps=10)  # doctest: +SKIP
    """
    data = tomllib.loads(Path(path).read_text())
    data.update(overrides)
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(data) - known)
    if unknown:
        raise ValueError(f"{path}: unknown settings {unknown}; known: {sorted(known)}")
    return TrainConfig(**data)
