"""`record_routes` on megatron-core models: every router runs its own top-k under RECORD; after each forward the rows
become one `Routes` batch [B, T, L, K]. With sequence parallelism each tensor-parallel rank routes a slice of the
sequence; the slices are gathered so every rank holds the whole batch.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ...errors import ReplayError
from ...routes import Routes, index_dtype
from ..autograd import in_backward
from .context import RouterReplayContext, Site, tp_split


class MegatronRouteRecorder(RouterReplayContext):
    """Context manager returned by `record_routes`; `.routes` holds what was recorded."""

    def _prepare(self, sites: list[Site]) -> None:
        self._batches: list[Routes] = []
        self._current: dict[str, torch.Tensor] = {}

    def _router_pre_hook(self, site: Site) -> Any:
        record = self._action.RECORD

        def hook(module: nn.Module, args: Any) -> None:
            if not in_backward():
                self._check_call(site)
            site.used = False
            site.mask = None
            rr = module.router_replay
            rr.recorded_topk_idx = None
            rr.set_router_replay_action(record)

        return hook

    def _after_router(self, site: Site, hidden: torch.Tensor) -> None:
        if in_backward():  # an activation recompute re-running this router: already recorded
            return
        rr = site.router.router_replay
        S, B = hidden.shape[:2]
        rows = rr.recorded_topk_idx.detach().clone().reshape(S, B, -1)  # newer versions reuse a static buffer
        group, size, _ = tp_split(site)
        if size > 1:
            parts = [torch.empty_like(rows) for _ in range(size)]
            torch.distributed.all_gather(parts, rows.contiguous(), group=group)
            rows = torch.cat(parts, dim=0)
        if site.name in self._current:
            raise ReplayError(f"router {site.name!r} ran twice in one forward; record one forward at a time")
        self._current[site.name] = rows.transpose(0, 1)  # [B, S, K]

    def _forward_starts(self) -> None:
        self._current = {}  # a forward that raised may have left some layers behind

    def _forward_ends(self) -> None:
        current, self._current = self._current, {}
        if not current:
            return
        missing = [s.name for s in self.sites if s.name not in current]
        if missing:
            raise ReplayError(f"routers {missing} did not run in this forward; recorded only {list(current)}")
        layers = [s.info for s in self.sites]
        dtype = index_dtype(max(info.num_experts for info in layers))
        indices = torch.stack([current[s.name] for s in self.sites], dim=2).to(dtype)
        mask = torch.ones(indices.shape[:2], dtype=torch.bool, device=indices.device)
        self._batches.append(Routes._trusted(indices, mask, tuple(layers)))

    @property
    def batches(self) -> list[Routes]:
        """One `Routes` per recorded forward."""
        return list(self._batches)

    @property
    def routes(self) -> Routes:
        """Everything recorded, as one `Routes` [B, T, L, K] (several forwards are concatenated along B)."""
        if not self._batches:
            raise ValueError("nothing was recorded: run a forward inside `with record_routes(model)`")
        return self._batches[0] if len(self._batches) == 1 else Routes.cat(self._batches)


def record_routes(model: nn.Module) -> MegatronRouteRecorder:
    """Record the experts every router of a megatron-core model selects, for every token of each forward.

    Gives a `Routes` [B, T, L, K] per forward (`rec.batches`; `rec.routes` joins them), all positions recorded;
    layers are named by module path. Recomputes under activation recompute are not recorded twice.

    Example:
        >>> with record_routes(gpt_model) as rec:  # doctest: +SKIP
        ...     gpt_model(tokens, position_ids, attention_mask)
        >>> routes = rec.routes  # [B, T, L, K]
    """
    return MegatronRouteRecorder(model)
