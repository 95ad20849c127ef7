"""What `RoutingReplayGRPOTrainer` refuses before training: `GRPOTrainer` arguments and `GRPOConfig` settings it
does not support or under which a replay would do nothing, and end tokens TRL would not cut completions at."""

from __future__ import annotations

from typing import Any


def refuse_arguments(kwargs: dict[str, Any]) -> None:
    """ValueError for `GRPOTrainer` arguments routing replay does not support yet."""
    multi_turn = next((key for key in ("tools", "environment_factory") if kwargs.get(key)), None)
    if multi_turn is not None and kwargs.get("rollout_func") is not None:
        raise ValueError(
            f"routing_replay does not support {multi_turn} together with a rollout_func (TRL's tool loop would "
            "generate turns the rollout_func's routes do not hold): run the tool calls inside the rollout_func, or "
            f"pass {multi_turn} without one"
        )
    from transformers import ProcessorMixin

    if isinstance(kwargs.get("processing_class"), ProcessorMixin):
        raise ValueError("routing_replay does not support multimodal models (a ProcessorMixin processing_class) yet")


def refuse_settings(args: Any, routing_replay: str, rollout_func: bool = False) -> None:
    """ValueError for `GRPOConfig` settings routing replay does not support, or where it would do nothing."""
    if args.use_vllm and not rollout_func:
        raise ValueError(
            "routing_replay with use_vllm=True needs a rollout_func that returns the routes (TRL's own vLLM path "
            "returns none): call vLLM in a rollout_func and return routes_from_vllm(...) as its 'routes' "
            "(use_vllm=True then keeps TRL's weight sync), or use use_vllm=False"
        )
    if getattr(args, "use_transformers_continuous_batching", False):
        raise ValueError("routing_replay does not support use_transformers_continuous_batching=True yet")
    generate_every = args.steps_per_generation * args.num_iterations
    if routing_replay == "old_logprob" and args.gradient_accumulation_steps % generate_every == 0:
        raise ValueError(
            f"routing_replay='old_logprob' has nothing to replay: with num_iterations={args.num_iterations}, "
            f"steps_per_generation={args.steps_per_generation} and gradient_accumulation_steps="
            f"{args.gradient_accumulation_steps} TRL computes no old log-probs (the ratio is exactly 1); use "
            "num_iterations > 1, or routing_replay='rollout'"
        )


def refuse_stop_tokens(config: Any, cut_at: list[int]) -> None:
    """ValueError if `generate` (run with `config`) stops rows at tokens TRL does not cut completions at (`cut_at`,
    TRL's `eos_token_ids`): TRL would keep the padding generate fed a stopped row as completion tokens, which no
    routes (and no sampling) cover."""
    eos = getattr(config, "eos_token_id", None)
    stops = [] if eos is None else [int(e) for e in (eos if isinstance(eos, list | tuple) else [eos])]
    extra = sorted(set(stops) - set(cut_at))
    if extra:
        raise ValueError(
            f"routing_replay: generate stops rows at end tokens {stops} (generation_kwargs['eos_token_id']) but TRL "
            f"cuts completions only at {list(cut_at)}, so it would train on the padding generate fed after tokens "
            f"{extra}, which were never sampled and have no routes; set them in the model's "
            "generation_config.eos_token_id instead (TRL then cuts there too)"
        )
