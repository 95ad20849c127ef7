"""The `[policy]` table of a `TrainConfig`, checked without building a model: its keys against the transformers
config class of its `model_type`, its values by that class, and the counts the model needs."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Collection, Mapping
from typing import Any

from .config_types import nearest, simple, typed

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
            + (nearest(model_type, list(CONFIG_MAPPING)) if isinstance(model_type, str) else "")
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
                else nearest(key, sorted(known))
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
        if simple(hints.get(key)):
            typed(f"policy.{key}", value, hints[key])  # (checked, not converted: the config class takes it as given)
    try:
        config = config_class(**{**base, **fields})
    except Exception as e:  # noqa: BLE001  (transformers' strict-dataclass errors are not ValueErrors)
        raise ValueError(f"policy ({config_class.__name__}): {' '.join(str(e).split())}") from None
    _check_policy_counts(config)


def _check_policy_counts(config: Any) -> None:
    """Counts of the built transformers config >= 1, top-k <= the experts, dense layers among the layers."""
    for name in POLICY_COUNTS:
        value = getattr(config, name, None)
        if value is not None and typed(f"policy.{name}", value, int) < 1:
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
