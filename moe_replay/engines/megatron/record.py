"""`record_routes` on megatron-core models: every router runs its own top-k under RECORD; after each forward the rows
become one `Routes` batch [B, T, L, K]. With sequence parallelism each tensor-parallel rank routes a slice of the
sequence; the slices are gathered so every rank holds the whole batch. Under context parallelism each rank records
its own part of the sequence, as a `CPRoutes` that knows its place (`from_cp` joins the ranks' parts).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ...errors import ReplayError
from ...routes import Routes, index_dtype
from ...routes.cp import part_of
from ...routes.packed import PackedRoutes
from ..autograd import in_backward
from .context import PackedBounds, RouterReplayContext, Site, tp_split


class MegatronRouteRecorder(RouterReplayContext):
    """Context manager returned by `record_routes`; `.routes` holds what was recorded."""

    def _prepare(self, sites: list[Site]) -> None:
        self._done: list[list[dict[str, torch.Tensor]]] = [[] for _ in self.chunks]  # per chunk, per forward
        self._bounds: list[list[PackedBounds | None]] = [[] for _ in self.chunks]  # each forward's packed boundaries
        self._current: list[dict[str, torch.Tensor]] = [{} for _ in self.chunks]

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
        current = self._current[site.chunk]
        if site.name in current:
            raise ReplayError(f"router {site.name!r} ran twice in one forward; record one forward at a time")
        current[site.name] = rows.transpose(0, 1)  # [B, S, K]

    def _forward_starts(self, chunk: int) -> None:
        self._current[chunk] = {}  # a forward that raised may have left some layers behind

    def _forward_ends(self, chunk: int) -> None:
        current, self._current[chunk] = self._current[chunk], {}
        if not current:
            return
        missing = [s.name for s in self.sites if s.chunk == chunk and s.name not in current]
        if missing:
            raise ReplayError(f"routers {missing} did not run in this forward; recorded only {list(current)}")
        self._done[chunk].append(current)
        self._bounds[chunk].append(self._packed[chunk])

    @property
    def batches(self) -> list[Routes]:
        """One `Routes` per recorded forward (per micro-batch: with virtual-pipeline chunks, the n-th forward of
        every chunk together), holding the layers of the given module(s) in whole-model order."""
        counts = [len(self._done[c]) for c in sorted({s.chunk for s in self.sites})]  # chunks that have routers
        if len(set(counts)) > 1:
            raise ReplayError(f"the chunks recorded different numbers of forwards {counts}: finish every micro-batch")
        layers = tuple(s.info for s in self.sites)
        dtype = index_dtype(max(info.num_experts for info in layers))
        out = []
        for n in range(counts[0] if counts else 0):
            indices = torch.stack([self._done[s.chunk][n][s.name] for s in self.sites], dim=2).to(dtype)
            mask = torch.ones(indices.shape[:2], dtype=torch.bool, device=indices.device)
            routes = Routes._trusted(indices, mask, layers)
            bounds = self._bounds[self.sites[0].chunk][n]
            if self._cp[0] > 1:  # this rank's part of the sequence, in the layout its batch was split in
                routes = part_of(routes, *self._cp, None if bounds is None else bounds[1])
            elif bounds is not None:  # a packed row: its replay is checked against a forward of the same row
                routes = PackedRoutes.placed(routes, cu_seqlens=bounds[0], cu_seqlens_padded=bounds[1])
            out.append(routes)
        return out

    @property
    def routes(self) -> Routes:
        """Everything recorded, as one `Routes` [B, T, L, K] (several forwards are concatenated along B; under
        context parallelism, only forwards of whole sequences, which keep the per-sequence layout)."""
        batches = self.batches
        if not batches:
            raise ValueError("nothing was recorded: run a forward inside `with record_routes(model)`")
        if len(batches) == 1:
            return batches[0]
        if any(isinstance(b, PackedRoutes) for b in batches):
            raise ValueError(
                "packed rows of several forwards do not join into one Routes that knows each row's sequences: use "
                "`rec.batches` (one PackedRoutes per forward)"
            )
        if self._cp[0] > 1:
            if any(b.cu_seqlens_padded is not None or b.seq_len != batches[0].seq_len for b in batches):
                raise ValueError(
                    "under context parallelism only forwards of whole sequences of one length join into one part: "
                    "use `rec.batches` (one part per forward)"
                )
            return part_of(Routes.cat(batches), *self._cp, None)
        return Routes.cat(batches)


def record_routes(model: nn.Module | Sequence[nn.Module]) -> MegatronRouteRecorder:
    """Record the experts every router of a megatron-core model selects, for every token of each forward.

    Gives a `Routes` [B, T, L, K] per forward (`rec.batches`; `rec.routes` joins them), all positions recorded;
    layers are named by module path. Recomputes under activation recompute are not recorded twice. Under pipeline
    parallelism pass a stage's model (or its list of virtual-pipeline chunks): the routes hold that stage's layers,
    named by their global layer number, one `Routes` per micro-batch; `gather_pipeline_routes` joins the stages.
    Under context parallelism each rank records its part of the sequence as a `CPRoutes` (per sequence, or per
    document for a packed batch given `PackedSeqParams`); `from_cp` joins the ranks' parts.

    Example:
        >>> with record_routes(gpt_model) as rec:  # doctest: +SKIP
        ...     gpt_model(tokens, position_ids, attention_mask)
        >>> routes = rec.routes  # [B, T, L, K]
    """
    return MegatronRouteRecorder(model)
