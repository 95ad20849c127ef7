"""`replay_routes` on megatron-core models: before each router call the rows for that call are handed to
`RouterReplay` (REPLAY_FORWARD); its scores are gathered at the replayed experts, so the router keeps its gradient.
Activation recompute runs the first forward of a checkpointed block without grad inside a forward with grad; those
calls queue their rows with a fingerprint of the router input, and when the backward re-runs them they switch to
REPLAY_BACKWARD and take the rows of the forward whose input the recompute reproduces, in any backward order.
Positions the routes mark as not recorded (padding) route live. Under context parallelism each rank replays its own
part of the routes (`moe_replay.routes.to_cp`), checked against the rank and against the layout its batch was split in.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ...errors import ReplayError
from ...layers import match_layers
from ...routes import Routes
from ...routes.cp import CPRoutes
from ..autograd import checkpoint_chain, in_backward, recomputing
from ..fingerprint import fingerprint
from ..recompute_queue import Pending
from .context import RouterReplayContext, Site, tp_split
from .pipeline import stage_columns
from .routers import is_mtp, pipelined
from .rows import to_layer_rows


class MegatronRouteReplayer(RouterReplayContext):
    """Context manager returned by `replay_routes`."""

    def __init__(
        self, model: nn.Module | Sequence[nn.Module], routes: Routes | Sequence[Routes], *, track_live: bool = False
    ) -> None:
        self.per_forward = not isinstance(routes, Routes)
        routes_list = list(routes) if self.per_forward else [routes]
        bad = [type(r).__name__ for r in routes_list if not isinstance(r, Routes)]
        if bad or not routes_list:
            raise ValueError(
                f"replay_routes needs a Routes or a non-empty list of Routes, got {bad or 'an empty list'}"
            )
        super().__init__(model)
        self.routes = routes
        self.track_live = track_live
        # per layer column: replayed expert slots whose live pick differs, and replayed tokens compared (`live_moved`)
        self._moved = self._compared = None
        if track_live:
            L, device = max(len(r.layers) for r in routes_list), routes_list[0].device
            self._moved = torch.zeros(L, dtype=torch.int64, device=device)
            self._compared = torch.zeros(L, dtype=torch.int64, device=device)

    def _prepare(self, sites: list[Site]) -> None:
        self._rows: list[dict[str, torch.Tensor]] = []  # per Routes: router name -> [T, B, K] int64
        self._masks: list[torch.Tensor] = []  # per Routes: [T, B] bool, sequence-major like Megatron's rows
        self._complete: list[bool] = []  # per Routes: every position recorded
        self._columns: list[dict[str, int]] = []  # per Routes: router name -> its layer column
        given = self.routes if self.per_forward else [self.routes]
        self._layouts = [self._check_place(r, n) for n, r in enumerate(given)]
        # multi-token-prediction routers route live when the routes hold no such layer (a rollout engine's): they
        # act after the main head, so the policy's log-probs do not depend on them
        covers = {any(is_mtp(layer.name) for layer in r.layers) for r in given}
        if len(covers) > 1:
            raise ReplayError("some of the Routes hold multi-token-prediction layers and some do not: pass alike ones")
        self._live = set() if covers.pop() else {s.name for s in sites if is_mtp(s.name)}
        replayed = [s for s in sites if s.name not in self._live]
        for r in given:
            shapes = {s.name: (s.info.num_experts, s.info.top_k) for s in replayed}
            if pipelined(sites[0].router.config):  # a stage: the whole model's routes, or its own part
                columns = stage_columns(replayed, r.layers, self._owner(), shapes)
            else:
                columns = match_layers([s.name for s in replayed], r.layers, self._owner(), shapes)
            T, B = r.seq_len, r.batch_size
            rows = to_layer_rows(r)  # unrecorded positions get valid ids (they route live anyway)
            self._rows.append({s.name: rows[columns[s.name]].reshape(T, B, -1) for s in replayed})
            self._columns.append(columns)
            self._masks.append(r.mask.transpose(0, 1))
            self._complete.append(bool(r.mask.all()))  # once here, not a device sync per router call
        self._consumed = False

    def _check_place(self, routes: Routes, n: int) -> tuple[int, ...] | None:
        """Under context parallelism the routes must be this rank's part; its layout (None: per sequence)."""
        size, rank = self._cp
        which = f" (forward {n + 1})" if self.per_forward else ""
        placed = isinstance(routes, CPRoutes)
        if size > 1 and not placed:
            raise ReplayError(
                f"the model runs context parallel (this is CP rank {rank} of {size}) but the routes{which} are not a "
                f"CP part: pass moe_replay.routes.to_cp(routes, cp_size={size}, cp_rank={rank}) (with "
                "cu_seqlens_padded= for a packed batch), as megatron-core's get_batch_on_this_cp_rank splits the batch"
            )
        if placed and (routes.cp_size, routes.cp_rank) != (size, rank):
            raise ReplayError(f"the routes{which} are {routes.where()} but this is CP rank {rank} of {size}")
        return routes.cu_seqlens_padded if placed else None

    def _check_layout(self, chunk: int, layout: tuple[int, ...] | None) -> None:
        """Under CP, the forward about to start (its batch split in `layout`) must take routes split the same way."""
        n = self._forwards[chunk] if self.per_forward else 0
        if n < len(self._layouts) and layout != self._layouts[n]:

            def words(cu: tuple[int, ...] | None) -> str:
                return (
                    "whole sequences (per-sequence layout)" if cu is None else f"a packed row of documents {list(cu)}"
                )

            raise ReplayError(
                f"forward {n + 1} got {words(layout)} but its routes were split for {words(self._layouts[n])}: split "
                "them with moe_replay.routes.to_cp as the batch was split"
            )

    def _call_rows(self, site: Site, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This call's rows [S_local * B, K] and mask [S_local * B] (None: all recorded), checked against the
        call's shape."""
        self._check_call(site)
        n = self._forwards[site.chunk] - 1 if self.per_forward else 0
        if n >= len(self._rows):
            raise ReplayError(f"routes were given for {len(self._rows)} forwards but forward {n + 1} ran")
        S, B = hidden.shape[:2]
        _, size, rank = tp_split(site)
        T, held_b = self._masks[n].shape
        if held_b != B or S * size != T:
            split = f" ({size} sequence-parallel slices of {S})" if size > 1 else ""
            which = f" (forward {n + 1})" if self.per_forward else ""
            raise ReplayError(
                f"routes{which} hold B={held_b} sequences of T={T} positions but router {site.name!r} got a batch "
                f"of {B} sequences of {S * size} positions{split}"
            )
        span = slice(rank * S, (rank + 1) * S)
        site.column = self._columns[n][site.name]
        rows = self._rows[n][site.name][span].reshape(S * B, -1)
        return rows, None if self._complete[n] else self._masks[n][span].reshape(S * B)

    def _router_pre_hook(self, site: Site) -> Any:
        forward, backward = self._action.REPLAY_FORWARD, self._action.REPLAY_BACKWARD

        def hook(module: nn.Module, args: Any) -> None:
            rr = module.router_replay
            site.used = site.track = False
            if site.name in self._live:  # (a multi-token-prediction router the routes do not cover)
                site.mask = None
                rr.set_router_replay_action(None)
                return
            if in_backward():  # activation recompute: the rows of the forward it re-runs, in any backward order
                queue, backward_list = site.pending, rr.replay_backward_list
                if len(backward_list) != len(queue.items):
                    raise ReplayError(
                        f"router {site.name!r}: megatron's REPLAY_BACKWARD queue was changed from outside the context"
                    )
                queued = queue.take(fingerprint(args[0]), recomputing())
                if queued is None:
                    raise ReplayError(
                        f"router {site.name!r} is recomputed in the backward but no replayed forward awaits it: "
                        "run the forward inside the same `with replay_routes(...)`"
                    )
                rows, site.mask = queued.routes
                # megatron's queue hands its first rows to the recompute: these first (they are the very tensor)
                backward_list.insert(0, backward_list.pop(next(k for k, r in enumerate(backward_list) if r is rows)))
                if rows.shape[0] != args[0].shape[0] * args[0].shape[1]:
                    raise ReplayError(f"router {site.name!r}: the recompute's shape differs from its forward's")
                rr.set_router_replay_action(backward)
                return
            rows, site.mask = self._call_rows(site, args[0])
            site.track = self.track_live  # (a recompute in the backward is not counted)
            rr.set_router_replay_action(forward)
            rr.set_target_indices(rows)  # also queues the rows for REPLAY_BACKWARD
            # Activation recompute runs the first forward of a checkpointed block without grad inside a forward
            # that has it: exactly the calls the backward will re-run.
            if self._grad_forward[site.chunk] and not torch.is_grad_enabled():
                site.pending.add(Pending((rows, site.mask), fingerprint(args[0]), checkpoint_chain()))
            else:  # this call is never recomputed: keep Megatron's backward queue in step with ours
                rr.replay_backward_list.pop()

        return hook

    def _after_router(self, site: Site, hidden: torch.Tensor) -> None:
        self._consumed = True

    def _compare(self, site: Site, live: torch.Tensor, used: torch.Tensor) -> None:
        """Count the replayed expert slots of this call ([N, K]) that its live pick `live` [N, K] would change."""
        kept = (live[:, :, None] == used[:, None, :]).any(-1).sum(-1)  # [N]: live picks among the replayed ones
        moved = used.shape[-1] - kept
        if site.mask is not None:  # (positions routed live are not compared)
            mask = site.mask.to(moved.device)
            moved, compared = moved[mask], mask.sum().to(self._compared.device)
        else:
            compared = moved.numel()
        self._moved[site.column] += moved.sum().to(self._moved.device)
        self._compared[site.column] += compared

    def live_moved(self) -> tuple[torch.Tensor, torch.Tensor]:
        """With `track_live=True`: per layer column of the routes, the replayed expert slots whose live pick differed
        and the replayed tokens compared, both int64 [L], summed over this rank's router calls so far (recomputes in
        the backward are not counted; under tensor or pipeline parallelism each rank counts its own calls, and a stage
        only its own layers). The share that moved is `moved.sum() / (compared.sum() * K)`.

        Example:
            >>> with replay_routes(gpt_model, routes, track_live=True) as ctx:  # doctest: +SKIP
            ...     gpt_model(tokens, position_ids, attention_mask)
            >>> moved, compared = ctx.live_moved()  # doctest: +SKIP
        """
        if not self.track_live:
            raise ValueError("live_moved() needs replay_routes(model, routes, track_live=True)")
        return self._moved.clone(), self._compared.clone()

    def _finish(self) -> None:
        # (a call whose checkpoints were all freed unrecomputed, its forward's output dropped, is never recomputed)
        waiting = sum(s.pending.waiting() for s in self.sites)
        if waiting:
            raise ReplayError(
                f"{waiting} replayed router calls still wait for their recompute: with activation recompute the "
                "backward re-runs the routers, so call loss.backward() inside `with replay_routes(...)`"
            )
        if not self._consumed:
            raise ReplayError("the routes were never replayed: no router ran inside `with replay_routes(...)`")
        if self.per_forward:  # the n-th forward took the n-th Routes: as many forwards as Routes, in every chunk
            ran = {self._forwards[s.chunk] for s in self.sites}
            if ran != {len(self._rows)}:
                raise ReplayError(
                    f"routes were given for {len(self._rows)} forwards but {min(ran)} ran: the n-th forward took the "
                    "n-th Routes, so with fewer forwards they took other micro-batches' routes; pass one Routes per "
                    "forward"
                )


def replay_routes(
    model: nn.Module | Sequence[nn.Module], routes: Routes | Sequence[Routes], *, track_live: bool = False
) -> MegatronRouteReplayer:
    """Force every router of a megatron-core model to select the experts in `routes` (unrecorded positions route
    live), in the forward and in the recompute of the backward; the router still gets gradients.

    One `Routes` is used by every forward in the context; a list gives the n-th forward the n-th `Routes`
    (micro-batches run forward in order, and backward in the same order, as Megatron's schedules do, 1F1B
    included). Under pipeline parallelism pass a stage's model (or its list of virtual-pipeline chunks, whose n-th
    forwards all take the n-th `Routes`) and either the whole model's routes or the stage's own part.

    Layers match by module path (or a dotted suffix of it); routes from another engine whose names match none of
    the model's map by layer order when the number of layers, experts and top-k agree. A batch or sequence length
    other than the routes' raises `ReplayError`. `track_live=True` also counts, beside each replayed call and without
    gradient or host sync, the replayed experts its live pick would change (`MegatronRouteReplayer.live_moved`).

    Example:
        >>> with replay_routes(gpt_model, routes):  # doctest: +SKIP
        ...     loss = gpt_model(tokens, position_ids, attention_mask, labels=labels).mean()
        ...     loss.backward()  # inside the context: activation recompute replays the same routes
        >>> with replay_routes(gpt_model, [routes_mb0, routes_mb1]):  # one Routes per micro-batch forward
        ...     losses = [gpt_model(*mb).mean() for mb in micro_batches]
        ...     for loss in losses:
        ...         loss.backward()
    """
    return MegatronRouteReplayer(model, routes, track_live=track_live)
