"""What the RL tests share (the warm-started policy fixture, `init`, and `mismatch_seen` are in conftest.py): the small
policy shape, the small run and its `TrainConfig`, and the teacher-forced forward that routes are compared with."""

from __future__ import annotations

from typing import Any

import torch
from helpers import differ, near_ties, same_but_near_ties

from moe_replay import Routes, record_routes
from moe_replay.rl.config import TrainConfig

SMALL = {"num_hidden_layers": 2, "hidden_size": 32, "head_dim": 8, "moe_intermediate_size": 16, "num_experts": 8}
RUN = {"task_size": 2, "prompts": 4, "group_size": 4, "minibatches": 2}  # 2-digit sums, 4 prompts x 4 answers, μ 2


def config(tmp_path: Any, init: str | None, **kw: Any) -> TrainConfig:
    """A 3-step `RUN` from `init` into `tmp_path / "run"`, checkpointed every 2 steps; `kw` overrides any setting."""
    base = dict(output=str(tmp_path / "run"), init=init, steps=3, checkpoint_every=2, **RUN)
    return TrainConfig(**{**base, **kw})


def live_routes(model: torch.nn.Module, sequences: torch.Tensor) -> tuple[Routes, torch.Tensor]:
    """The live routes of a teacher-forced forward of `model` over `sequences` [N, T] (eval mode, no grad, as
    `teacher_forced_routes`; each module's mode is restored) and its near-ties, bool [N, T, L] (`helpers.near_ties`:
    routes sampled under generate may hold other experts there, by float noise alone)."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        with torch.no_grad(), record_routes(model) as rec:
            logits = model(sequences, output_router_logits=True).router_logits
    finally:
        for module, mode in modes:
            module.training = mode
    return rec.routes, near_ties(logits, rec.routes.top_k, tuple(sequences.shape))


def routed_live(model: torch.nn.Module, sequences: torch.Tensor, routes: Routes, prompt_len: int) -> torch.Tensor:
    """bool [N, A]: the answer tokens (from `prompt_len` on) whose log-prob is computed with the live experts of
    `model` at every earlier position and layer when `routes` (sampled under generate) are used there; checked with
    `same_but_near_ties`. (All of them unless float noise swapped a near-tie.)"""
    live, ties = live_routes(model, sequences)
    same_but_near_ties(routes, live, ties)
    moved = differ(routes, live).any(-1)  # [N, T]
    return (moved.cumsum(1) == 0)[:, prompt_len - 1 : -1]  # the answer token at t is predicted at t - 1
