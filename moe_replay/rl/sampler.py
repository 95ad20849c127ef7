"""The sampler side of the training–inference mismatch: an engine-like sampler copy, its own log-probs, the
importance-sampling correction, the off-policy sequence mask, and sampler-vs-trainer metrics.

The sampler copy simulates an inference engine (lower precision, optionally fp8-rounded weights); it is not one.
Shapes: N answers, A answer tokens.
"""

from __future__ import annotations

import copy

import torch
from torch import nn

from .policy import sampling_kwargs
from .route_noise import add_selection_noise

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
QUANT = {"none": None, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
CORRECTIONS = ("none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask")


def make_sampler(
    model: nn.Module,
    dtype: str = "float32",
    weight_quant: str = "none",
    selection_noise: float = 0.0,
    generator: torch.Generator | None = None,
) -> nn.Module | None:
    """An engine-like sampler: a copy of `model` whose floating-point weights are first rounded through
    `weight_quant` (fp8 e4m3 or e5m2, per tensor, no scale), then cast to `dtype`; with `selection_noise` > 0 its
    routers pick experts by logits + that std × Gaussian noise from `generator` while keeping the trainer's gating
    weights (`route_noise.add_selection_noise`). None when it would equal `model`.

    Example:
        >>> sampler = make_sampler(model, "bfloat16", "fp8_e4m3")  # doctest: +SKIP
        >>> noise = torch.Generator().manual_seed(0)  # doctest: +SKIP
        >>> only_routes = make_sampler(model, selection_noise=0.04, generator=noise)  # doctest: +SKIP
    """
    if dtype not in DTYPES or weight_quant not in QUANT:
        raise ValueError(f"dtype must be one of {list(DTYPES)} and weight_quant one of {list(QUANT)}")
    if dtype == "float32" and weight_quant == "none" and selection_noise == 0:
        return None
    sampler = copy.deepcopy(model)
    if selection_noise != 0:
        add_selection_noise(sampler, selection_noise, torch.Generator() if generator is None else generator)
    fp8 = QUANT[weight_quant]
    if fp8 is not None:
        with torch.no_grad():
            for p in sampler.parameters():
                if p.dtype.is_floating_point:
                    p.copy_(p.to(fp8).to(p.dtype))
    return sampler.to(DTYPES[dtype])


@torch.no_grad()
def sample_with_logp(model: nn.Module, prompts: torch.Tensor, answer_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample exactly `answer_len` tokens after each prompt [N, Tp] at temperature 1 (as `sample_answers`), and
    return the sequences [N, Tp + A] with the sampler's own float32 log-probs of the sampled tokens [N, A].

    Example:
        >>> seq, sampler_logp = sample_with_logp(sampler, prompts, task.answer_len)  # doctest: +SKIP
    """
    out = model.generate(**sampling_kwargs(prompts, answer_len), output_logits=True, return_dict_in_generate=True)
    logits = torch.stack(out.logits, 1).float()  # [N, A, V], raw: temperature 1, no top-k / top-p
    answers = out.sequences[:, prompts.shape[1] :]
    return out.sequences, torch.log_softmax(logits, -1).gather(-1, answers[..., None]).squeeze(-1)


def correction_weights(
    trainer_logp: torch.Tensor,
    sampler_logp: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    clip_min: float | None = None,
    clip_max: float | None = 3.0,
) -> torch.Tensor | None:
    """Importance weights that correct for sampling from the sampler instead of the trainer (TRL 1.16's
    `vllm_importance_sampling_mode` semantics): exp(log p_trainer − log p_sampler) per token [N, A], or per answer
    (summed over its tokens) [N, 1]; "*_truncate" clamps to [clip_min, clip_max], "*_mask" sets weights outside
    [clip_min, clip_max] to 0 (None: no bound). Returns None for "none".

    Example:
        >>> correction_weights(torch.tensor([[-1.0]]), torch.tensor([[-2.0]]), torch.tensor([[True]]), "token_truncate")
        tensor([[2.7183]])
    """
    if mode not in CORRECTIONS:
        raise ValueError(f"sampler correction must be one of {CORRECTIONS}, got {mode!r}")
    if mode == "none":
        return None
    diff = (trainer_logp.float() - sampler_logp.float()) * mask
    if mode.startswith("sequence"):
        diff = diff.sum(1, keepdim=True)
    w = torch.exp(diff)
    if mode.endswith("truncate"):
        return w.clamp(min=clip_min, max=clip_max)
    lo = -float("inf") if clip_min is None else clip_min
    hi = float("inf") if clip_max is None else clip_max
    return w.masked_fill((w < lo) | (w > hi), 0.0)


def off_policy_mask(
    advantages: torch.Tensor, logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor, threshold: float
) -> torch.Tensor:
    """[N, 1] 1.0 to keep an answer, 0.0 to drop it: drop answers with a negative advantage whose mean per-token
    log p_sampler − log p_current exceeds `threshold` (DeepSeek-V3.2's off-policy sequence masking; TRL's
    `off_policy_mask_threshold`).

    Example:
        >>> off_policy_mask(torch.tensor([-1.0, 1.0]), lp, slp, mask, threshold=0.5)  # doctest: +SKIP
    """
    m = mask.float()
    kl = ((sampler_logp.float() - logp.detach().float()) * m).sum(1, keepdim=True) / m.sum(1, keepdim=True).clamp_min(1)
    keep = (advantages.reshape(-1, 1) >= 0) | (kl <= threshold)
    return keep.float()


def mismatch_metrics(trainer_logp: torch.Tensor, sampler_logp: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """Sampler vs trainer on the sampled tokens: KL(sampler ‖ trainer) by the k3 estimator (e^r − 1 − r with
    r = log p_trainer − log p_sampler, mean over tokens) and the mean and p99 of |r|.

    Example:
        >>> mismatch_metrics(trainer_logp, sampler_logp, mask)["sampler/kl_k3"]  # doctest: +SKIP
    """
    r = (trainer_logp.float() - sampler_logp.float())[mask.bool()].double()
    if r.numel() == 0:
        return {"sampler/kl_k3": 0.0, "sampler/abs_log_ratio/mean": 0.0, "sampler/abs_log_ratio/p99": 0.0}
    return {
        "sampler/kl_k3": float((torch.expm1(r) - r).mean()),
        "sampler/abs_log_ratio/mean": float(r.abs().mean()),
        "sampler/abs_log_ratio/p99": float(r.abs().quantile(0.99)),
    }
