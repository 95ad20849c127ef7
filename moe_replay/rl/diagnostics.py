"""Step-level diagnostics of the RL loop: statistics pooled over minibatches, the KL between consecutive policies,
and the held-out evaluation.

Shapes: N answers, A answer tokens.
"""

from __future__ import annotations

import torch
from torch import nn

from .policy import sample_answers
from .tasks import Task

EVAL_KEYS = tuple(f"eval/{how}/{what}" for how in ("greedy", "sampled") for what in ("reward", "exact_match"))


def pooled_stats(flags: list[dict[str, torch.Tensor]], prefix: str) -> dict[str, float]:
    """Clip fractions and |log-ratio| quantiles over all tokens of the given minibatches' `clip_fractions` flags
    (pooled over tokens, not averaged per minibatch), under `prefix`.

    Example:
        >>> pooled_stats(flags[1:], "later_minibatches")["later_minibatches/clip_ratio/region_mean"]  # doctest: +SKIP
    """
    if not flags:
        return {}
    cat = {key: torch.cat([f[key] for f in flags]) for key in flags[0]}
    n = max(cat["region"].numel(), 1)
    q = cat["abs_log_ratio"].double()
    quantiles = q.quantile(torch.tensor([0.5, 0.9, 0.99], dtype=torch.float64)).tolist() if q.numel() else [0.0] * 3
    return {
        f"{prefix}/clip_ratio/low_mean": cat["low"].sum().item() / n,
        f"{prefix}/clip_ratio/high_mean": cat["high"].sum().item() / n,
        f"{prefix}/clip_ratio/region_mean": cat["region"].sum().item() / n,
        f"{prefix}/abs_log_ratio/p50": quantiles[0],
        f"{prefix}/abs_log_ratio/p90": quantiles[1],
        f"{prefix}/abs_log_ratio/p99": quantiles[2],
    }


def mean_rows(rows: list[dict[str, float]]) -> dict[str, float]:
    """The mean of each metric over the minibatch `rows` (not `step` / `minibatch`), over the rows where it is not
    NaN. Gives every row every key, in one order (NaN where a row lacks one: a live minibatch under
    `replay_max_age` has no replay diagnostics), so that they make one log.

    Example:
        >>> mean_rows([{"step": 1, "loss": 1.0, "x": 2.0}, {"step": 1, "loss": 3.0}])
        {'loss': 2.0, 'x': 2.0}
    """
    keys = list(dict.fromkeys(k for r in rows for k in r))
    for r in rows:
        filled = {k: r.get(k, float("nan")) for k in keys}
        r.clear()
        r.update(filled)
    means = {}
    for key in keys:
        if key not in ("step", "minibatch"):
            values = [r[key] for r in rows if r[key] == r[key]]  # (not NaN)
            means[key] = sum(values) / len(values) if values else float("nan")
    return means


def k3_kl(logp_p: torch.Tensor, logp_q: torch.Tensor, mask: torch.Tensor) -> float:
    """KL(p ‖ q) estimated on tokens sampled from p by k3 = e^r − 1 − r, r = log q − log p (mean over `mask`).

    Example:
        >>> k3_kl(torch.tensor([[-1.0]]), torch.tensor([[-1.0]]), torch.tensor([[True]]))
        0.0
    """
    r = (logp_q.double() - logp_p.double())[mask.bool()]
    return float((torch.expm1(r) - r).mean()) if r.numel() else 0.0


@torch.no_grad()
def heldout_eval(
    model: nn.Module, task: Task, prompts: torch.Tensor, answers: torch.Tensor, *, seed: int
) -> dict[str, float]:
    """Reward (partial credit) and exact match of greedy and of sampled answers on held-out `prompts` [n, Tp]. The
    sampling draws from its own seed and restores the global RNG, so that training is unaffected.

    Example:
        >>> heldout_eval(model, task, *task.heldout(256, seed=0), seed=1)["eval/greedy/exact_match"]  # doctest: +SKIP
    """
    was_training = model.training
    model.eval()
    rng = torch.get_rng_state()
    try:
        greedy = model.generate(
            input_ids=prompts,
            attention_mask=torch.ones_like(prompts),
            do_sample=False,
            max_new_tokens=task.answer_len,
            min_new_tokens=task.answer_len,
            pad_token_id=0,
        )
        torch.manual_seed(seed)
        sampled = sample_answers(model, prompts, task.answer_len)
    finally:
        torch.set_rng_state(rng)
        model.train(was_training)
    out = {}
    for name, seq in (("greedy", greedy), ("sampled", sampled)):
        completions = seq[:, prompts.shape[1] :]
        out[f"eval/{name}/reward"] = float(task.reward(completions, answers).mean())
        out[f"eval/{name}/exact_match"] = float(task.reward(completions, answers, partial=False).mean())
    return out
