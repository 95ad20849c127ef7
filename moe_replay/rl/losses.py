"""GRPO, GSPO and GSPO-token policy losses as pure functions (GSPO paper, arXiv 2507.18071).

Shapes: N answers (B prompts x G answers each), T answer tokens (right-padded; `mask` marks real tokens).
Names follow TRL: `importance_sampling_level` ("token" = GRPO, "sequence" = GSPO, "sequence_token" = GSPO-token),
`epsilon_low` / `epsilon_high`, and metrics `clip_ratio/low_mean`, `clip_ratio/high_mean`, `clip_ratio/region_mean`
(and `ratio/unbounded_negative_mean`: A < 0 with r > 1 + ε_high, where clipping bounds nothing).
"""

from __future__ import annotations

from typing import Literal

import torch

Level = Literal["token", "sequence", "sequence_token"]

# The GSPO paper's clipping ranges: token-level ratios (its GRPO baseline) and sequence-level ratios (GSPO).
DEFAULT_EPSILON: dict[str, tuple[float, float]] = {
    "token": (0.2, 0.27),
    "sequence": (3e-4, 4e-4),
    "sequence_token": (3e-4, 4e-4),
}


def group_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """(R − mean) / std within each group of `group_size` consecutive answers; a group of equal rewards gets 0.

    `rewards` is [N] with N = B·G (answers of one prompt next to each other); std is the sample std (as in TRL).

    Example:
        >>> group_advantages(torch.tensor([1.0, 0.0, 0.5, 0.5]), group_size=2)
        tensor([ 0.7071, -0.7071,  0.0000,  0.0000])
    """
    if rewards.dim() != 1 or group_size < 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be [B*G] with G={group_size} dividing it, got shape {tuple(rewards.shape)}")
    r = rewards.float().view(-1, group_size)
    mean = r.mean(1, keepdim=True)
    std = r.std(1, keepdim=True) if group_size > 1 else torch.zeros_like(mean)
    adv = torch.where(std > eps, (r - mean) / std.clamp_min(eps), torch.zeros_like(r))
    return adv.view(-1)


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    importance_sampling_level: Level = "token",
    epsilon_low: float | None = None,
    epsilon_high: float | None = None,
    weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """The clipped policy-gradient loss (−J) and detached metrics.

    Args:
        logp: [N, T] log π_θ of the answer tokens (with grad).
        old_logp: [N, T] log π_old of the same tokens (no grad needed).
        advantages: [N] per answer, or [N, T] per token (only "sequence_token" uses token-level values).
        mask: [N, T] bool, True at answer tokens.
        importance_sampling_level: "token" (GRPO: ρ_t = π_θ/π_old per token, clipped per token, 1/|o_i| per answer,
            mean over answers), "sequence" (GSPO: s_i = exp(mean_t log ρ_t), clipped per answer, mean over answers),
            "sequence_token" (GSPO-token: s_it = sg[s_i]·π_θ(o_t)/sg[π_θ(o_t)]; equals GSPO when A_it = A_i).
        epsilon_low, epsilon_high: clip range [1 − low, 1 + high]; defaults 0.2 / 0.27 (token), 3e-4 / 4e-4 (sequence).
        weights: [N, T] or [N, 1] non-negative factors on each token's clipped term (no gradient): the sampler
            importance-sampling correction and the off-policy sequence mask (as TRL multiplies its per-token loss).

    Example:
        >>> loss, m = policy_loss(logp, old_logp, adv, mask, importance_sampling_level="sequence")  # doctest: +SKIP
        >>> loss.backward(); m["clip_ratio/region_mean"]  # doctest: +SKIP
    """
    if importance_sampling_level not in DEFAULT_EPSILON:
        raise ValueError(
            f"importance_sampling_level must be one of {list(DEFAULT_EPSILON)}, got {importance_sampling_level!r}"
        )
    if logp.shape != old_logp.shape or logp.shape != mask.shape or logp.dim() != 2:
        shapes = f"logp {tuple(logp.shape)}, old_logp {tuple(old_logp.shape)}, mask {tuple(mask.shape)}"
        raise ValueError(f"{shapes}: all must be the same [N, T]")
    N = logp.shape[0]
    if advantages.shape not in ((N,), tuple(logp.shape)):
        raise ValueError(f"advantages must be [N]={N} or [N, T]={tuple(logp.shape)}, got {tuple(advantages.shape)}")
    if advantages.dim() == 2 and importance_sampling_level == "sequence":
        raise ValueError(
            "sequence-level GSPO takes one advantage per answer; use 'sequence_token' for token-level ones"
        )
    low, high = clip_range(importance_sampling_level, epsilon_low, epsilon_high)

    logp, old_logp, mask, lengths = _prepared(logp, old_logp, mask)
    m = mask.to(logp.dtype)
    adv = advantages.to(logp.dtype)
    adv_t = adv if adv.dim() == 2 else adv[:, None].expand_as(logp)
    log_ratio = logp - old_logp  # [N, T]

    ratio = _ratio(logp, log_ratio, lengths, importance_sampling_level)
    clipped = ratio.clamp(1 - low, 1 + high)
    term = torch.minimum(ratio * adv_t, clipped * adv_t)  # [N, T]
    if weights is not None:
        if weights.dim() != 2 or weights.shape[0] != N or weights.shape[1] not in (1, logp.shape[1]):
            raise ValueError(
                f"weights must be [N, T] or [N, 1] for logp {tuple(logp.shape)}, got {tuple(weights.shape)}"
            )
        term = term * weights.detach().to(term.dtype)
    if importance_sampling_level == "sequence" and (weights is None or weights.shape[1] == 1):
        per_answer = term[:, 0] if term.shape[1] else term.sum(1)  # one term per answer (equal over t)
        per_answer = per_answer * mask.any(1)  # an answer without tokens has none (as in GRPO and GSPO-token)
    else:
        per_answer = (term * m).sum(1) / lengths
    loss = -per_answer.mean()
    return loss, _metrics(ratio, log_ratio, adv_t, mask, low, high)


def _prepared(
    logp: torch.Tensor, old_logp: torch.Tensor, mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logp, old_logp (detached), mask as bool, |o_i| [N]) in float32 at least, both log-probs 0 at padding.

    bf16 counts 257 tokens as 256 and cannot hold GSPO's clip band [1 - 3e-4, 1 + 4e-4]; a log-prob of -inf at
    padding would give inf * 0 = NaN (and a gradient) if it were masked by a product.
    """
    dtype = torch.promote_types(logp.dtype, torch.float32)
    mask = mask.to(torch.bool)
    logp, old_logp = torch.where(mask, logp.to(dtype), 0.0), torch.where(mask, old_logp.detach().to(dtype), 0.0)
    return logp, old_logp, mask, mask.sum(1).clamp_min(1).to(dtype)


def _ratio(logp: torch.Tensor, log_ratio: torch.Tensor, lengths: torch.Tensor, level: str) -> torch.Tensor:
    """[N, T] importance ratios of `level`: per token (GRPO), per answer (GSPO) or GSPO-token's."""
    if level == "token":
        return torch.exp(log_ratio)
    seq_log_ratio = log_ratio.sum(1) / lengths  # log s_i
    if level == "sequence":
        return torch.exp(seq_log_ratio)[:, None].expand_as(logp)
    return torch.exp(seq_log_ratio.detach()[:, None] + logp - logp.detach())


@torch.no_grad()
def clip_fractions(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    importance_sampling_level: Level = "token",
    epsilon_low: float | None = None,
    epsilon_high: float | None = None,
) -> dict[str, torch.Tensor]:
    """Per answer token (flattened over `mask`): bool "low" / "high" / "region" where `policy_loss` would clip, and
    "abs_log_ratio" |log π_θ − log π_old|; for pooling over minibatches (the fractions are their means).

    Example:
        >>> flags = clip_fractions(logp, old_logp, adv, mask)  # doctest: +SKIP
        >>> flags["region"].float().mean()  # doctest: +SKIP
    """
    low, high = clip_range(importance_sampling_level, epsilon_low, epsilon_high)
    logp, old_logp, mask, lengths = _prepared(logp, old_logp, mask)
    log_ratio = logp - old_logp
    ratio = _ratio(logp, log_ratio, lengths, importance_sampling_level)
    adv = advantages.to(logp.dtype)
    adv = (adv if adv.dim() == 2 else adv[:, None].expand_as(logp))[mask]
    lo, hi = _clipped(ratio[mask], adv, low, high)
    return {"low": lo, "high": hi, "region": lo | hi, "abs_log_ratio": log_ratio[mask].abs().float()}


def clip_range(level: str, epsilon_low: float | None, epsilon_high: float | None) -> tuple[float, float]:
    """(low, high) of the clip band [1 − low, 1 + high]: the given epsilons, else `DEFAULT_EPSILON[level]`.

    Example:
        >>> clip_range("token", None, 0.3)
        (0.2, 0.3)
    """
    low, high = DEFAULT_EPSILON[level]
    low, high = (low if epsilon_low is None else epsilon_low), (high if epsilon_high is None else epsilon_high)
    if not (0 <= low < 1 and high >= 0):
        raise ValueError(
            f"the clip band [1 - epsilon_low, 1 + epsilon_high] needs 0 <= epsilon_low < 1 and epsilon_high >= 0, "
            f"got epsilon_low={low}, epsilon_high={high}"
        )
    return low, high


def _clipped(r: torch.Tensor, a: torch.Tensor, low: float, high: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Where ratios `r` with advantages `a` are clipped below (r < 1 − low, a < 0) and above (r > 1 + high, a > 0)."""
    return (r < 1 - low) & (a < 0), (r > 1 + high) & (a > 0)


def _metrics(ratio, log_ratio, adv, mask, low, high) -> dict[str, float]:  # noqa: ANN001
    """Detached statistics over answer tokens (an answer clipped at sequence level counts all its tokens)."""
    with torch.no_grad():
        r, a = ratio.detach()[mask], adv.detach()[mask]
        n = max(r.numel(), 1)
        lo, hi = _clipped(r, a, low, high)
        low_c, high_c = lo.sum().item() / n, hi.sum().item() / n
        # A < 0 and r > 1 + high: the min keeps r·A, so clipping bounds nothing (the tail routing noise would feed)
        unbounded = ((r > 1 + high) & (a < 0)).sum().item() / n
        abs_lr = log_ratio.detach()[mask].abs().float()
        q = abs_lr.quantile(torch.tensor([0.5, 0.9, 0.99])).tolist() if abs_lr.numel() else [0.0, 0.0, 0.0]
        return {
            "clip_ratio/low_mean": low_c,
            "clip_ratio/high_mean": high_c,
            "clip_ratio/region_mean": low_c + high_c,
            "ratio/unbounded_negative_mean": unbounded,
            "ratio/mean": r.mean().item() if r.numel() else 1.0,
            "ratio/min": r.min().item() if r.numel() else 1.0,
            "ratio/max": r.max().item() if r.numel() else 1.0,
            "abs_log_ratio/p50": q[0],
            "abs_log_ratio/p90": q[1],
            "abs_log_ratio/p99": q[2],
            "abs_log_ratio/max": abs_lr.max().item() if abs_lr.numel() else 0.0,
        }
