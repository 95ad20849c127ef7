"""Training-run settings, read from a small TOML file."""

from __future__ import annotations

import difflib
import re
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
    replay); `replay_max_age` N replays only in a step's first N minibatch updates (routes under N updates old),
    later ones routing live; `router_gradient_check` also measures the router gradient a live-routed loss would
    have had (`rl.replay_bias`); `importance_sampling_level`: "token" (GRPO), "sequence" (GSPO) or "sequence_token"
    (GSPO-token).

    The sampler: `rollout_dtype` ("float32", "bfloat16", "float16") after `rollout_weight_quant` ("none",
    "fp8_e4m3", "fp8_e5m2": an engine-like sampler, simulated); `rollout_selection_noise` > 0 makes it pick experts
    by router logits + that std × Gaussian noise while its gating weights stay exact (a sampler that differs only in
    routing: `rl.route_noise`). `old_logprob_source`: π_old from the trainer's
    recompute ("trainer") or the sampler's own log-probs ("sampler"). `sampler_correction` (with
    `sampler_correction_clip_min` / `_clip_max`) weights each token or answer by exp(log p_trainer − log
    p_sampler), truncated or masked, as TRL's `vllm_importance_sampling_mode`; `off_policy_mask_threshold` drops
    negative-advantage answers that drifted further (TRL's name). `heldout_prompts` / `eval_every`: a fixed prompt
    set never trained on, and how often to evaluate on it (greedy and sampled).

    Every setting is checked when the config is made (`config_check.validate`): its type, its range (nothing that
    would crash after the warm start, train backwards or not train at all) and the `policy` keys (fields of the
    transformers config of its `model_type`, or `tiny_moe`'s short names); a ValueError names the setting.

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
    warm_start_target: float | None = 0.35  # the warm start stops at this sampled reward; None: all warm_start_steps
    warm_start_lr: float = 3e-3
    steps: int = 50
    prompts: int = 16
    group_size: int = 8
    minibatches: int = 4
    lr: float = 1e-4
    router_lr: float | None = None  # the routers' own learning rate (a parameter group of their own); None: lr
    lr_warmup_steps: int = 0  # every learning rate rises linearly over the first N steps (lr x step / N); 0: none
    max_grad_norm: float = 1.0  # inf: no clipping (the gradient norm is still logged)
    importance_sampling_level: str = "token"
    epsilon_low: float | None = None
    epsilon_high: float | None = None
    replay: str = "off"
    replay_max_age: int | None = None  # replay only in the first N minibatch updates of a step (later ones: live)
    old_logprob_source: str = "trainer"  # "sampler": keep the sampler's own log-probs as π_old
    sampler_correction: str = "none"  # token_/sequence_ truncate / mask: TRL's vllm_importance_sampling_mode
    sampler_correction_clip_max: float | None = 3.0
    sampler_correction_clip_min: float | None = None
    off_policy_mask_threshold: float | None = None
    rollout_dtype: str = "float32"
    rollout_weight_quant: str = "none"  # "fp8_e4m3" / "fp8_e5m2": round the sampler's weights first (simulated)
    rollout_selection_noise: float = 0.0  # std of noise on the sampler's expert-selection logits (weights exact)
    heldout_prompts: int = 0  # a fixed set of prompts never trained on (0: none, training as before)
    eval_every: int = 0  # evaluate on the held-out prompts every this many steps (0: never)
    router_scale: float = 1.0  # multiply the warm-started routers' weights: > 1 sharper routing, < 1 flatter
    diagnostics: bool = True
    router_gradient_check: bool = False  # replayed minibatches: also the live-routed router gradient (one more pass)
    checkpoint_every: int = 10

    def __post_init__(self) -> None:
        from .config_check import validate

        validate(self)  # types, ranges and the [policy] keys, before any work (rl/config_check.py)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def load_config(path: str | Path, **overrides: Any) -> TrainConfig:
    """Read a TOML file into a `TrainConfig`; a TOML syntax error is a ValueError naming the file and the line, an
    unknown key one naming it and the nearest known one (the values are checked by `TrainConfig` itself).

    Example:
        >>> cfg = load_config("configs/grpo_replay.toml", steps=10)  # doctest: +SKIP
    """
    text = Path(path).read_text()  # (a missing file: FileNotFoundError naming it)
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        # Python 3.14+ has e.lineno / e.colno; before, they are only in the message: "... (at line 3, column 7)"
        found = re.search(r" \(at line (\d+), column (\d+)\)$", str(e))
        line, column = getattr(e, "lineno", None), getattr(e, "colno", None)
        if line is None and found:
            line, column = int(found[1]), int(found[2])
        message = str(e)[: found.start()] if found else str(e)
        where = f", line {line}, column {column}" if line is not None else ""
        raise ValueError(f"{path}{where}: not valid TOML: {message}") from None
    data.update(overrides)
    known = [f.name for f in fields(TrainConfig)]
    unknown = sorted(set(data) - set(known))
    if unknown:
        near = {k: difflib.get_close_matches(k, known, n=1) for k in unknown}
        hints = "; ".join(f"did you mean {m[0]!r} for {k!r}?" for k, m in near.items() if m)
        raise ValueError(f"{path}: unknown settings {unknown}; " + (hints or f"known: {sorted(known)}"))
    try:
        return TrainConfig(**data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from None
