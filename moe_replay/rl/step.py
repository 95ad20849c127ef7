"""One RL step, in two public pieces: `rollout` (sample with routes recorded, reward, advantages, old log-probs, the
routes to replay) and `minibatch_update` (one policy-loss step on a minibatch under that replay). The loop
(`moe_replay.rl.train`) and every experiment are built from them.

Shapes: N answers (B prompts x G answers, the G answers of a prompt next to each other), Tp prompt tokens, A answer
tokens; routes are [N, Tp + A, L, K] (L MoE layers, K experts per token).

Example:
    >>> batch = rollout(model, task, prompts, answers, group_size=8, replay="rollout")  # doctest: +SKIP
    >>> for idx in batch.minibatch_indices(4, torch.Generator().manual_seed(0)):  # doctest: +SKIP
    ...     metrics = minibatch_update(model, optimizer, batch, idx)
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ..engines import record_routes, replay_routes
from ..routes import Routes
from .config import REPLAY_MODES
from .losses import Level, clip_fractions, group_advantages, policy_loss
from .replay_bias import replay_bias, router_gradients, router_parameters
from .sampler import correction_weights, off_policy_mask, sample_with_logp
from .tasks import Task

# an external sampler (an inference engine): (model, prompts [N, Tp], answer_len) -> sequences [N, Tp + A], its own
# log-probs of the sampled tokens [N, A] and the routes it used (None if it returns none)
Sample = Callable[[nn.Module, torch.Tensor, int], tuple[torch.Tensor, torch.Tensor, Routes | None]]


@dataclass
class Rollout:
    """A batch of sampled answers with everything the minibatch updates need.

    Attributes:
        sequences: [N, Tp + A] prompt and sampled answer token ids.
        prompt_len: Tp, the tokens per prompt (BOS included).
        routes: `Routes` [N, Tp + A, L, K] that the sampler recorded while sampling (None: an external `sample`
            returned none).
        rewards: [N] rewards (per-position partial credit where asked).
        exact: [N] 1.0 where the answer is exactly right.
        advantages: [N] group-normalised rewards, (R - mean) / std within each prompt's G answers.
        old_logp: [N, A] log π_old of the answer tokens, from the trainer's forward under `train_routes`.
        mask: [N, A] bool, True at answer tokens (answers have a fixed length: all True).
        replay: "off", "rollout" or "old_logprob" (see `rollout`).
        train_routes: the routes the minibatch updates replay: None ("off"), `routes` ("rollout", R3) or the routes
            of the old-log-prob forward ("old_logprob", R2).
        sampler_logp: [N, A] the sampler's own log-probs of the answer tokens (float32).
        trainer_logp: [N, A] the trainer's, in its no-grad forward at the sampling weights under `replay`.
        weights: None, or the sampler correction's importance weights ([N, A] per token, [N, 1] per answer).

    Example:
        >>> batch.old_logp.shape, batch.train_routes is batch.routes  # doctest: +SKIP
        (torch.Size([128, 4]), True)
    """

    sequences: torch.Tensor
    prompt_len: int
    routes: Routes | None
    rewards: torch.Tensor
    exact: torch.Tensor
    advantages: torch.Tensor
    old_logp: torch.Tensor
    mask: torch.Tensor
    replay: str
    train_routes: Routes | None
    sampler_logp: torch.Tensor | None = None
    trainer_logp: torch.Tensor | None = None
    weights: torch.Tensor | None = None

    def __len__(self) -> int:
        """N, the number of answers."""
        return self.sequences.shape[0]

    def minibatch_indices(self, count: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
        """`count` index tensors that split a random permutation of the N answers (drawn from `generator`).

        Example:
            >>> [len(i) for i in batch.minibatch_indices(4, torch.Generator().manual_seed(0))]  # doctest: +SKIP
            [32, 32, 32, 32]
        """
        return torch.randperm(len(self), generator=generator).chunk(count)


def answer_logp(
    model: nn.Module, sequences: torch.Tensor, prompt_len: int, routes: Routes | None = None
) -> torch.Tensor:
    """[N, A] log-probabilities of the answer tokens of `sequences` [N, Tp + A] (positions from `prompt_len` on),
    teacher-forced, replaying `routes` if given. Runs with grad unless the caller disables it.

    Example:
        >>> with torch.no_grad():  # doctest: +SKIP
        ...     old = answer_logp(model, seq, task.prompt_len, rec.routes)
    """
    ctx = replay_routes(model, routes) if routes is not None else contextlib.nullcontext()
    with ctx:
        logits = model(sequences, attention_mask=torch.ones_like(sequences), output_router_logits=False).logits
    logits = logits[:, prompt_len - 1 : -1].float()
    return torch.log_softmax(logits, -1).gather(-1, sequences[:, prompt_len:, None]).squeeze(-1)


@torch.no_grad()
def rollout(
    model: nn.Module,
    task: Task,
    prompts: torch.Tensor,
    answers: torch.Tensor,
    *,
    group_size: int,
    replay: str = "off",
    sampler: nn.Module | None = None,
    sample: Sample | None = None,
    partial_credit: bool = True,
    old_logprob_source: str = "trainer",
    correction: str = "none",
    correction_clip: tuple[float | None, float | None] = (None, 3.0),
) -> Rollout:
    """Sample `group_size` answers for each of the B `prompts` [B, Tp] with routes recorded, reward them against
    `answers` [B, A], normalise the rewards within each group, and run the trainer `model` (eval mode, no grad) over
    the answers at the sampling weights under the chosen `replay`:

    - "off": that forward routes live; the updates route live.
    - "rollout" (R3): that forward and the updates replay the sampler's routes.
    - "old_logprob" (R2): that forward routes live and is recorded; the updates replay those routes.

    `sampler` samples instead of `model` (e.g. a bf16 or fp8-rounded copy: a sampler/trainer mismatch); sampling
    draws from the global torch RNG. `sample(model, prompts, answer_len)` samples instead of both (an inference
    engine: `moe_replay.integrations.vllm_sampler`), returning the sequences, its log-probs and its routes (or
    None: then "rollout" replay is refused). π_old is the trainer's log-probs from that forward (`old_logprob_source`
    "trainer") or the sampler's own ("sampler"). `correction` (see `sampler.correction_weights`, bounds
    `correction_clip` = (min, max)) weights the updates by exp(log p_trainer − log p_sampler) from that forward.

    Example:
        >>> prompts, answers = task.sample(16, torch.Generator().manual_seed(0))  # doctest: +SKIP
        >>> batch = rollout(model, task, prompts, answers, group_size=8, replay="rollout")  # doctest: +SKIP
        >>> batch.sequences.shape, batch.rewards.mean()  # doctest: +SKIP
        (torch.Size([128, 12]), tensor(0.4102))
    """
    if replay not in REPLAY_MODES:
        raise ValueError(f"replay must be one of {REPLAY_MODES}, got {replay!r}")
    if old_logprob_source not in ("trainer", "sampler"):
        raise ValueError(f"old_logprob_source must be 'trainer' or 'sampler', got {old_logprob_source!r}")
    prompts = prompts.repeat_interleave(group_size, 0)
    answers = answers.repeat_interleave(group_size, 0)
    if sample is not None:
        if sampler is not None:
            raise ValueError("rollout takes a sampler model or a sample function, not both")
        seq, sampler_logp, routes = sampled_externally(sample, model, prompts, task.answer_len, replay)
    else:
        sampler = model if sampler is None else sampler
        sampler.eval()
        with record_routes(sampler) as rec:
            seq, sampler_logp = sample_with_logp(sampler, prompts, task.answer_len)
        routes = rec.routes
    tp = prompts.shape[1]
    completions = seq[:, tp:]
    rewards = task.reward(completions, answers, partial=partial_credit)
    exact = task.reward(completions, answers, partial=False)
    advantages = group_advantages(rewards, group_size)
    mask = torch.ones(seq.shape[0], seq.shape[1] - tp, dtype=torch.bool)

    model.eval()
    if replay == "rollout":
        train_routes = routes
        trainer = answer_logp(model, seq, tp, train_routes)
    elif replay == "old_logprob":
        with record_routes(model) as old_rec:
            trainer = answer_logp(model, seq, tp)
        train_routes = old_rec.routes
    else:
        train_routes = None
        trainer = answer_logp(model, seq, tp)
    old = trainer if old_logprob_source == "trainer" else sampler_logp
    weights = correction_weights(trainer, sampler_logp, mask, correction, *correction_clip)
    return Rollout(
        seq, tp, routes, rewards, exact, advantages, old, mask, replay, train_routes, sampler_logp, trainer, weights
    )


def sampled_externally(
    sample: Sample, model: nn.Module, prompts: torch.Tensor, answer_len: int, replay: str
) -> tuple[torch.Tensor, torch.Tensor, Routes | None]:
    """`sample(model, prompts, answer_len)`, checked: sequences [N, Tp + A] that start with `prompts` [N, Tp],
    log-probs [N, A] (returned as float32), and routes over those sequences (required for "rollout" replay).

    Example:
        >>> seq, logp, routes = sampled_externally(engine, model, prompts, 4, "rollout")  # doctest: +SKIP
    """
    seq, logp, routes = sample(model, prompts, answer_len)
    n, tp = prompts.shape
    if tuple(seq.shape) != (n, tp + answer_len) or not torch.equal(seq[:, :tp], prompts):
        raise ValueError(
            f"sample returned sequences of shape {list(seq.shape)}: expected the {n} prompts [{n}, {tp}], each "
            f"followed by {answer_len} tokens"
        )
    if tuple(logp.shape) != (n, answer_len):
        raise ValueError(f"sample returned log-probs of shape {list(logp.shape)}, expected [{n}, {answer_len}]")
    if routes is None and replay == "rollout":
        raise ValueError("replay='rollout' replays the sampler's routes, but sample returned none")
    if routes is not None and tuple(routes.shape[:2]) != (n, tp + answer_len):
        raise ValueError(
            f"sample returned routes over [B, T] = {list(routes.shape[:2])}, expected [{n}, {tp + answer_len}]"
        )
    return seq, logp.float(), routes


def minibatch_update(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batch: Rollout,
    index: torch.Tensor | None = None,
    *,
    importance_sampling_level: Level = "token",
    epsilon_low: float | None = None,
    epsilon_high: float | None = None,
    max_grad_norm: float = 1.0,
    off_policy_mask_threshold: float | None = None,
    live_counterfactual: bool = False,
    router_gradient: bool = False,
    replay: bool = True,
    flags: list[dict[str, torch.Tensor]] | None = None,
) -> dict[str, float]:
    """One optimizer step of the policy loss on the answers `index` (default: all) of `batch`, replaying its
    `train_routes` if it has any: train mode, forward, `policy_loss` (weighted by the batch's sampler correction
    and, with `off_policy_mask_threshold`, the off-policy sequence mask), backward, gradient clipping to
    `max_grad_norm`, step, zero_grad. Returns the loss, the gradient norm before clipping and the loss's metrics;
    `live_counterfactual` adds `clip_ratio/live_counterfactual`: the clip fraction a live-routed forward of the
    same weights would have had (for replayed batches: what replay changed), and the replay's bias at these weights
    (`replay_bias`); `router_gradient` adds the live-routed loss's router gradient norm and its cosine with the
    replayed one (`router_gradients`: one more forward and backward). The router gradient's norm
    (`router/grad_norm`) is always logged. `replay=False` routes this minibatch live even if the batch has routes
    to replay (`replay_max_age`). `flags`, if given, gets this
    minibatch's per-token clip flags and |log-ratio| appended (`clip_fractions`), for statistics pooled over tokens.

    Example:
        >>> m = minibatch_update(model, opt, batch, idx, importance_sampling_level="sequence")  # doctest: +SKIP
        >>> m["loss"], m["grad_norm"], m["clip_ratio/region_mean"]  # doctest: +SKIP
    """
    model.train()
    idx = slice(None) if index is None else index
    seq, old, adv, mask = batch.sequences[idx], batch.old_logp[idx], batch.advantages[idx], batch.mask[idx]
    routes = batch.train_routes[idx] if batch.train_routes is not None and index is not None else batch.train_routes
    routes = routes if replay else None
    live_counterfactual = live_counterfactual and routes is not None
    clip = dict(importance_sampling_level=importance_sampling_level, epsilon_low=epsilon_low, epsilon_high=epsilon_high)
    extra: dict[str, float] = {}
    if live_counterfactual:
        with torch.no_grad():
            live = answer_logp(model, seq, batch.prompt_len)
        extra["clip_ratio/live_counterfactual"] = (
            clip_fractions(live, old, adv, mask, **clip)["region"].float().mean().item()
        )
    logp = answer_logp(model, seq, batch.prompt_len, routes)
    weights = batch.weights[idx] if batch.weights is not None else None
    if off_policy_mask_threshold is not None:
        keep = off_policy_mask(adv, logp, batch.sampler_logp[idx], mask, off_policy_mask_threshold)
        extra["off_policy_mask/dropped"] = 1.0 - keep.mean().item()
        weights = keep if weights is None else weights * keep
    loss, metrics = policy_loss(logp, old, adv, mask, weights=weights, **clip)
    if flags is not None:
        flags.append(clip_fractions(logp.detach(), old, adv, mask, **clip))
    if live_counterfactual:
        extra.update(replay_bias(live, logp.detach(), mask))
    loss.backward()
    routers = router_parameters(model)
    grads = [p.grad for p in routers]
    extra["router/grad_norm"] = float(
        torch.stack([g.norm() for g in grads if g is not None] or [torch.zeros(())]).norm()
    )
    if router_gradient and routes is not None:

        def live_loss() -> torch.Tensor:
            return policy_loss(answer_logp(model, seq, batch.prompt_len), old, adv, mask, weights=weights, **clip)[0]

        extra.update(router_gradients(routers, grads, live_loss))
    grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_grad_norm)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if batch.weights is not None:  # the correction's own weights (not times the off-policy mask's zeros)
        extra["sampler_correction/weight_mean"] = batch.weights[idx].float().mean().item()
    return {"loss": loss.item(), "grad_norm": float(grad_norm), **metrics, **extra}
