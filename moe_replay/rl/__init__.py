"""Reinforcement learning on MoE policies: losses (pure functions), tasks, the tiny policy, the training loop."""

from .losses import DEFAULT_EPSILON, group_advantages, policy_loss

__all__ = ["DEFAULT_EPSILON", "group_advantages", "policy_loss"]
