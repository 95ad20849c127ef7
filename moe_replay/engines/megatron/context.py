"""The shared part of the megatron-core contexts: find the routers, hook them, give every RouterReplay back its state.

megatron-core (>= 0.16) keeps one `RouterReplay` per `TopKRouter` (built with `moe_enable_routing_replay=True`) and
records or replays the top-k indices as one int64 [s·b, K] tensor per layer (rows.py). Its own face is a
process-global list of instances driven by global actions; these contexts drive only the given model's instances, one
router call at a time. docs/megatron.md says what is refused and what replay does not cover.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ...errors import NestedContextError, ReplayError, UnsupportedModelError
from ...routes import LayerInfo

INSTALL_HINT = "pip install 'moe-replay[megatron]' (megatron-core >= 0.16)"
_ACTIVE = "_moe_replay_megatron_context"


def megatron_api() -> tuple[type, Any]:
    """(TopKRouter, RouterReplayAction), or an ImportError that says how to install megatron-core."""
    try:
        from megatron.core.transformer.moe.router import TopKRouter
        from megatron.core.transformer.moe.router_replay import RouterReplayAction
    except ImportError as e:
        raise ImportError(
            f"moe_replay.integrations.megatron needs megatron-core with RouterReplay: {INSTALL_HINT}"
        ) from e
    return TopKRouter, RouterReplayAction


def is_megatron_model(model: nn.Module) -> bool:
    """Whether `model` is (or wraps) a megatron-core module; never imports megatron.

    Example:
        >>> is_megatron_model(torch.nn.Linear(2, 2))
        False
    """
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


@dataclass
class Site:
    """One router of the model and the replay bookkeeping of the open context."""

    name: str
    router: nn.Module
    info: LayerInfo
    saved: tuple = ()
    pending: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)  # awaiting recompute
    mask: torch.Tensor | None = None  # [S_local * B] bool for the current call (False: route live; None: all)
    used: bool = False


def find_routers(model: nn.Module) -> list[Site]:
    """The model's `TopKRouter`s in module order, after checking that replay can act on every one of them.

    Raises ValueError for a model without routers, routers built without `moe_enable_routing_replay`, and the
    configurations in which megatron-core would skip replay silently (fused routing, sinkhorn, CUDA graphs) or
    split the sequence in another layout (context parallelism).

    Example:
        >>> [site.name for site in find_routers(gpt_model)]  # doctest: +SKIP
        ['decoder.layers.0.mlp.router', 'decoder.layers.1.mlp.router']
    """
    top_k_router, _ = megatron_api()
    sites = []
    for name, module in model.named_modules():
        if not isinstance(module, top_k_router):
            continue
        config = module.config
        if getattr(module, "router_replay", None) is None:
            raise UnsupportedModelError(
                f"router {name!r} has no RouterReplay: build the model with "
                "TransformerConfig(..., moe_enable_routing_replay=True) to record or replay its routes"
            )
        refused = {
            "moe_router_fusion=True (the fused top-k bypasses RouterReplay)": getattr(
                config, "moe_router_fusion", False
            ),
            "moe_router_load_balancing_type='sinkhorn' (sinkhorn routing bypasses RouterReplay)": getattr(
                module, "routing_type", None
            )
            == "sinkhorn",
            "CUDA graphs (a captured router skips the replay hooks)": getattr(config, "cuda_graph_impl", "none")
            not in ("none", None)
            or getattr(config, "enable_cuda_graph", False),
            "context parallelism (untested end to end: megatron-core's local attention asserts CP == 1 and Transformer "
            "Engine needs CUDA; the layout mapping is ready in moe_replay.engines.megatron.routes_to_cp / "
            "routes_from_cp)": getattr(config, "context_parallel_size", 1) > 1,
            "pipeline parallelism (not supported yet: a stage holds only some layers, named locally)": getattr(
                config, "pipeline_model_parallel_size", 1
            )
            > 1,
            "moe_router_force_load_balancing=True (random logits for benchmarks)": getattr(
                config, "moe_router_force_load_balancing", False
            ),
        }
        for what, on in refused.items():
            if on:
                raise UnsupportedModelError(f"router {name!r}: routes cannot be recorded or replayed with {what}")
        info = LayerInfo(name, int(config.num_moe_experts), int(module.topk))
        sites.append(Site(name, module, info))
    if not sites:
        raise UnsupportedModelError(
            f"{type(model).__name__} has no megatron-core MoE router (TopKRouter): nothing to record"
        )
    return sites


class RouterReplayContext:
    """Shared enter/exit: find the routers, hook them, and give every RouterReplay back its state on exit."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.sites: list[Site] = []
        self._handles: list[Any] = []
        self._grad_forward = False
        self._in_forward = False
        self._forwards = 0
        self._active = False

    def __enter__(self) -> RouterReplayContext:
        if self._active:
            raise RuntimeError("this context is already active")
        _, self._action = megatron_api()
        sites = find_routers(self.model)
        busy = [s.name for s in sites if _ACTIVE in s.router.router_replay.__dict__]
        if busy:
            raise NestedContextError(
                f"routers {busy} are already in an open moe-replay context; megatron-core's RouterReplay holds one "
                "action per router, so contexts on one Megatron model (or a wrapper and the model) cannot nest"
            )
        self._prepare(sites)
        self._forwards, self._in_forward = 0, False
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
            self._handles.append(self.model.register_forward_pre_hook(self._model_pre_hook))
            self._handles.append(self.model.register_forward_hook(self._model_post_hook))
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

    def _model_pre_hook(self, module: nn.Module, args: Any) -> None:
        self._forwards += 1
        self._grad_forward = torch.is_grad_enabled()
        self._in_forward = True
        self._forward_starts()

    def _model_post_hook(self, module: nn.Module, args: Any, output: Any) -> None:
        self._in_forward = False
        self._forward_ends()

    def _check_call(self, site: Site) -> None:
        """A router call outside the backward must come from a forward of the module the context was opened on."""
        if not self._in_forward:
            raise ReplayError(
                f"router {site.name!r} ran outside a forward of the {type(self.model).__name__} the context was "
                "opened on (e.g. on an inner module of a wrapper): open the context on the module you call"
            )

    def _topk_wrapper(self, site: Site, original: Any) -> Any:
        def get_replay_topk(scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):  # noqa: ANN001, ANN202
            site.used = True
            probs, idx = original(scores, topk, num_groups, group_topk, default_compute_topk)
            mask = site.mask
            if mask is not None:  # unrecorded positions route live
                live_probs, live_idx = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)
                keep = mask.to(idx.device)[:, None]
                probs, idx = torch.where(keep, probs, live_probs), torch.where(keep, idx, live_idx)
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
    def _forward_starts(self) -> None: ...
    def _forward_ends(self) -> None: ...
    def _finish(self) -> None: ...


def tp_split(site: Site) -> tuple[Any, int, int]:
    """(tensor-parallel group, its size, this rank) when sequence parallelism splits the router's input, else
    (None, 1, 0)."""
    group = getattr(site.router, "tp_group", None)
    if group is None or not getattr(site.router.config, "sequence_parallel", False) or group.size() == 1:
        return None, 1, 0
    return group, group.size(), group.rank()
