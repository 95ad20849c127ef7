"""The tiny MoE policy: a transformers causal LM built from a config, and its supervised warm start."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..tiny import tiny_moe
from .tasks import BOS, EOS, PAD, VOCAB, Task

# A Qwen3-MoE-style policy of about 1.3M parameters (DESIGN.md §8): trains on 2 CPU cores.
DEFAULT_POLICY: dict[str, Any] = {
    "model_type": "qwen3_moe",
    "hidden_size": 96,
    "intermediate_size": 192,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 24,
    "num_experts": 16,
    "num_experts_per_tok": 2,
    "router_aux_loss_coef": 0.01,
}


def build_policy(config: dict[str, Any] | None = None, *, seed: int = 0) -> nn.Module:
    """A randomly initialised MoE causal LM over the task vocabulary. `config` overrides `DEFAULT_POLICY` (Qwen3-MoE);
    another `model_type` picks another transformers family, whose config fields `config` then gives in full.

    Example:
        >>> model = build_policy({"num_hidden_layers": 8, "num_experts": 64})  # doctest: +SKIP
    """
    config = dict(config or {})
    same_family = config.get("model_type", DEFAULT_POLICY["model_type"]) == DEFAULT_POLICY["model_type"]
    fields = {**DEFAULT_POLICY, **config} if same_family else config  # other families: their own field names
    implementation = fields.pop("experts_implementation", "grouped_mm")
    fields.update(vocab_size=VOCAB, pad_token_id=PAD, bos_token_id=BOS, eos_token_id=EOS, output_router_logits=True)
    model = tiny_moe(seed, experts_implementation=implementation, **fields).train()
    model.generation_config.pad_token_id = PAD
    model.generation_config.eos_token_id = EOS
    return model


def scale_routers(model: nn.Module, scale: float) -> None:
    """Multiply every router's parameters by `scale` in place: a linear softmax router's logits scale by it, so its
    distribution gets sharper (> 1) or flatter (< 1) while the experts it picks right now stay the same.

    Example:
        >>> scale_routers(model, 0.25)  # doctest: +SKIP
    """
    from ..engines.hf import find_routers

    if not scale > 0:
        raise ValueError(f"scale must be > 0, got {scale}")
    with torch.no_grad():
        for site in find_routers(model):
            for param in site.router.parameters():
                param.mul_(scale)


def supervised_batch(task: Task, n: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """input_ids [n, prompt + answer + 1] (answer then EOS) and labels (-100 on the prompt)."""
    prompts, answers = task.sample(n, generator)
    eos = torch.full((n, 1), EOS)
    ids = torch.cat([prompts, answers, eos], 1)
    labels = ids.clone()
    labels[:, : prompts.shape[1]] = -100
    return ids, labels


def warm_start(
    model: nn.Module,
    task: Task,
    *,
    steps: int = 120,
    batch: int = 128,
    lr: float = 3e-3,
    seed: int = 0,
    target_reward: float | None = None,
    eval_every: int = 20,
    progress: Callable[[int, float, float | None], None] | None = None,
) -> list[dict[str, float]]:
    """Supervised next-token training on task answers (AdamW, cosine decay), stopping early once the sampled reward
    reaches `target_reward`; returns the log (step, loss, reward where evaluated).

    Example:
        >>> log = warm_start(model, Task("addition", 3), steps=120, target_reward=0.35)  # doctest: +SKIP
    """
    g = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, steps) / steps)))
    log: list[dict[str, float]] = []
    for step in range(1, steps + 1):
        model.train()
        ids, labels = supervised_batch(task, batch, g)
        loss = model(ids, labels=labels).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        opt.zero_grad(set_to_none=True)
        row: dict[str, float] = {"step": step, "loss": loss.item()}
        if step % eval_every == 0 or step == steps:
            row["reward"] = sampled_reward(model, task, n=256, seed=seed + step)
        log.append(row)
        if progress is not None:
            progress(step, row["loss"], row.get("reward"))
        if target_reward is not None and row.get("reward", -1.0) >= target_reward:
            break
    model.eval()
    return log


@torch.no_grad()
def sampled_reward(model: nn.Module, task: Task, *, n: int = 256, seed: int = 0, partial: bool = True) -> float:
    """Mean reward of answers sampled at temperature 1 for `n` fresh prompts.

    Example:
        >>> sampled_reward(model, Task("addition", 3))  # doctest: +SKIP
        0.41
    """
    was_training = model.training
    model.eval()
    g = torch.Generator().manual_seed(seed)
    prompts, answers = task.sample(n, g)
    devices = {p.device for p in model.parameters()}
    prompts = prompts.to(next(iter(devices)))
    rng = torch.get_rng_state()
    torch.manual_seed(seed)
    out = sample_answers(model, prompts, task.answer_len)
    torch.set_rng_state(rng)
    model.train(was_training)
    return float(task.reward(out[:, prompts.shape[1] :].cpu(), answers, partial=partial).mean())


def sample_answers(model: nn.Module, prompts: torch.Tensor, answer_len: int) -> torch.Tensor:
    """Sample exactly `answer_len` tokens after each prompt [N, Tp] at temperature 1 (no top-k / top-p): [N, Tp + A].

    Example:
        >>> seq = sample_answers(model, prompts, task.answer_len)  # doctest: +SKIP
    """
    return model.generate(**sampling_kwargs(prompts, answer_len))


def sampling_kwargs(prompts: torch.Tensor, answer_len: int) -> dict[str, Any]:
    """The `generate` arguments of the loop's sampling: exactly `answer_len` tokens at temperature 1, no top-k / top-p.

    Example:
        >>> sampling_kwargs(torch.tensor([[1, 4]]), 3)["max_new_tokens"]
        3
    """
    return {
        "input_ids": prompts,
        "attention_mask": torch.ones_like(prompts),
        "do_sample": True,
        "top_k": 0,
        "top_p": 1.0,
        "max_new_tokens": answer_len,
        "min_new_tokens": answer_len,
        "pad_token_id": PAD,
    }
