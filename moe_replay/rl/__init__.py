"""Reinforcement learning on MoE policies: losses (pure functions), tasks, the tiny policy, one RL step (`rollout`,
`minibatch_update`) and the training loop built from it.

Example:
    >>> from moe_replay.rl import TrainConfig, train
    >>> out = train(TrainConfig(steps=50, replay="rollout"))  # doctest: +SKIP
"""

from .config import REPLAY_MODES, TrainConfig, load_config
from .loop import train
from .losses import DEFAULT_EPSILON, group_advantages, policy_loss
from .policy import DEFAULT_POLICY, build_policy, sample_answers, sampled_reward, scale_routers, warm_start
from .step import Rollout, answer_logp, minibatch_update, rollout
from .tasks import Task

__all__ = [
    "DEFAULT_EPSILON",
    "DEFAULT_POLICY",
    "REPLAY_MODES",
    "Rollout",
    "Task",
    "TrainConfig",
    "answer_logp",
    "build_policy",
    "group_advantages",
    "load_config",
    "minibatch_update",
    "policy_loss",
    "rollout",
    "sample_answers",
    "sampled_reward",
    "scale_routers",
    "train",
    "warm_start",
]
