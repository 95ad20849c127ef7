"""`Plan`: the routes one replayed router call must use (made by replay.py, applied by the selectors)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass(slots=True)
class Plan:
    """The routes one router call must use: `indices` [N, K] int64, `mask` [B, t] bool (False routes live).

    `source` is the replayer that made it, for layer `layer` of its routes. With `observe`, `on_live` is called once
    per forward call (not its recompute) with the experts the router would have picked live and those it was given,
    both [N, K] (`replay_routes(..., track_live=True)`). `groups_used(G)` is the most of G expert groups any
    recorded token of this layer uses (checked by group-limited routers). `device` is the indices' device.
    """

    indices: torch.Tensor
    mask: torch.Tensor
    num_experts: int
    top_k: int
    all_recorded: bool
    source: Any = None
    layer: int = 0
    observe: bool = False
    device: torch.device = field(init=False)

    def __post_init__(self) -> None:
        self.device = self.indices.device  # (read once per plan: a tensor's device is made anew at each read)

    def on_live(self, live: torch.Tensor, used: torch.Tensor) -> None:
        self.source.tally(self.layer, self.mask, live, used)

    def groups_used(self, G: int) -> int:
        return 0 if self.source is None else self.source.groups_used(self.layer, G)
