"""`vllm_rollout`: a ready TRL `rollout_func` that samples with vLLM at the trainer's current weights and hands the
trainer vLLM's routes (Rollout Routing Replay, R3), so that R3 with a real engine is one argument away:

    trainer = RoutingReplayGRPOTrainer(..., routing_replay="rollout", rollout_func=vllm_rollout(make_llm))

TRL's own colocated `LLM` is built without routed experts, and its weight sync writes into a running engine. This
one builds the engine from the trainer's weights instead: whenever the policy changed since the last rollout (TRL's
`global_step` moved), it saves the trainer's model (and tokenizer) to a folder and calls `make_llm(folder)` for a
fresh `vllm.LLM` (made with `enable_return_routed_experts=True`), dropping the old one. A fresh engine holds no KV
block, so no prefix-cache hit can hand back the old policy's KV and routes; and it is the one way that works on
vLLM's CPU build, whose layers repack their weights on load (docs/engines.md). Each rebuild costs an engine start
(seconds for a small model on a CPU; minutes for a large one: for those, sync in place in your own rollout_func and
reset the prefix cache after every sync).
"""

from __future__ import annotations

import gc
import tempfile
from collections.abc import Callable
from typing import Any

from ...errors import ReplayError
from ..vllm import routes_from_vllm


def vllm_rollout(make_llm: Callable[[str], Any], sampling: dict[str, Any] | None = None) -> Callable[..., dict]:
    """A TRL `rollout_func(prompts, trainer)` that samples one completion per prompt (TRL passes each prompt
    `num_generations` times) with the `vllm.LLM` that `make_llm(folder)` builds from the trainer's current weights
    saved in `folder`, and returns `prompt_ids`, `completion_ids`, the sampled tokens' `logprobs` and vLLM's `routes`
    (`routes_from_vllm`). `sampling` adds to or overrides the `vllm.SamplingParams` taken from the trainer's
    `GRPOConfig` (temperature, top_p, top_k, min_p, repetition_penalty, `max_completion_length`). Refuses a PEFT
    model (merge the adapter into a saved model for vLLM first) and multimodal prompts.

    Example:
        >>> make_llm = lambda path: vllm.LLM(model=path, enable_return_routed_experts=True)  # doctest: +SKIP
        >>> trainer = RoutingReplayGRPOTrainer(model, ..., routing_replay="rollout",
        ...                                    rollout_func=vllm_rollout(make_llm))  # doctest: +SKIP
    """
    state: dict[str, Any] = {"llm": None, "step": None, "folder": tempfile.mkdtemp(prefix="moe_replay_vllm_")}

    def rollout(prompts: list, trainer: Any) -> dict[str, Any]:
        import vllm

        model = trainer.accelerator.unwrap_model(trainer.model)
        if getattr(model, "peft_config", None):
            raise ValueError(
                "vllm_rollout saves the trainer's model for vLLM to load, but it is a PEFT model: vLLM would load the "
                "base weights without the adapter; merge the adapter (merge_and_unload) into the model you train, "
                "or sync the adapter in your own rollout_func"
            )
        if state["step"] != trainer.state.global_step:  # the policy moved: the engine at the new weights
            state["llm"] = None
            gc.collect()  # (the old engine's memory goes before the new one takes its own)
            model.save_pretrained(state["folder"])
            trainer.processing_class.save_pretrained(state["folder"])
            state["llm"] = make_llm(state["folder"])
            if not state["llm"].llm_engine.vllm_config.model_config.enable_return_routed_experts:
                raise ReplayError(
                    "vllm_rollout's make_llm built an LLM without routed experts: pass "
                    "enable_return_routed_experts=True to vllm.LLM"
                )
            state["step"] = trainer.state.global_step
        prompt_ids, images, _ = trainer._tokenize_prompts(prompts)
        if images is not None:
            raise ValueError("vllm_rollout takes text prompts: these hold images")
        args = trainer.args
        params = {"n": 1, "temperature": args.temperature, "top_p": args.top_p, "min_p": args.min_p or 0.0,
                  "repetition_penalty": args.repetition_penalty, "max_tokens": args.max_completion_length,
                  "logprobs": 0, **({"top_k": args.top_k} if args.top_k else {}), **(sampling or {})}  # fmt: skip
        outputs = state["llm"].generate(
            [{"prompt_token_ids": list(p)} for p in prompt_ids], vllm.SamplingParams(**params), use_tqdm=False
        )
        completions = [o.outputs[0] for o in outputs]
        return {
            "prompt_ids": [list(o.prompt_token_ids) for o in outputs],
            "completion_ids": [list(c.token_ids) for c in completions],
            "logprobs": [[e[t].logprob for t, e in zip(c.token_ids, c.logprobs, strict=True)] for c in completions],
            "routes": routes_from_vllm(outputs, model),
        }

    return rollout
