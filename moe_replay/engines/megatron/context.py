"""The shared part of the megatron-core contexts: find the routers, hook them, give every RouterReplay back its state.

megatron-core (>= 0.16) keeps one `RouterReplay` per `TopKRouter` (built with `moe_enable_routing_replay=True`) and
records or replays the top-k indices as one int64 [s·b, K] tensor per layer (rows.py). Its own face is a
process-global list of instances driven by global actions; these contexts drive only the given model's instances, one
router call at a time. docs/megatron.md says what is refused and what replay does not cover.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from ...errors import NestedContextError, ReplayError
from .routers import Site, find_routers, megatron_api

_ACTIVE = "_moe_replay_megatron_context"


def is_megatron_model(model: nn.Module | Sequence[nn.Module]) -> bool:
    """Whether `model` is (or wraps) a megatron-core module, or is a non-empty list of them (a pipeline rank's
    virtual-pipeline chunks); never imports megatron.

    Example:
        >>> is_megatron_model(torch.nn.Linear(2, 2))
        False
    """
    if isinstance(model, (list, tuple)):
        return bool(model) and all(isinstance(m, nn.Module) and is_megatron_model(m) for m in model)
    if not isinstance(model, nn.Module):
        return False
    if type(model).__module__.startswith("megatron."):
        return True
    if _is_transformers_model(model):  # a transformers model holds no megatron module: skip the walk
        return False
    return any(type(m).__module__.startswith("megatron.") for m in model.modules())


def _is_transformers_model(model: nn.Module) -> bool:
    """Whether `model` is a transformers `PreTrainedModel`, without importing transformers if it is not loaded."""
    import sys

    modeling = sys.modules.get("transformers.modeling_utils")
    return modeling is not None and isinstance(model, modeling.PreTrainedModel)


class RouterReplayContext:
    """Shared enter/exit: find the routers, hook them, and give every RouterReplay back its state on exit.

    `model` is one module, or a pipeline rank's virtual-pipeline chunks (a list, as megatron's schedules take them):
    forwards are counted per chunk, and the n-th forward of every chunk belongs to the n-th micro-batch."""

    def __init__(self, model: nn.Module | Sequence[nn.Module]) -> None:
        chunks = list(model) if isinstance(model, (list, tuple)) else [model]
        bad = [type(m).__name__ for m in chunks if not isinstance(m, nn.Module)]
        if bad or not chunks:
            raise ValueError(
                f"expected a megatron-core module or a non-empty list of them, got {bad or 'an empty list'}"
            )
        self.model = model
        self.chunks = chunks
        self.sites: list[Site] = []
        self._handles: list[Any] = []
        n = len(chunks)
        self._grad_forward, self._in_forward, self._forwards = [False] * n, [False] * n, [0] * n
        self._packed: list[PackedBounds | None] = [None] * n  # per chunk: the forward's packed boundaries, if any
        self._cp = (1, 0)  # (CP size, this rank's CP rank)
        self._active = False

    def __enter__(self) -> RouterReplayContext:
        if self._active:
            raise RuntimeError("this context is already active")
        _, self._action = megatron_api()
        sites = find_routers(self.chunks)
        busy = [s.name for s in sites if _ACTIVE in s.router.router_replay.__dict__]
        if busy:
            raise NestedContextError(
                f"routers {busy} are already in an open moe-replay context; megatron-core's RouterReplay holds one "
                "action per router, so contexts on one Megatron model (or a wrapper and the model) cannot nest"
            )
        self._cp = cp_place(sites[0].router)
        self._prepare(sites)
        n = len(self.chunks)
        self._grad_forward, self._in_forward, self._forwards = [False] * n, [False] * n, [0] * n
        self._packed = [None] * n
        self.sites = sites
        try:
            for site in sites:
                rr = site.router.router_replay
                site.saved = (
                    rr.router_replay_action,
                    rr.target_topk_idx,
                    rr.recorded_topk_idx,
                    rr.replay_backward_list,
                )
                rr.replay_backward_list = []  # ours alone while the context is open (restored on exit)
                rr.__dict__[_ACTIVE] = self
                rr.get_replay_topk = self._topk_wrapper(site, type(rr).get_replay_topk.__get__(rr))
                self._handles.append(site.router.register_forward_pre_hook(self._router_pre_hook(site)))
                self._handles.append(site.router.register_forward_hook(self._router_post_hook(site)))
            for chunk, module in enumerate(self.chunks):
                self._handles.append(module.register_forward_pre_hook(self._model_pre_hook(chunk), with_kwargs=True))
                self._handles.append(module.register_forward_hook(self._model_post_hook(chunk)))
        except BaseException:
            self._close()
            raise
        self._active = True
        return self

    def __exit__(self, exc_type: type | None, *exc: object) -> None:
        if not self._active:
            return
        self._active = False
        self._close()
        if exc_type is None:
            self._finish()

    def _close(self) -> None:
        for handle in reversed(self._handles):
            handle.remove()
        self._handles = []
        for site in self.sites:
            rr = site.router.router_replay
            if rr.__dict__.get(_ACTIVE) is not self:
                continue
            del rr.__dict__[_ACTIVE]
            rr.__dict__.pop("get_replay_topk", None)
            action, target, recorded, queue = site.saved
            rr.router_replay_action, rr.target_topk_idx, rr.recorded_topk_idx = action, target, recorded
            rr.replay_backward_list = queue

    def _owner(self) -> str:
        """The model's class name for messages (chunks joined by +)."""
        return " + ".join(type(m).__name__ for m in self.chunks)

    def _model_pre_hook(self, chunk: int) -> Any:
        def hook(module: nn.Module, args: Any, kwargs: dict[str, Any]) -> None:
            packed = packed_bounds((*args, *kwargs.values()))
            if self._cp[0] > 1:  # which CP layout this forward's batch was split in (checked before anything counts)
                self._check_layout(chunk, None if packed is None else packed[1])
            self._packed[chunk] = packed
            self._forwards[chunk] += 1
            self._grad_forward[chunk] = torch.is_grad_enabled()
            self._in_forward[chunk] = True
            self._forward_starts(chunk)

        return hook

    def _model_post_hook(self, chunk: int) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            self._in_forward[chunk] = False
            self._forward_ends(chunk)

        return hook

    def _check_call(self, site: Site) -> None:
        """A router call outside the backward must come from a forward of the module the context was opened on."""
        if not self._in_forward[site.chunk]:
            owner = type(self.chunks[site.chunk]).__name__
            raise ReplayError(
                f"router {site.name!r} ran outside a forward of the {owner} the context was "
                "opened on (e.g. on an inner module of a wrapper): open the context on the module you call"
            )

    def _topk_wrapper(self, site: Site, original: Any) -> Any:
        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):  # noqa: ANN001, ANN202
            site.used = True
            probs, idx = original(scores, topk, num_groups, group_topk, default_compute_topk)
            mask, live_idx = site.mask, None
            if mask is not None:  # unrecorded positions route live
                live_probs, live_idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                keep = mask.to(idx.device)[:, None]
                probs, idx = torch.where(keep, probs, live_probs), torch.where(keep, idx, live_idx)
            if site.track:  # the live pick beside the replayed one (track_live): no gradient, no host sync
                if live_idx is None:
                    with torch.no_grad():
                        _, live_idx = default_compute_topk(
                            scores.detach(), topk, num_groups=num_groups, group_topk=group_topk
                        )
                self._compare(site, live_idx, idx)
            return probs, idx

        return get_replay_topk

    def _router_post_hook(self, site: Site) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not site.used:
                raise ReplayError(
                    f"router {site.name!r} ran without calling RouterReplay (a routing path that bypasses it): "
                    "its routes were not recorded or replayed"
                )
            self._after_router(site, args[0])

        return hook

    # subclasses
    def _prepare(self, sites: list[Site]) -> None: ...
    def _router_pre_hook(self, site: Site) -> Any: ...
    def _after_router(self, site: Site, hidden: torch.Tensor) -> None: ...
    def _compare(self, site: Site, live: torch.Tensor, used: torch.Tensor) -> None: ...
    def _check_layout(self, chunk: int, layout: tuple[int, ...] | None) -> None: ...
    def _forward_starts(self, chunk: int) -> None: ...
    def _forward_ends(self, chunk: int) -> None: ...
    def _finish(self) -> None: ...


PackedBounds = tuple[tuple[int, ...], tuple[int, ...]]  # (cu_seqlens, cu_seqlens_padded) of a packed (THD) row


def packed_bounds(inputs: Sequence[Any]) -> PackedBounds | None:
    """The sequence boundaries (`cu_seqlens`, and `cu_seqlens_padded` where each starts: megatron-core splits the row
    per document by these under CP) of the packed (THD) batch among a forward's inputs (its `PackedSeqParams`); None
    for a batch of whole sequences.

    Example:
        >>> packed_bounds([tokens, position_ids, None]) is None  # doctest: +SKIP
        True
    """
    from megatron.core.packed_seq_params import PackedSeqParams

    params = next((x for x in inputs if isinstance(x, PackedSeqParams)), None)
    if params is None or params.qkv_format != "thd":
        return None
    cu = tuple(int(x) for x in params.cu_seqlens_q.reshape(-1).tolist())
    padded = params.cu_seqlens_q_padded
    return cu, cu if padded is None else tuple(int(x) for x in padded.reshape(-1).tolist())


def tp_split(site: Site) -> tuple[Any, int, int]:
    """(tensor-parallel group, its size, this rank) when sequence parallelism splits the router's input, else
    (None, 1, 0)."""
    group = getattr(site.router, "tp_group", None)
    if group is None or not getattr(site.router.config, "sequence_parallel", False) or group.size() == 1:
        return None, 1, 0
    return group, group.size(), group.rank()


def cp_place(router: Any) -> tuple[int, int]:
    """(CP size, this rank's CP rank) of a megatron-core router (its `cp_group`), (1, 0) without CP.

    Example:
        >>> cp_place(gpt_model.decoder.layers[0].mlp.router)  # doctest: +SKIP
        (2, 1)
    """
    size = getattr(router.config, "context_parallel_size", 1) or 1
    group = getattr(router, "cp_group", None)
    if size == 1 or group is None:
        return 1, 0
    return group.size(), group.rank()
