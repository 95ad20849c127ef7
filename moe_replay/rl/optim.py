"""The RL loop's optimizer set-up: the routers in a parameter group of their own when `router_lr` is set, and a
linear learning-rate warmup over the first `lr_warmup_steps` steps (a fresh Adam's first full-size steps move the
policy far: the optimizer shock round 3's decisive test measured)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..engines.hf import find_routers
from .config import TrainConfig

ROUTERS = "routers"  # the name of the routers' parameter group


def parameter_groups(model: nn.Module, cfg: TrainConfig) -> list[dict[str, Any]]:
    """The optimizer's parameter groups: every parameter at `cfg.lr`, or, with `cfg.router_lr`, the routers' own
    parameters (the modules `find_routers` finds) in a group "routers" at that rate and the rest at `cfg.lr`.

    Example:
        >>> opt = torch.optim.Adam(parameter_groups(model, cfg), lr=cfg.lr)  # doctest: +SKIP
    """
    if cfg.router_lr is None:
        return [{"name": "all", "params": list(model.parameters()), "base_lr": cfg.lr}]
    routers = {id(p) for site in find_routers(model) for p in site.router.parameters()}
    if not routers:
        raise ValueError(f"router_lr={cfg.router_lr} is set but {type(model).__name__}'s routers have no parameters")
    rest = [p for p in model.parameters() if id(p) not in routers]
    mine = [p for p in model.parameters() if id(p) in routers]
    return [
        {"name": "rest", "params": rest, "base_lr": cfg.lr},
        {"name": ROUTERS, "params": mine, "base_lr": cfg.router_lr, "lr": cfg.router_lr},
    ]


def set_learning_rates(opt: torch.optim.Optimizer, cfg: TrainConfig, step: int) -> dict[str, float]:
    """Set each group's rate for RL step `step` (0-based): its base rate x min(1, (step + 1) / `lr_warmup_steps`);
    returns them by group name for the step's log ("lr", and "lr/routers" with a router group).

    Example:
        >>> set_learning_rates(opt, TrainConfig(lr=1e-4, lr_warmup_steps=10), step=0)  # doctest: +SKIP
        {'lr': 1e-05}
    """
    factor = 1.0 if cfg.lr_warmup_steps == 0 else min(1.0, (step + 1) / cfg.lr_warmup_steps)
    rates = {}
    for group in opt.param_groups:
        group["lr"] = group["base_lr"] * factor
        rates["lr/routers" if group["name"] == ROUTERS else "lr"] = group["lr"]
    return rates
