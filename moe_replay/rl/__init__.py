"""Reinforcement learning on MoE policies: losses (pure functions), tasks, the tiny policy, the training loop."""

from .config import TrainConfig, load_config
from .loop import train
from .losses import DEFAULT_EPSILON, group_advantages, policy_loss
from .policy import DEFAULT_POLICY, build_policy, sampled_reward, scale_routers, warm_start
from .tasks import Task

__all__ = [
    "DEFAULT_EPSILON",
    "DEFAULT_POLICY",
    "Task",
    "TrainConfig",
    "build_policy",
    "group_advantages",
    "load_config",
    "policy_loss",
    "sampled_reward",
    "scale_routers",
    "train",
    "warm_start",
]
