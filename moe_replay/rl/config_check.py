"""Validation of `TrainConfig` settings before any work: types from the dataclass annotations (config_types.py),
ranges (here), and the `[policy]` table's keys and values (policy_check.py, without building a model).

Every refusal is a ValueError naming the setting, the value as given and what it must be.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .config_types import check_types, nearest
from .policy_check import check_policy

if TYPE_CHECKING:
    from .config import TrainConfig

COUNTS = ("steps", "prompts", "checkpoint_every", "warm_start_steps")  # >= 1
MAX_SEED = 2**62  # torch.manual_seed takes 64-bit seeds, and the loop adds offsets to them


def validate(cfg: TrainConfig) -> None:
    """Check every setting of `cfg` (types, then ranges, then `policy`), converting an int given for a float
    setting (and a path for `output` / `init`) in place; raises ValueError naming the first bad setting.

    Example:
        >>> validate(TrainConfig(lr=-1e-4))  # doctest: +SKIP
        ValueError: lr must be > 0, got -0.0001
    """
    check_types(cfg)
    check_ranges(cfg)
    check_policy(cfg.policy, top_level=[f.name for f in dataclasses.fields(cfg)])


def check_ranges(cfg: TrainConfig) -> None:
    """Refuse settings with which a run would crash after its warm start, train backwards, or not train at all.

    Example:
        >>> check_ranges(TrainConfig(sampler_correction_clip_min=4.0))  # doctest: +SKIP
        ValueError: sampler_correction_clip_min=4.0 must be below sampler_correction_clip_max=3.0
    """
    from .config import LEVELS, REPLAY_MODES
    from .losses import clip_range
    from .sampler import CORRECTIONS, DTYPES, QUANT
    from .tasks import Task

    choices = {
        "replay": REPLAY_MODES,
        "importance_sampling_level": LEVELS,
        "rollout_dtype": DTYPES,
        "rollout_weight_quant": QUANT,
        "sampler_correction": CORRECTIONS,
        "old_logprob_source": ("trainer", "sampler"),
    }
    for key, allowed in choices.items():
        if getattr(cfg, key) not in allowed:
            raise ValueError(
                f"{key} must be one of {list(allowed)}, got {getattr(cfg, key)!r}{nearest(getattr(cfg, key), allowed)}"
            )
    if not cfg.output:
        raise ValueError(f"output must name a directory, got {cfg.output!r}")
    if not abs(cfg.seed) < MAX_SEED:
        raise ValueError(f"seed must be a torch seed, |seed| < 2**62, got {cfg.seed}")
    try:
        task = Task(cfg.task, cfg.task_size)
    except ValueError as e:
        raise ValueError(f"task={cfg.task!r}, task_size={cfg.task_size}: {e}") from None
    for key in COUNTS:
        if getattr(cfg, key) < 1:
            raise ValueError(f"{key} must be >= 1, got {getattr(cfg, key)}")
    if cfg.group_size < 2:
        raise ValueError(
            f"group_size must be >= 2, got {cfg.group_size}: advantages are relative to a group's other answers, "
            "so one answer per prompt gives every advantage 0 and nothing is learned"
        )
    n = cfg.prompts * cfg.group_size
    if cfg.minibatches < 1 or n % cfg.minibatches:
        raise ValueError(
            f"minibatches={cfg.minibatches} must divide prompts x group_size = {cfg.prompts} x {cfg.group_size}"
        )
    for key in ("lr", "warm_start_lr", "router_scale"):
        _positive(key, getattr(cfg, key))
    if cfg.router_lr is not None:
        _positive("router_lr", cfg.router_lr)
    if cfg.lr_warmup_steps < 0:
        raise ValueError(f"lr_warmup_steps must be >= 0 (0: no warmup), got {cfg.lr_warmup_steps}")
    if not 0 <= cfg.rollout_selection_noise < math.inf:
        raise ValueError(f"rollout_selection_noise must be a finite std >= 0, got {cfg.rollout_selection_noise}")
    age = cfg.replay_max_age
    if age is not None and (isinstance(age, bool) or not isinstance(age, int)):
        raise ValueError(f"replay_max_age must be an int (minibatch updates) or None, got {age!r}")
    if age is not None and (cfg.replay == "off" or age < 1):
        raise ValueError(f"replay_max_age={cfg.replay_max_age} needs replay on and >= 1 (got replay={cfg.replay!r})")
    family = cfg.policy.get("model_type", "qwen3_moe")
    if cfg.rollout_selection_noise and family != "qwen3_moe":
        raise ValueError(f"rollout_selection_noise perturbs Qwen3-MoE's router (the default policy), not {family!r}")
    if not cfg.max_grad_norm > 0:
        raise ValueError(
            f"max_grad_norm must be > 0, got {cfg.max_grad_norm}: clipping to a negative norm flips every gradient "
            "(the optimizer then climbs the loss) and to 0 zeroes it; for no clipping use inf"
        )
    if cfg.warm_start_target is not None and not 0 < cfg.warm_start_target <= 1:
        raise ValueError(
            f"warm_start_target must be a reward in (0, 1] or None (all warm_start_steps), got {cfg.warm_start_target}"
        )
    clip_range(cfg.importance_sampling_level, cfg.epsilon_low, cfg.epsilon_high)  # (its own message names both)
    _check_correction(cfg)
    if cfg.off_policy_mask_threshold is not None and math.isnan(cfg.off_policy_mask_threshold):
        raise ValueError(
            "off_policy_mask_threshold must be a number or None, got nan: it would drop every answer "
            "with a negative advantage"
        )
    for key in ("heldout_prompts", "eval_every"):
        if getattr(cfg, key) < 0:
            raise ValueError(f"{key} must be >= 0 (0: none), got {getattr(cfg, key)}")
    if cfg.eval_every and not cfg.heldout_prompts:
        raise ValueError(f"eval_every={cfg.eval_every} needs held-out prompts: set heldout_prompts > 0")
    space = task.prompt_space
    if cfg.heldout_prompts > space // 2:
        raise ValueError(
            f"heldout_prompts={cfg.heldout_prompts} is over half of the {space} distinct prompts of task "
            f"{task.kind!r} with task_size={task.size}: at most {space // 2}"
        )


def _check_correction(cfg: TrainConfig) -> None:
    """The sampler correction's bounds: positive, min below max, and for a mask a band holding 1 (on-policy)."""
    lo, hi = cfg.sampler_correction_clip_min, cfg.sampler_correction_clip_max
    for key, value in (("sampler_correction_clip_min", lo), ("sampler_correction_clip_max", hi)):
        if value is not None and not value > 0:
            raise ValueError(
                f"{key} must be > 0 or None (no bound), got {value}: the correction weights exp(log p_trainer - "
                "log p_sampler) are positive, and a bound <= 0 zeroes them or flips the loss's sign"
            )
    if lo is not None and hi is not None and not lo < hi:
        raise ValueError(
            f"sampler_correction_clip_min={lo} must be below sampler_correction_clip_max={hi}: a mask between them "
            "zeroes every weight (nothing is trained), a truncation to them makes every weight the same"
        )
    if cfg.sampler_correction.endswith("mask") and not ((lo is None or lo <= 1) and (hi is None or hi >= 1)):
        raise ValueError(
            f"sampler_correction={cfg.sampler_correction!r} with sampler_correction_clip_min={lo} and "
            f"sampler_correction_clip_max={hi}: the band must hold 1, else every token the sampler and the trainer "
            "agree on (weight 1) is masked"
        )


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def check_resumable(saved: Path, config: dict[str, Any]) -> None:
    """Raise ValueError if the run saved in `saved` (its config.json) was started with other settings than `config`
    in anything but `steps`: resuming it would continue the old run while its log said otherwise.

    Example:
        >>> check_resumable(Path("runs/grpo/config.json"), cfg.to_dict())  # doctest: +SKIP
    """
    if not saved.exists():
        return
    before, now = json.loads(saved.read_text()), json.loads(json.dumps(config))
    # (`output` names where the run is, however it is spelled or wherever it was moved: not a setting)
    changed = [k for k in before if k in now and k not in ("steps", "output") and before[k] != now[k]]
    if changed:
        diff = ", ".join(f"{k}={before[k]!r} (now {now[k]!r})" for k in changed)
        raise ValueError(
            f"{saved.parent} holds a run started with {diff}: resume it with the same settings (only steps may "
            "change), or start over (resume=False, `moe-replay train --fresh`), or write to another output"
        )
