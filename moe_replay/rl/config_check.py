"""Validation of `TrainConfig` settings before any work: types from the dataclass annotations, ranges, and the
`[policy]` table's keys and values (checked against the transformers config class, without building a model).

Every refusal is a ValueError naming the setting, the value as given and what it must be.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import numbers
import os
import types
import typing
from collections.abc import Collection, Mapping
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .config import TrainConfig

PATH_FIELDS = ("output", "init")  # str settings that also take an os.PathLike (stored as str)
COUNTS = ("steps", "prompts", "checkpoint_every", "warm_start_steps")  # >= 1
# `tiny_moe` keyword arguments that are not transformers config fields (its short names are `tiny.SHORTHAND`)
TINY_KWARGS = ("router_std", "experts_implementation")
# attributes transformers' models read from their config with a default, no config field (Qwen3-MoE's head_dim)
READ_WITH_DEFAULT = ("head_dim",)
# keyword arguments every transformers config takes besides its dataclass fields
CONFIG_KWARGS = ("model_type", "attn_implementation", "output_attentions")
# config fields `build_policy` sets from the task itself (a value given in [policy] would be overwritten, unsaid)
SET_BY_RUN = ("vocab_size", "pad_token_id", "bos_token_id", "eos_token_id", "output_router_logits")
# policy config fields that count something: a transformers config takes 0 or -1 and the model fails later, or is empty
POLICY_COUNTS = (
    *("num_hidden_layers", "hidden_size", "intermediate_size", "moe_intermediate_size", "num_attention_heads"),
    *("num_key_value_heads", "head_dim", "num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok"),
)
EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts")  # a family's name for its experts
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


def check_types(cfg: Any) -> None:
    """Check each field of the dataclass instance `cfg` against its annotation (int, float, bool, str, dict, or one
    of them | None): a bool is not a number, an int is taken for a float (converted), a float is never taken for an
    int (not even 3.0: a computed count would be truncated unsaid), and a string is never taken for a number or a
    bool. Converts in place; raises ValueError naming the field, the value and the type expected.

    Example:
        >>> check_types(TrainConfig(steps=50.0))  # doctest: +SKIP
        ValueError: steps must be an int, got 50.0 (a float): write 50
    """
    hints = typing.get_type_hints(type(cfg))
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if f.name in PATH_FIELDS and isinstance(value, os.PathLike):
            value = os.fspath(value)
        setattr(cfg, f.name, _typed(f.name, value, hints[f.name]))


def _typed(name: str, value: Any, hint: Any) -> Any:
    """`value` as the annotation `hint` wants it (int -> float), or ValueError."""
    options = (
        typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union else ()
    )
    if options:
        if value is None and type(None) in options:
            return None
        (hint,) = [o for o in options if o is not type(None)]
    kind = typing.get_origin(hint) or hint
    if kind is bool and isinstance(value, bool):
        return value
    if kind is int and isinstance(value, numbers.Integral) and not isinstance(value, bool):
        return int(value)
    if kind is float and isinstance(value, numbers.Real) and not isinstance(value, bool):
        return float(value)
    if kind is str and isinstance(value, str):
        return value
    if kind not in (bool, int, float, str, dict) and isinstance(kind, type) and isinstance(value, kind):
        return value
    if kind is dict and isinstance(value, Mapping):
        bad = [k for k in value if not isinstance(k, str)]
        if bad:
            raise ValueError(f"{name} keys must be strings, got {bad[0]!r} in {dict(value)!r}")
        return dict(value)
    names = {bool: "a bool", int: "an int", float: "a number", str: "a string", dict: "a table (a dict)"}
    expected = names.get(kind, getattr(kind, "__name__", str(kind)))
    if options:
        expected += " or None"
    hint_text = ""
    if isinstance(value, str) and kind in (int, float, bool):
        hint_text = ": write it without quotes"
    elif kind is int and isinstance(value, float):
        hint_text = f": write {int(value)}" if value.is_integer() else ": a count must be a whole number"
    got = type(value).__name__
    raise ValueError(
        f"{name} must be {expected}, got {value!r} ({'an' if got[0] in 'aeiou' else 'a'} {got}){hint_text}"
    )


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
                f"{key} must be one of {list(allowed)}, got {getattr(cfg, key)!r}{_nearest(getattr(cfg, key), allowed)}"
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
    if not 0 < cfg.warm_start_target <= 1:
        raise ValueError(f"warm_start_target must be a reward in (0, 1], got {cfg.warm_start_target}")
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


def check_policy(policy: Mapping[str, Any], top_level: Collection[str] = ()) -> None:
    """Check the `[policy]` table without building a model: every key a field of the transformers config class of
    its `model_type` (Qwen3-MoE by default), one of `tiny_moe`'s short names (`tiny.SHORTHAND`; Qwen3-MoE only) or
    its `router_std` / `experts_implementation`, unknown ones refused with the nearest valid name; the values
    type-checked by that config class; the counts >= 1 and top-k at most the experts. `top_level`: the run's own
    setting names (a TOML key written after `[policy]` belongs to that table).

    Example:
        >>> check_policy({"num_expert": 8})
        Traceback (most recent call last):
        ValueError: policy: unknown setting 'num_expert' for a 'qwen3_moe' policy: did you mean 'num_experts'?
    """
    if not policy:
        return
    from transformers import CONFIG_MAPPING

    from ..tiny import SHORTHAND
    from .policy import DEFAULT_POLICY

    model_type = policy.get("model_type", DEFAULT_POLICY["model_type"])
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ValueError(
            f"policy.model_type must be a transformers model type, got {model_type!r}"
            + (_nearest(model_type, list(CONFIG_MAPPING)) if isinstance(model_type, str) else "")
        )
    config_class = CONFIG_MAPPING[model_type]
    default_family = model_type == DEFAULT_POLICY["model_type"]
    known = _config_fields(config_class) | set(READ_WITH_DEFAULT) | set(CONFIG_KWARGS) | set(TINY_KWARGS)
    known |= set(SHORTHAND) if default_family else set()
    for key in policy:
        if key not in known:
            hint = (
                f": {key!r} is a run setting; a TOML key written after [policy] belongs to that table, move it above"
                if key in top_level
                else _nearest(key, sorted(known))
            )
            raise ValueError(f"policy: unknown setting {key!r} for a {model_type!r} policy{hint}")
        if key in SET_BY_RUN or SHORTHAND.get(key) in SET_BY_RUN:
            raise ValueError(f"policy.{key}={policy[key]!r}: set by the run (the task's vocabulary), not by [policy]")
    base = {k: v for k, v in DEFAULT_POLICY.items() if k != "model_type"} if default_family else {}
    fields = {k: v for k, v in policy.items() if k not in ("model_type", *TINY_KWARGS)}
    for short in [k for k in fields if k in SHORTHAND]:
        name = SHORTHAND[short]
        if name in fields or name in base:
            raise ValueError(
                f"policy.{short}={fields[short]!r} (tiny_moe's short name for {name}) sets {name} twice: the "
                f"{'table' if name in fields else 'default policy'} sets it too; write {name} = {fields[short]!r}"
            )
        fields[name] = fields.pop(short)
    std = policy.get("router_std")
    if std is not None and (isinstance(std, bool) or not isinstance(std, numbers.Real) or not std > 0):
        raise ValueError(f"policy.router_std must be a number > 0, got {std!r}")
    impl = policy.get("experts_implementation")
    if impl is not None and not isinstance(impl, str):
        raise ValueError(f"policy.experts_implementation must be a string, got {impl!r}")
    hints = {f.name: f.type for f in dataclasses.fields(config_class)} if dataclasses.is_dataclass(config_class) else {}
    for key, value in fields.items():
        if _simple(hints.get(key)):
            _typed(f"policy.{key}", value, hints[key])  # (checked, not converted: the config class takes it as given)
    try:
        config = config_class(**{**base, **fields})
    except Exception as e:  # noqa: BLE001  (transformers' strict-dataclass errors are not ValueErrors)
        raise ValueError(f"policy ({config_class.__name__}): {' '.join(str(e).split())}") from None
    _check_policy_counts(config)


def _check_policy_counts(config: Any) -> None:
    """Counts of the built transformers config >= 1, top-k <= the experts, dense layers among the layers."""
    for name in POLICY_COUNTS:
        value = getattr(config, name, None)
        if value is not None and _typed(f"policy.{name}", value, int) < 1:
            raise ValueError(f"policy.{name} must be >= 1, got {value}")
    experts = next((getattr(config, n) for n in EXPERT_COUNTS if getattr(config, n, None) is not None), None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if experts is not None and top_k is not None and top_k > experts:
        raise ValueError(f"policy.num_experts_per_tok={top_k} is more than the {experts} experts")
    layers, dense = getattr(config, "num_hidden_layers", None), getattr(config, "mlp_only_layers", None) or []
    outside = [i for i in dense if layers is not None and not 0 <= i < layers]
    if outside:
        raise ValueError(
            f"policy.mlp_only_layers (dense_layers) {list(dense)}: {outside} not among the layers 0..{layers - 1}"
        )


def _config_fields(config_class: type) -> set[str]:
    """The settings a transformers config class takes: its dataclass fields (or `__init__` arguments) and aliases."""
    import inspect

    if dataclasses.is_dataclass(config_class):
        names = {f.name for f in dataclasses.fields(config_class)}
    else:
        params = inspect.signature(config_class.__init__).parameters.values()
        names = {p.name for p in params if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL) and p.name != "self"}
    return names | set(getattr(config_class, "attribute_map", {}))


def _simple(hint: Any) -> bool:
    """Whether `_typed` checks `hint`: int, float, bool or str, or one of them | None (not a string annotation)."""
    options = typing.get_args(hint) if isinstance(hint, types.UnionType) else (hint,)
    kinds = [o for o in options if o is not type(None)]
    return len(kinds) == 1 and kinds[0] in (bool, int, float, str)


def _positive(name: str, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def _nearest(word: object, names: Collection[str]) -> str:
    """': did you mean X?' for the valid name nearest `word`, or ''."""
    if not isinstance(word, str):
        return ""
    match = difflib.get_close_matches(word, list(names), n=1)
    return f": did you mean {match[0]!r}?" if match else ""
