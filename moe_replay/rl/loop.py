"""The RL loop: each step a `rollout` (B prompts x G answers sampled with routes recorded, rewards, advantages, old
log-probs) and μ `minibatch_update`s with GRPO / GSPO / GSPO-token, with or without Routing Replay. Logs are tidy
CSVs, flushed every step; a checkpoint every few steps lets a killed run resume and produce the same log.

Example:
    >>> out = train(TrainConfig(steps=50, replay="rollout"))  # doctest: +SKIP
"""

from __future__ import annotations

import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..analysis import expert_change, teacher_forced_routes
from .config import TrainConfig
from .config_check import check_resumable
from .diagnostics import EVAL_KEYS, heldout_eval, k3_kl, mean_rows, pooled_stats
from .logs import append_rows, truncate_rows
from .optim import parameter_groups, set_learning_rates
from .policy import build_policy, sampled_reward, scale_routers, warm_start
from .sampler import make_sampler, mismatch_metrics
from .step import answer_logp, minibatch_update, rollout
from .tasks import Task

STEP_LOG, MINIBATCH_LOG, CHECKPOINT = "steps.csv", "minibatches.csv", "checkpoint"
WARM_START_FILE = "warm_start.json"  # in `init`: the settings it was warm-started with
WARM_START_SETTINGS = ("policy", "seed", "task", "task_size", "warm_start_steps", "warm_start_lr", "warm_start_target")
# called before each minibatch update with (model, batch, minibatch j from 0, its answer indices): metrics to log
Observer = Callable[[nn.Module, Any, int, torch.Tensor], dict[str, float]]
# an external sampler: (model, prompts [N, Tp], answer_len, step from 0) -> sequences [N, Tp + A], its log-probs of the
# sampled tokens [N, A], its routes or None (`rollout`'s `sample`, told the step; e.g. integrations.vllm_sampler)
LoopSample = Callable[[nn.Module, torch.Tensor, int, int], tuple[torch.Tensor, torch.Tensor, Any]]


class Run:
    """One training run (see `train`)."""

    def __init__(self, config: TrainConfig, observe: Observer | None = None, sample: LoopSample | None = None) -> None:
        simulated = (config.rollout_dtype, config.rollout_weight_quant, config.rollout_selection_noise)
        if sample is not None and simulated != ("float32", "none", 0.0):
            raise ValueError(
                "an external `sample` is the sampler: leave rollout_dtype, rollout_weight_quant and "
                f"rollout_selection_noise at their defaults (got {simulated})"
            )
        self.cfg = config
        self.observe = observe
        self.sample = sample
        self.out = Path(config.output)
        self.task = Task(config.task, config.task_size)
        self.step = 0

    # ---- set-up ------------------------------------------------------------------------------------------------
    def setup(self, resume: bool, progress: bool) -> None:
        cfg = self.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        ckpt = self.out / CHECKPOINT
        resuming = resume and (ckpt / "state.pt").exists()
        if resuming:
            check_resumable(self.out / "config.json", cfg.to_dict())
        (self.out / "config.json").write_text(json.dumps(cfg.to_dict(), indent=2))
        if resuming:
            from transformers import AutoModelForCausalLM

            self.model = AutoModelForCausalLM.from_pretrained(ckpt)
            self._make_optimizer()
            state = torch.load(ckpt / "state.pt", weights_only=False)
            self.opt.load_state_dict(state["optimizer"])
            self.step = state["step"]
            if cfg.steps < self.step:
                raise ValueError(
                    f"{self.out} holds a run of {self.step} steps; resuming it with steps={cfg.steps} would label it "
                    f"a {cfg.steps}-step run: resume with steps >= {self.step}, or start over (`--fresh`)"
                )
            torch.set_rng_state(state["torch_rng"])
            self.task_gen.set_state(state["task_rng"])
            self.perm_gen.set_state(state["perm_rng"])
            truncate_rows(self.out / STEP_LOG, self.step)
            truncate_rows(self.out / MINIBATCH_LOG, self.step)
            return
        for name in (STEP_LOG, MINIBATCH_LOG):
            (self.out / name).unlink(missing_ok=True)
        for stale in (ckpt, self.out / (CHECKPOINT + ".tmp")):  # (another run's: a later resume would continue it)
            if stale.exists():
                shutil.rmtree(stale)
        self.model = self._initial_policy(progress)
        if cfg.router_scale != 1.0:
            scale_routers(self.model, cfg.router_scale)
        torch.manual_seed(cfg.seed)
        self._make_optimizer()

    def _make_optimizer(self) -> None:
        self.opt = torch.optim.Adam(parameter_groups(self.model, self.cfg), lr=self.cfg.lr)
        self.task_gen = torch.Generator().manual_seed(self.cfg.seed + 1)
        self.perm_gen = torch.Generator().manual_seed(self.cfg.seed + 2)
        n = self.cfg.heldout_prompts
        self.heldout = self.task.heldout(n, seed=self.cfg.seed + 10_000) if n else None
        self.exclude = frozenset(tuple(p) for p in self.heldout[0].tolist()) if n else None

    def _initial_policy(self, progress: bool) -> nn.Module:
        from transformers import AutoModelForCausalLM

        cfg = self.cfg
        init = Path(cfg.init) if cfg.init else self.out / "init"
        settings = {k: getattr(cfg, k) for k in WARM_START_SETTINGS}
        saved = init / WARM_START_FILE
        if saved.exists() and (before := json.loads(saved.read_text())) != json.loads(json.dumps(settings)):
            if cfg.init:  # a shared one: another run's warm start
                changed = [k for k in settings if before.get(k) != settings[k]]
                diff = ", ".join(f"{k}={before.get(k)!r} (now {settings[k]!r})" for k in changed)
                raise ValueError(
                    f"init {init} was warm-started with {diff}: point `init` at another directory for these settings, "
                    "or delete it"
                )
            shutil.rmtree(init)  # the run's own, from the settings it had before `--fresh`: warm-started again
        if not (init / "config.json").exists():  # warm start once; runs that name the same `init` share it
            model = build_policy(cfg.policy, seed=cfg.seed)
            bar = _bar(cfg.warm_start_steps, "warm start", progress)
            warm_start(
                model,
                self.task,
                steps=cfg.warm_start_steps,
                lr=cfg.warm_start_lr,
                seed=cfg.seed,
                target_reward=cfg.warm_start_target,
                progress=lambda s, loss, r: bar.update(1) or bar.set_postfix(loss=f"{loss:.3f}", reward=r),
            )
            bar.close()
            model.save_pretrained(init)
            saved.write_text(json.dumps(settings, indent=2))
        return AutoModelForCausalLM.from_pretrained(init)

    # ---- one step ----------------------------------------------------------------------------------------------
    def train_step(self) -> dict[str, Any]:
        """Sample one batch (`rollout`), log its reward and diagnostics, then make `minibatches` updates
        (`minibatch_update`); returns the step's row and the minibatches' rows."""
        cfg, model = self.cfg, self.model
        t0 = time.perf_counter()
        rates = set_learning_rates(self.opt, cfg, self.step)
        prompts, answers = self.task.sample(cfg.prompts, self.task_gen, exclude=self.exclude)
        step, sample = self.step, self.sample
        external = None if sample is None else lambda m, p, a: sample(m, p, a, step)
        noise = torch.Generator().manual_seed(cfg.seed * 1_000_003 + step)
        sampler = None if sample is not None else make_sampler(model, cfg.rollout_dtype, cfg.rollout_weight_quant,
                                                   cfg.rollout_selection_noise, noise)  # fmt: skip
        batch = rollout(
            model,
            self.task,
            prompts,
            answers,
            group_size=cfg.group_size,
            replay=cfg.replay,
            sampler=sampler,
            sample=external,
            partial_credit=cfg.partial_credit,
            old_logprob_source=cfg.old_logprob_source,
            correction=cfg.sampler_correction,
            correction_clip=(cfg.sampler_correction_clip_min, cfg.sampler_correction_clip_max),
        )
        t_rollout = time.perf_counter() - t0
        row: dict[str, Any] = {
            "step": self.step + 1,
            "reward_mean": float(batch.rewards.mean()),
            "exact_match": float(batch.exact.mean()),
            **rates,
            **mismatch_metrics(batch.trainer_logp, batch.sampler_logp, batch.mask),
        }
        live = teacher_forced_routes(model, batch.sequences) if cfg.diagnostics else None
        sampled = batch.routes is not None  # (an external sampler may return no routes)
        if live is not None:
            if sampled:
                mismatch = expert_change(batch.routes, live)
                row["mismatch/fraction"] = mismatch.fraction
                row["mismatch/token_changed"] = mismatch.token_changed
            before = batch.trainer_logp if cfg.replay == "off" else self._live_logp(batch)

        mb_rows, flags = [], []
        for j, idx in enumerate(batch.minibatch_indices(cfg.minibatches, self.perm_gen)):
            seen = self.observe(model, batch, j, idx) if self.observe is not None else {}
            metrics = minibatch_update(
                model,
                self.opt,
                batch,
                idx,
                importance_sampling_level=cfg.importance_sampling_level,
                epsilon_low=cfg.epsilon_low,
                epsilon_high=cfg.epsilon_high,
                max_grad_norm=cfg.max_grad_norm,
                off_policy_mask_threshold=cfg.off_policy_mask_threshold,
                live_counterfactual=cfg.diagnostics and cfg.replay != "off",
                router_gradient=cfg.router_gradient_check,
                replay=cfg.replay_max_age is None or j < cfg.replay_max_age,
                flags=flags,
            )
            mb = {"step": self.step + 1, "minibatch": j, **metrics, **seen}
            if live is not None:
                # how far the live routing of the model this minibatch trained has moved from the sampled routes
                if sampled:
                    mb["routes_moved_since_rollout"] = expert_change(batch.routes, live).fraction
                after = teacher_forced_routes(model, batch.sequences)
                mb["expert_change"] = expert_change(live, after).fraction
                live = after
            mb_rows.append(mb)
        row.update(mean_rows(mb_rows))
        row["clip_ratio/region_first_minibatch"] = mb_rows[0]["clip_ratio/region_mean"]
        row.update(pooled_stats(flags[:1], "first_minibatch"))
        row.update(pooled_stats(flags[1:], "later_minibatches"))
        if live is not None:
            if sampled:
                row["routes_moved_since_rollout/last_minibatch"] = mb_rows[-1]["routes_moved_since_rollout"]
            row["policy/kl_consecutive"] = k3_kl(before, self._live_logp(batch), batch.mask)
        self.step += 1
        if cfg.eval_every:  # every row has the eval columns (a CSV keeps its first row's header): NaN between evals
            row.update(dict.fromkeys(EVAL_KEYS, float("nan")))
            if self.step % cfg.eval_every == 0:
                row.update(heldout_eval(model, self.task, *self.heldout, seed=cfg.seed + 20_000 + self.step))
        row["seconds"] = time.perf_counter() - t0
        row["seconds_rollout"] = t_rollout
        return {"step": row, "minibatches": mb_rows}

    @torch.no_grad()
    def _live_logp(self, batch: Any) -> torch.Tensor:
        """[N, A] the trainer's live-routed log-probs of the batch's answers (eval mode, no grad)."""
        was_training = self.model.training
        self.model.eval()
        try:
            return answer_logp(self.model, batch.sequences, batch.prompt_len)
        finally:
            self.model.train(was_training)

    # ---- persistence -------------------------------------------------------------------------------------------
    def checkpoint(self) -> None:
        ckpt = self.out / CHECKPOINT
        tmp = self.out / (CHECKPOINT + ".tmp")
        self.model.save_pretrained(tmp)
        state = {
            "step": self.step,
            "optimizer": self.opt.state_dict(),
            "torch_rng": torch.get_rng_state(),
            "task_rng": self.task_gen.get_state(),
            "perm_rng": self.perm_gen.get_state(),
        }
        torch.save(state, tmp / "state.pt")
        if ckpt.exists():
            shutil.rmtree(ckpt)
        tmp.rename(ckpt)


def train(
    config: TrainConfig,
    *,
    resume: bool = True,
    progress: bool = True,
    stop_after: int | None = None,
    observe: Observer | None = None,
    sample: LoopSample | None = None,
) -> Path:
    """Run (or resume) RL training; returns the output directory holding steps.csv, minibatches.csv, checkpoint/.

    `stop_after` ends the process early after that many steps of this call (to test resuming). `observe(model,
    batch, j, idx)`, if given, is called before each minibatch update (j from 0, `idx` its answers, the model at the
    weights that update starts from); the metrics it returns go into that minibatch's row (and their means over the
    minibatches that returned them into the step's). It must leave the weights and the RNG as they are.
    `sample(model, prompts, answer_len, step)`, if given, samples each step's answers instead of the loop's own
    sampler (an inference engine, e.g. `integrations.vllm_sampler.VLLMSampler`; see `rollout`'s `sample`): it gets
    the trainer at the sampling weights, the prompts repeated `group_size` times and the step (from 0), and must leave
    the weights and the RNG as they are (a resumed run then logs what the first would have).

    Example:
        >>> out = train(TrainConfig(steps=50, replay="rollout"))  # doctest: +SKIP
        >>> import pandas as pd; pd.read_csv(out / "steps.csv").reward_mean.tail()  # doctest: +SKIP
    """
    run = Run(config, observe, sample)
    run.setup(resume, progress)
    bar = _bar(config.steps, f"{config.importance_sampling_level}/replay={config.replay}", progress)
    bar.update(run.step)
    done = 0
    while run.step < config.steps and (stop_after is None or done < stop_after):
        logs = run.train_step()
        append_rows(run.out / STEP_LOG, [logs["step"]])
        append_rows(run.out / MINIBATCH_LOG, logs["minibatches"])
        done += 1
        if run.step % config.checkpoint_every == 0 or run.step == config.steps:
            run.checkpoint()
        bar.update(1)
        bar.set_postfix(
            reward=f"{logs['step']['reward_mean']:.3f}", clip=f"{logs['step']['clip_ratio/region_mean']:.3f}"
        )
    bar.close()
    return run.out


def initial_policy(config: TrainConfig, progress: bool = False) -> nn.Module:
    """The policy a fresh run of `config` starts from: its warm start, loaded from `init` (default `<output>/init`),
    made there first if missing, as `train` makes it (so that an experiment can judge a warm start before any run
    trains from it, and the runs then reuse it).

    Example:
        >>> model = initial_policy(TrainConfig(init="runs/init_seed0", task="pair_sum", task_size=16))  # doctest: +SKIP
    """
    return Run(config)._initial_policy(progress)


def evaluate(config: TrainConfig, n: int = 512) -> float:
    """Sampled reward of the run's latest checkpoint on fresh prompts."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(Path(config.output) / CHECKPOINT)
    return sampled_reward(model, Task(config.task, config.task_size), n=n, seed=10_000 + config.seed)


def _bar(total: int, desc: str, enabled: bool):  # noqa: ANN202
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=not enabled, dynamic_ncols=True)
