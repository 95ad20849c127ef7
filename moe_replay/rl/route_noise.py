"""A sampler that differs from the trainer only in which experts it selects: Gaussian noise on the selection scores,
gating weights the trainer's own (a fair test of R3, which replays the selection and recomputes the weights live).

Shapes: N tokens of a router call, E experts, K experts per token.
"""

from __future__ import annotations

import types

import torch
from torch import nn
from torch.nn import functional as F

from ..engines.hf import find_routers


def noisy_selection_forward(router: nn.Module, hidden_states: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """The Qwen3-MoE router's forward with `router.selection_noise` (a std) times standard Gaussian noise (drawn from
    `router.noise_generator`) added to its [N, E] logits for the top-k choice only: the returned logits (the aux
    loss's) and the gating weights at the chosen experts are the unperturbed softmax's, renormalised over the K
    chosen as the router does."""
    hidden_states = hidden_states.reshape(-1, router.hidden_dim)
    logits = F.linear(hidden_states, router.weight)
    probs = torch.softmax(logits, dtype=torch.float, dim=-1)
    noise = torch.randn(logits.shape, generator=router.noise_generator, dtype=torch.float, device=logits.device)
    indices = torch.topk(logits.float() + router.selection_noise * noise, router.top_k, dim=-1).indices
    weights = probs.gather(-1, indices)
    if router.norm_topk_prob:
        weights = weights / weights.sum(-1, keepdim=True)
    return logits, weights.to(logits.dtype), indices


def add_selection_noise(model: nn.Module, std: float, generator: torch.Generator) -> nn.Module:
    """Make every router of `model` (in place; Qwen3-MoE's softmax top-k router, the RL policy's) pick its experts by
    logits + `std` × N(0, 1) noise from `generator`, keeping the unperturbed gating weights and logits. Returns
    `model`. A router of another class is a ValueError naming it (its selection rule is not this one).

    Example:
        >>> sampler = add_selection_noise(copy.deepcopy(model), 0.5, torch.Generator().manual_seed(0))  # doctest: +SKIP
    """
    if not (std >= 0 and std != float("inf")):
        raise ValueError(f"selection noise must be a finite std >= 0, got {std}")
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    for site in find_routers(model):
        if type(site.router) is not Qwen3MoeTopKRouter:
            raise ValueError(
                f"selection noise supports Qwen3MoeTopKRouter (the RL policy's router), got "
                f"{type(site.router).__name__} at {site.name}"
            )
        site.router.selection_noise = std
        site.router.noise_generator = generator
        site.router.forward = types.MethodType(noisy_selection_forward, site.router)
    return model
