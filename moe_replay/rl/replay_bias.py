"""What replay changes inside one minibatch update, at the same weights: the bias between the replayed and the live
policy on the minibatch's tokens, and the router gradient with and without replay (why replay can hurt).

Shapes: n answers of the minibatch, A answer tokens.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .diagnostics import k3_kl


def router_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The trainable parameters of `model`'s MoE routers, in module order.

    Example:
        >>> sum(p.numel() for p in router_parameters(model))  # doctest: +SKIP
    """
    from ..engines.hf import find_routers

    return [p for site in find_routers(model) for p in site.router.parameters() if p.requires_grad]


def replay_bias(live: torch.Tensor, replayed: torch.Tensor, mask: torch.Tensor) -> dict[str, float]:
    """The replayed policy against the live-routed one on the same tokens at the same weights, from their [n, A]
    log-probs: KL(replayed ‖ live) by k3 on these tokens, and the mean |log π_replayed − log π_live|.

    Example:
        >>> replay_bias(live_logp, logp.detach(), mask)["replay_bias/kl_k3"]  # doctest: +SKIP
    """
    diff = (replayed.double() - live.double())[mask.bool()]
    return {
        "replay_bias/kl_k3": k3_kl(replayed, live, mask),
        "replay_bias/abs_log_ratio_mean": float(diff.abs().mean()) if diff.numel() else 0.0,
    }


def router_gradients(
    routers: list[nn.Parameter], replayed: list[torch.Tensor | None], live_loss: Callable[[], torch.Tensor]
) -> dict[str, float]:
    """The router gradient the same loss would have had routed live (`live_loss()`, a fresh forward at the same
    weights) against the replayed one (`replayed`: the routers' `.grad` after the replayed backward): its norm and
    the cosine between the two. Leaves every `.grad` as it was.

    Example:
        >>> router_gradients(params, [p.grad for p in params], lambda: live_policy_loss())  # doctest: +SKIP
    """
    live = torch.autograd.grad(live_loss(), routers, allow_unused=True)

    def flat(grads: list[torch.Tensor | None] | tuple[torch.Tensor | None, ...]) -> torch.Tensor:
        pairs = zip(grads, routers, strict=True)
        return torch.cat([(torch.zeros_like(p) if g is None else g).reshape(-1) for g, p in pairs])

    a, b = flat(replayed), flat(live)
    norm = b.norm()
    cos = (
        torch.nn.functional.cosine_similarity(a, b, dim=0) if norm > 0 and a.norm() > 0 else torch.tensor(float("nan"))
    )
    return {"router/grad_norm_live": float(norm), "router/grad_cosine_live": float(cos.clamp(-1, 1))}
