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
    """One RL run. `replay`: "off", "rollout" (R3: replay the routes recorded while sampling) or "old_logprob" (R2,
    the GSPO paper's Routing Replay: record them in the trainer's no-grad forward at the sampling weights, then
    replay); `importance_sampling_level`: "token" (GRPO), "sequence" (GSPO) or "sequence_token" (GSPO-token).

    The sampler: `rollout_dtype` ("float32", "bfloat16", "float16") after `rollout_weight_quant` ("none",
    "fp8_e4m3", "fp8_e5m2": an engine-like sampler, simulated). `old_logprob_source`: π_old from the trainer's
    recompute ("trainer") or the sampler's own log-probs ("sampler"). `sampler_correction` (with
    `sampler_correction_clip_min` / `_clip_max`) weights each token or answer by exp(log p_trainer − log
    p_sampler), truncated or masked, as TRL's `vllm_importance_sampling_mode`; `off_policy_mask_threshold` drops
    negative-advantage answers that drifted further (TRL's name). `heldout_prompts` / `eval_every`: a fixed prompt
    set never trained on, and how often to evaluate on it (greedy and sampled).

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
    old_logprob_source: str = "trainer"  # "sampler": keep the sampler's own log-probs as π_old
    sampler_correction: str = "none"  # token_/sequence_ truncate / mask: TRL's vllm_importance_sampling_mode
    sampler_correction_clip_max: float | None = 3.0
    sampler_correction_clip_min: float | None = None
    off_policy_mask_threshold: float | None = None
    rollout_dtype: str = "float32"
    rollout_weight_quant: str = "none"  # "fp8_e4m3" / "fp8_e5m2": round the sampler's weights first (simulated)
    heldout_prompts: int = 0  # a fixed set of prompts never trained on (0: none, training as before)
    eval_every: int = 0  # evaluate on the held-out prompts every this many steps (0: never)
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
        from .sampler import CORRECTIONS, DTYPES, QUANT

        choices = {
            "rollout_dtype": DTYPES,
            "rollout_weight_quant": QUANT,
            "sampler_correction": CORRECTIONS,
            "old_logprob_source": ("trainer", "sampler"),
        }
        for key, allowed in choices.items():
            if getattr(self, key) not in allowed:
                raise ValueError(f"{key} must be one of {list(allowed)}, got {getattr(self, key)!r}")
        if self.eval_every and not self.heldout_prompts:
            raise ValueError(f"eval_every={self.eval_every} needs held-out prompts: set heldout_prompts > 0")
        if self.eval_every < 0 or self.heldout_prompts < 0:
            raise ValueError("eval_every and heldout_prompts must be >= 0")
        if not self.router_scale > 0:
            raise ValueError(f"router_scale must be > 0, got {self.router_scale}")
        for key in ("steps", "prompts", "checkpoint_every", "warm_start_steps"):
            if getattr(self, key) < 1:
                raise ValueError(f"{key} must be >= 1, got {getattr(self, key)}")
        if self.group_size < 2:
            raise ValueError(
                f"group_size must be >= 2, got {self.group_size}: advantages are relative to a group's other answers, "
                "so one answer per prompt gives every advantage 0 and nothing is learned"
            )
        from .losses import clip_range

        clip_range(self.importance_sampling_level, self.epsilon_low, self.epsilon_high)  # (before the warm start)
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
