"""`replay_routes`: force a model to use recorded experts, with the router's weights and gradients computed live."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn

from ...errors import ReplayError
from ...layers import match_layers
from ...routes import Routes
from ..autograd import version
from .hub import RouterHub
from .plan import Plan
from .steps import Step

SMALL_FORWARD = 1 << 20  # up to this many (token, layer, expert) entries, a forward's indices are converted at once


def on_host(tensor: torch.Tensor) -> bool:
    """Whether `tensor` is in host memory (read there without a copy).

    Example:
        >>> on_host(torch.zeros(2))
        True
    """
    return tensor.is_cpu  # (a bool read off the tensor: `tensor.device` makes a device object)


class Span(NamedTuple):
    """What the forwards of one span of positions replay: its mask [B, t], whether all of it is recorded, and for a
    small forward each layer's `Plan`, whose indices int64 [N, K] are views of one converted tensor `base` taken at
    version `version`."""

    mask: torch.Tensor
    all_recorded: bool
    plans: tuple[Plan, ...] | None
    base: torch.Tensor | None
    version: int | None

    def intact(self) -> bool:
        """Whether no model has edited in place the indices it was given (else the next forward converts afresh); never
        for indices made in inference mode, whose edits are not counted."""
        return self.base is None or (self.version is not None and version(self.base) == self.version)


class RouteReplayer:
    """Context manager returned by `replay_routes`."""

    def __init__(self, model: nn.Module, routes: Routes, *, track_live: bool = False) -> None:
        if not isinstance(routes, Routes):
            raise ValueError(f"replay_routes needs a Routes, got {type(routes).__name__}")
        self.model = model
        self.routes = routes
        self.track_live = track_live
        # called with (forward, args, kwargs) before each outermost forward of a tracked model runs (steps.py); may
        # raise ReplayError to refuse it (a packed row's replay: engines/packed.py)
        self.forward_check: Callable[[Any, tuple, dict], None] | None = None
        L = len(routes.layers)
        # per layer: expert slots where the live pick differs from the replayed one, and replayed tokens compared
        self._moved = torch.zeros(L, dtype=torch.int64, device=routes.device) if track_live else None
        self._compared = torch.zeros(L, dtype=torch.int64, device=routes.device) if track_live else None
        self._hub: RouterHub | None = None
        self._mask_copy: tuple[int | None, torch.Tensor] | None = None  # a device mask's host copy (`_host_mask`)
        self._last: tuple[tuple[int, ...], Span] | None = None  # the last span's key and conversion: forwards repeat
        self._tensors = (routes.indices, routes.mask)  # what the caches below were made from (`_step_span`)
        self._covered: dict[tuple[int, int], set[int]] = {}  # (start, end) of the forwards replayed -> their layers
        self._groups: dict[tuple[int, int], int] = {}  # (layer, G): most expert groups one recorded token uses
        self._columns: dict[str, int] = {}
        # the current forward's step, span and the set of `_covered` its replayed layers go in (`plan`)
        self._span: tuple[Step, Span | None, set[int]] | None = None
        # recorded positions that a forward's attention mask marks as padding, summed on the device (`_count_padding`)
        self._at_padding: torch.Tensor | None = None

    def __enter__(self) -> RouteReplayer:
        if self._hub is not None:
            raise RuntimeError("this replay context is already active")
        hub = RouterHub.attach(self.model, self, replay=True)
        try:
            self._columns = match_layers(
                [s.name for s in hub.layout.sites], self.routes.layers, type(self.model).__name__
            )
        except ReplayError:
            hub.detach(self)
            raise
        self._covered.clear()
        self._span = self._at_padding = None
        self._hub = hub
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        if self._hub is None:
            return
        waiting = self._hub.session.waiting(self)
        self._hub.detach(self)
        self._hub = self._last = self._span = None  # (the plans of a kept span point back at this replayer)
        if exc_type is not None:
            return
        if waiting:
            raise ReplayError(
                f"{waiting} replayed router calls still wait for their recompute: with activation checkpointing the "
                "backward re-runs the routers, so call loss.backward() inside `with replay_routes(...)`"
            )
        self._check_consumed()
        self._check_padding()

    def plan(self, name: str, step: Step) -> Plan | None:
        layer = self._columns.get(name)
        if layer is None:
            raise ReplayError(f"router call {name!r} has no routes: the routes hold layers {self.routes.layer_names}")
        span = self._span
        if span is None or span[0] is not step:  # the first router call of this forward: check and slice once
            found = self._step_span(step)
            if found is not None and step.has_mask:
                self._count_padding(found.mask, step)
            span = self._span = (step, found, self._covered.setdefault((step.start, step.start + step.length), set()))
        found = span[1]
        if found is None:
            return None
        span[2].add(layer)
        if found.plans is not None:
            return found.plans[layer]
        r, start = self.routes, step.start
        info = r.layers[layer]
        indices = r.indices[:, start : start + step.length, layer].long().reshape(step.tokens, info.top_k)
        return Plan(indices, found.mask, info.num_experts, info.top_k, found.all_recorded, self, layer, self.track_live)

    def _step_span(self, step: Step) -> Span | None:
        """The replay data of the step's positions (None when the step is not replayed), after checking that the
        routes cover the step. A forward of the same span as the last one (in one context) reuses its conversion."""
        r = self.routes
        B, T = r.indices.shape[:2]  # (r.batch_size, r.seq_len: properties, a Python call each)
        if step.batch != B:
            raise ReplayError(f"routes hold B={B} sequences but the forward has batch {step.batch}")
        end = step.start + step.length
        if step.synced and step.start >= T - 1:
            return None  # a dummy forward of a rank that finished early (generate(synced_gpus=True))
        if end > T:
            raise ReplayError(
                f"the forward covers positions {step.start}..{end - 1} but the routes hold T={T} positions"
            )
        if r.indices is not self._tensors[0] or r.mask is not self._tensors[1]:
            raise ReplayError(
                "the routes' indices or mask were replaced by another tensor while a replay of them was open: the "
                "replay holds what it made from the ones it was given; edit them in place, or open a new context"
            )
        key = (step.start, end, version(r.indices), version(r.mask))  # the routes as they are now (in-place edits)
        last = self._last
        if last is None or last[0] != key or None in key or not last[1].intact():  # (None: inference tensors)
            last = self._last = (key, self._convert(step.start, end))
        return last[1]

    def _convert(self, start: int, end: int) -> Span:
        """The replay data of positions [start, end) (see `Span`)."""
        r = self.routes
        full = start == 0 and end == r.indices.shape[1]  # a forward of the whole routes: no slices
        mask = r.mask if full else r.mask[:, start:end]
        host = self._host_mask()
        all_recorded = bool((host if full else host[:, start:end]).all())
        if not all_recorded:  # a copy: a recompute in the backward reads it after the routes may have been edited
            mask = mask.clone()
        L, K, N = len(r.layers), r.indices.shape[-1], mask.numel()
        if N * L * K > SMALL_FORWARD:  # converted per router call instead
            return Span(mask, all_recorded, None, None, 0)
        part = r.indices if full else r.indices[:, start:end]  # [B, t, L, K]
        # int64 [L, N, K], one conversion for all layers; each layer's [N, K] contiguous, as a live top-k's indices
        # are (a strided view costs the experts a copy per call). ([N, L, K] transposed: cheaper than a 4-D permute.)
        by_layer = part.reshape(N, L, K).transpose(0, 1)
        converted = by_layer.to(torch.long, memory_format=torch.contiguous_format, copy=True)
        per_layer = zip(converted.unbind(0), r.layers, strict=True)
        plans = tuple(  # (a list, not a generator: fewer calls)
            [
                Plan(indices, mask, info.num_experts, info.top_k, all_recorded, self, layer, self.track_live)
                for layer, (indices, info) in enumerate(per_layer)
            ]
        )
        return Span(mask, all_recorded, plans, converted, version(converted))

    def _host_mask(self) -> torch.Tensor:
        """The routes' mask [B, T] to read on the host (whether a span is all recorded): a CPU mask itself; a device
        mask's copy, made once per context (not per span: under `generate` every decode step is one) and again after
        an edit in place."""
        mask = self.routes.mask
        if on_host(mask):
            return mask
        v = version(mask)
        if self._mask_copy is None or v is None or v != self._mask_copy[0]:
            self._mask_copy = (v, mask.to("cpu", copy=True))
        return self._mask_copy[1]

    def groups_used(self, layer: int, G: int) -> int:
        """The most of G expert groups that any recorded token of `layer` uses (one host read per layer and G, over
        all the routes, rather than one per router call)."""
        found = self._groups.get((layer, G))
        if found is None:
            r = self.routes
            groups = r.indices[:, :, layer].long() // (r.layers[layer].num_experts // G)  # [B, T, K]
            used = torch.zeros(*groups.shape[:2], G, dtype=torch.bool, device=groups.device).scatter_(-1, groups, True)
            found = self._groups[layer, G] = int((used & r.mask[..., None]).sum(-1).max())
        return found

    def tally(self, layer: int, mask: torch.Tensor, live: torch.Tensor, used: torch.Tensor) -> None:
        """Count the replayed expert slots [N, K] the router would have picked otherwise (no host sync)."""
        kept = (live[:, :, None] == used[:, None, :]).any(-1).sum(-1)  # [N] live picks among the used ones
        mask = mask.to(kept.device).reshape(-1)
        self._moved[layer] += ((live.shape[-1] - kept) * mask).sum().to(self._moved.device)
        self._compared[layer] += mask.sum().to(self._compared.device)

    def live_moved(self) -> tuple[torch.Tensor, torch.Tensor]:
        """With `track_live=True`: per layer, the replayed expert slots whose live pick differed, and the replayed
        tokens compared, both int64 [L] (summed over the forwards so far; recomputes are not counted). The share
        of routed choices that moved is `moved.sum() / (compared.sum() * K)`, as `ExpertChange.fraction` counts.

        Group-limited routers (steered groups) and PhiMoE's sparsemixer are not compared (their counts stay 0).

        Example:
            >>> with replay_routes(model, routes, track_live=True) as ctx:  # doctest: +SKIP
            ...     model(ids, attention_mask=mask)
            >>> moved, compared = ctx.live_moved()  # doctest: +SKIP
        """
        if not self.track_live:
            raise ValueError("live_moved() needs replay_routes(model, routes, track_live=True)")
        return self._moved.clone(), self._compared.clone()

    def _count_padding(self, mask: torch.Tensor, step: Step) -> None:
        """Add the positions of this forward that the routes recorded (`mask` [B, t]) and its attention mask marks as
        padding: routes recorded on a batch padded another way (left against right) land there, and the batch's real
        tokens get other positions' experts. Summed on the device (no host sync per forward), checked at exit."""
        found = torch.gt(mask, step.real.to(mask.device)).sum()
        self._at_padding = found if self._at_padding is None else self._at_padding.add_(found)

    def _check_padding(self) -> None:
        n = 0 if self._at_padding is None else int(self._at_padding)
        self._at_padding = None
        if n:
            raise ReplayError(
                f"the routes are recorded at {n} positions that the forwards' attention masks mark as padding: routes "
                "recorded on a batch padded another way (left-padded against right-padded, or imported without "
                "`pad_left`) put the experts of other positions on its real tokens; replay them on the batch laid out "
                "as they were recorded (or drop those positions first: routes.mask & attention_mask)"
            )

    def _check_consumed(self) -> None:
        T, L = self.routes.seq_len, len(self.routes.layers)
        covered = self._covered
        whole = covered.get((0, T), ())
        if all(layer in whole for layer in range(L)):
            return  # the commonest case: each layer replayed over the whole routes, once (or the same span again)
        reach = [0] * L  # the common case, checked without tensors: spans from 0 that cover [0, T) for every layer
        for start, end, layer in sorted((*span, layer) for span, layers in covered.items() for layer in layers):
            if start <= reach[layer]:
                reach[layer] = max(reach[layer], end)
        if min(reach, default=T) >= T:
            return
        covered = torch.zeros(self.routes.seq_len, len(self.routes.layers), dtype=torch.bool)
        for (start, end), layers in self._covered.items():
            if layers:
                covered[start:end, sorted(layers)] = True
        needed = self._host_mask().any(0)  # [T]
        missing = needed[:, None] & ~covered  # [T, L]
        if missing.any():
            layers = [self.routes.layers[i].name for i in missing.any(0).nonzero().flatten().tolist()]
            positions = missing.any(1).nonzero().flatten().tolist()
            shown = positions if len(positions) <= 8 else [*positions[:8], "..."]
            raise ReplayError(
                f"replay left recorded routes unused: layers {layers} at positions {shown} were never run "
                f"(routes hold T={self.routes.seq_len}); forward the full sequences inside the context"
            )


def replay_routes(model: nn.Module, routes: Routes, *, track_live: bool = False) -> RouteReplayer:
    """Force every router of `model` to select the recorded experts at recorded positions (others route live).

    The selected experts come from `routes`; their weights are computed by the family's own rule from the live
    router scores, so the router still gets gradients. Replaying a model's own routes gives identical logits.
    Works with minibatch slices (`routes[idx]`), gradient checkpointing and a KV cache. Routes for another batch
    size, sequence length or layer set, and routes that were never used, raise `ReplayError` (a ValueError).
    `track_live=True` also counts, at no host sync, how many replayed experts the router would have picked
    otherwise (`RouteReplayer.live_moved`): how far live routing has moved from the routes.

    Example:
        >>> with replay_routes(model, routes):  # doctest: +SKIP
        ...     logits = model(sequences, attention_mask=mask).logits
        ...     loss.backward()
    """
    return RouteReplayer(model, routes, track_live=track_live)
