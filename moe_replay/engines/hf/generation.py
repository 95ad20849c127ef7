"""What `generate` modes routes can follow: sampling or greedy with a KV cache, one position per step."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ...errors import UnsupportedGenerationError


def setting(model: nn.Module, kwargs: dict[str, Any], name: str, default: Any = None) -> Any:
    """The generation setting `name` a `generate(**kwargs)` call runs with, as transformers resolves it: its keyword
    argument, else the `generation_config` passed, else the model's (None in a config is unset), else `default`.

    Example:
        >>> setting(model, {"num_beams": 2}, "num_beams", 1)  # doctest: +SKIP
        2
    """
    if name in kwargs:
        return kwargs[name]
    configs = (kwargs.get("generation_config"), getattr(model, "generation_config", None))
    return next((value for c in configs if (value := getattr(c, name, None)) is not None), default)


def check_generation(model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    """Raise UnsupportedGenerationError for a generate whose routes could not line up with `out.sequences`."""
    if (setting(model, kwargs, "num_beams", 1) or 1) > 1:
        raise UnsupportedGenerationError(
            f"moe-replay cannot follow beam search (num_beams={setting(model, kwargs, 'num_beams')}): beams are "
            "reordered between steps, so routes would not line up with the output; sample with num_beams=1"
        )
    for name in ("assistant_model", "prompt_lookup_num_tokens", "assistant_early_exit"):
        if setting(model, kwargs, name) is not None:
            raise UnsupportedGenerationError(
                f"moe-replay cannot follow assisted decoding ({name} is set): rejected draft tokens are routed too "
                "and the cache is rolled back; generate without an assistant"
            )
    if (scale := setting(model, kwargs, "guidance_scale")) is not None and scale != 1:
        raise UnsupportedGenerationError(
            f"moe-replay cannot follow classifier-free guidance (guidance_scale={scale}): its logits processor runs "
            "extra forwards of the model, with a cache of their own, between the decode steps, which would be placed "
            "as steps of the generation; generate without guidance_scale"
        )
    if setting(model, kwargs, "use_cache", True) is False:
        raise UnsupportedGenerationError(
            "moe-replay follows generate step by step through its KV cache; use_cache=False re-runs every position "
            "at every step: generate with use_cache=True"
        )
    if kwargs.get("input_ids", kwargs.get("inputs")) is None and not args and kwargs.get("inputs_embeds") is not None:
        raise UnsupportedGenerationError(
            "generate(inputs_embeds=...) returns sequences without the prompt, so routes cannot line up with "
            "out.sequences; pass input_ids (or record a plain forward over inputs_embeds)"
        )


# transformers' continuous batching (TRL's `use_transformers_continuous_batching` too): requests packed in one forward
PACKED_GENERATION = ("generate_batch", "init_continuous_batching", "continuous_batching_context_manager")


def refuse_packed(name: str, inner: Any) -> Any:
    """A replacement for a packed-generation method that raises UnsupportedGenerationError when called."""

    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise UnsupportedGenerationError(
            f"moe-replay cannot follow continuous batching ({name}): it packs several requests into one forward, so "
            "routes cannot be placed per sequence; use generate() inside record_routes / replay_routes"
        )

    return refuse


def eos_token_ids(model: nn.Module, kwargs: dict[str, Any]) -> list[int]:
    """The end-of-sequence ids `generate` stops on (empty if none)."""
    eos = setting(model, kwargs, "eos_token_id")
    return [] if eos is None else [int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])]


def call_arguments(names: tuple[str, ...] | None, args: tuple[Any, ...], kwargs: dict[str, Any]) -> dict[str, Any]:
    """`kwargs`, with `args` named after `names` (a function's leading positional parameters: `generate(ids,
    config)` passes its generation config positionally); with `names` None (a wrapper's `*args`) they stay unnamed.

    Example:
        >>> call_arguments(("inputs", "generation_config"), (1, 2), {"a": 3})
        {'inputs': 1, 'generation_config': 2, 'a': 3}
    """
    return {**dict(zip(names, args, strict=False)), **kwargs} if args and names else kwargs


def generate_wrapper(hub: Any, inner: Callable[..., Any]) -> Callable[..., Any]:
    """`generate` of a hooked model (`hub`: its RouterHub): refuses modes routes cannot follow, marks its forwards as
    one generation, then hands the recorders its streams, `out.sequences`, EOS ids and prompt mask. A `generate` that
    calls another (a wrapper module's calling its model's) is checked at each level, read at the innermost (it ran)."""
    owner = getattr(inner, "__self__", None)  # the module whose generate this is

    def generate(*args: Any, **kwargs: Any) -> Any:
        session, model = hub.session, hub.model if owner is None else owner
        named = call_arguments(session.tracker.positional(inner) if args else None, args, kwargs)
        check_generation(model, args, named)
        first = session.enter_generate(bool(setting(model, named, "synced_gpus", False)))
        if first is None:  # called by an outer generate
            out = inner(*args, **kwargs)
            session.generated_by_inner((model, named, args, out))
            return out
        try:
            out = inner(*args, **kwargs)
        except BaseException:  # a generate that raised is not recorded (a retry after an OOM records the retry alone)
            session.drop_streams(session.generate_streams(first).start)  # (a kept cache holds its steps too)
            raise
        finally:
            ran = session.exit_generate()  # (lets go of its KV cache: a kept hub must not hold it)
        model, named, args, last = ran or (model, named, args, out)
        sequences = last if isinstance(last, torch.Tensor) else getattr(last, "sequences", None)
        session.hand_over()
        if isinstance(sequences, torch.Tensor):
            streams = session.generate_streams(first)
            eos, prompt_mask = eos_token_ids(model, named), named.get("attention_mask")
            ids = named.get("input_ids", named.get("inputs", args[0] if args else None))  # (out.sequences' start)
            prompt = ids.shape[-1] if isinstance(ids, torch.Tensor) and ids.dim() == 2 else None
            prompt_mask = prompt_mask if torch.is_tensor(prompt_mask) else None
            for rec in session.recorders:
                rec.on_generate(streams, sequences, eos, prompt_mask, prompt, session.tracker.resumed)
        return out

    return generate
