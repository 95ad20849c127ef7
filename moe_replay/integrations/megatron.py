"""`record_routes` / `replay_routes` on megatron-core MoE models, through megatron-core's own `RouterReplay`.

megatron-core (>= 0.16) keeps one `RouterReplay` per `TopKRouter` (built with `moe_enable_routing_replay=True`)
and records or replays the top-k indices as one int64 [s·b, K] tensor per layer, rows sequence-major
(`row = s_idx * b + b_idx`, the layout of the router's [s, b, h] input). Its own face is a process-global list of
instances driven by global actions; these contexts drive only the given model's instances, one router call at a
time, and give back a `Routes` [B, T, L, K] like the Hugging Face contexts do:

- record: every router runs its own top-k under RECORD; after each forward the rows become one `Routes` batch.
  With sequence parallelism each tensor-parallel rank routes a slice of the sequence; the slices are gathered so
  every rank holds the whole batch.
- replay: before each router call the rows for that call are handed to `RouterReplay` (REPLAY_FORWARD); its scores
  are gathered at the replayed experts, so the router keeps its gradient. Activation recompute runs the first
  forward of a checkpointed block without grad inside a forward with grad; those calls queue their rows, and when the
  backward re-runs them they switch to REPLAY_BACKWARD and take the rows of the forward they recompute, in order.
  Positions the routes mark as not recorded (padding) route live, as on Hugging Face models.
- on exit every instance gets back the action, indices and backward queue it had; the global instance list is
  never touched, so two models in one process do not see each other's routes.

What replay does not cover (megatron-core's design): the auxiliary load-balancing losses recompute their own
top-k from the live scores, so they see live routing, not the replayed one; capacity dropping
(`moe_expert_capacity_factor`) runs after replay and may drop replayed tokens; the expert-bias load counter counts
the replayed routing. Refused with a ValueError: `moe_router_fusion`, sinkhorn routing,
`moe_router_force_load_balancing`, CUDA graphs (a captured graph skips the hooks), context parallelism and
pipeline parallelism (not supported yet). A router call that bypasses `RouterReplay` anyway raises `ReplayError`.

Example:
    >>> from moe_replay.integrations.megatron import record_routes, replay_routes  # doctest: +SKIP
    >>> with record_routes(gpt_model) as rec:
    ...     gpt_model(tokens, position_ids, attention_mask)
    >>> with replay_routes(gpt_model, rec.routes):
    ...     gpt_model(tokens, position_ids, attention_mask, labels=labels).mean().backward()
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ..hooks.hub import ReplayError
from ..hooks.replay import _match_layers
from ..routes import LayerInfo, Routes, index_dtype
from .megatron_rows import routes_to_rows, rows_to_routes

__all__ = [
    "MegatronRouteRecorder",
    "MegatronRouteReplayer",
    "find_routers",
    "is_megatron_model",
    "record_routes",
    "replay_routes",
    "routes_to_rows",
    "rows_to_routes",
]

INSTALL_HINT = "pip install 'moe-replay[megatron]' (megatron-core >= 0.16)"
_ACTIVE = "_moe_replay_megatron_context"


def _megatron() -> tuple[type, Any]:
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
    return any(type(m).__module__.startswith("megatron.") for m in model.modules())


def _in_backward() -> bool:
    """True inside the autograd engine, where activation recompute re-runs the forward of checkpointed layers."""
    return torch._C._current_graph_task_id() != -1


@dataclass
class _Site:
    """One router of the model and the replay bookkeeping of the open context."""

    name: str
    router: nn.Module
    info: LayerInfo
    saved: tuple = ()
    pending: list[tuple[torch.Tensor, torch.Tensor | None]] = field(default_factory=list)  # awaiting recompute
    mask: torch.Tensor | None = None  # [S_local * B] bool for the current call (False: route live; None: all)
    used: bool = False


def find_routers(model: nn.Module) -> list[_Site]:
    """The model's `TopKRouter`s in module order, after checking that replay can act on every one of them.

    Raises ValueError for a model without routers, routers built without `moe_enable_routing_replay`, and the
    configurations in which megatron-core would skip replay silently (fused routing, sinkhorn, CUDA graphs) or
    split the sequence in another layout (context parallelism).

    Example:
        >>> [site.name for site in find_routers(gpt_model)]  # doctest: +SKIP
        ['decoder.layers.0.mlp.router', 'decoder.layers.1.mlp.router']
    """
    top_k_router, _ = _megatron()
    sites = []
    for name, module in model.named_modules():
        if not isinstance(module, top_k_router):
            continue
        config = module.config
        if getattr(module, "router_replay", None) is None:
            raise ValueError(
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
            "context parallelism (its sequence layout is not supported)": getattr(config, "context_parallel_size", 1)
            > 1,
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
                raise ValueError(f"router {name!r}: routes cannot be recorded or replayed with {what}")
        info = LayerInfo(name, int(config.num_moe_experts), int(module.topk))
        sites.append(_Site(name, module, info))
    if not sites:
        raise ValueError(f"{type(model).__name__} has no megatron-core MoE router (TopKRouter): nothing to record")
    return sites


class _Context:
    """Shared enter/exit: find the routers, hook them, and give every RouterReplay back its state on exit."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.sites: list[_Site] = []
        self._handles: list[Any] = []
        self._grad_forward = False
        self._in_forward = False
        self._forwards = 0
        self._active = False

    def __enter__(self) -> _Context:
        if self._active:
            raise RuntimeError("this context is already active")
        _, self._action = _megatron()
        sites = find_routers(self.model)
        busy = [s.name for s in sites if _ACTIVE in s.router.router_replay.__dict__]
        if busy:
            raise RuntimeError(
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

    def _check_call(self, site: _Site) -> None:
        """A router call outside the backward must come from a forward of the module the context was opened on."""
        if not self._in_forward:
            raise ReplayError(
                f"router {site.name!r} ran outside a forward of the {type(self.model).__name__} the context was "
                "opened on (e.g. on an inner module of a wrapper): open the context on the module you call"
            )

    def _topk_wrapper(self, site: _Site, original: Any) -> Any:
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

    def _router_post_hook(self, site: _Site) -> Any:
        def hook(module: nn.Module, args: Any, output: Any) -> None:
            if not site.used:
                raise ReplayError(
                    f"router {site.name!r} ran without calling RouterReplay (a routing path that bypasses it): "
                    "its routes were not recorded or replayed"
                )
            self._after_router(site, args[0])

        return hook

    # subclasses
    def _prepare(self, sites: list[_Site]) -> None: ...
    def _router_pre_hook(self, site: _Site) -> Any: ...
    def _after_router(self, site: _Site, hidden: torch.Tensor) -> None: ...
    def _forward_starts(self) -> None: ...
    def _forward_ends(self) -> None: ...
    def _finish(self) -> None: ...


def _tp(site: _Site) -> tuple[Any, int, int]:
    """(tensor-parallel group, its size, this rank) when sequence parallelism splits the router's input, else
    (None, 1, 0)."""
    group = getattr(site.router, "tp_group", None)
    if group is None or not getattr(site.router.config, "sequence_parallel", False) or group.size() == 1:
        return None, 1, 0
    return group, group.size(), group.rank()


class MegatronRouteRecorder(_Context):
    """Context manager returned by `record_routes`; `.routes` holds what was recorded."""

    def _prepare(self, sites: list[_Site]) -> None:
        self._batches: list[Routes] = []
        self._current: dict[str, torch.Tensor] = {}

    def _router_pre_hook(self, site: _Site) -> Any:
        record = self._action.RECORD

        def hook(module: nn.Module, args: Any) -> None:
            if not _in_backward():
                self._check_call(site)
            site.used = False
            site.mask = None
            rr = module.router_replay
            rr.recorded_topk_idx = None
            rr.set_router_replay_action(record)

        return hook

    def _after_router(self, site: _Site, hidden: torch.Tensor) -> None:
        if _in_backward():  # an activation recompute re-running this router: already recorded
            return
        rr = site.router.router_replay
        S, B = hidden.shape[:2]
        rows = rr.recorded_topk_idx.detach().clone().reshape(S, B, -1)  # newer versions reuse a static buffer
        group, size, _ = _tp(site)
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


class MegatronRouteReplayer(_Context):
    """Context manager returned by `replay_routes`."""

    def __init__(self, model: nn.Module, routes: Routes | Sequence[Routes]) -> None:
        self.per_forward = not isinstance(routes, Routes)
        routes_list = list(routes) if self.per_forward else [routes]
        bad = [type(r).__name__ for r in routes_list if not isinstance(r, Routes)]
        if bad or not routes_list:
            raise ValueError(
                f"replay_routes needs a Routes or a non-empty list of Routes, got {bad or 'an empty list'}"
            )
        super().__init__(model)
        self.routes = routes

    def _prepare(self, sites: list[_Site]) -> None:
        self._rows: list[dict[str, torch.Tensor]] = []  # per Routes: router name -> [T, B, K] int64
        self._masks: list[torch.Tensor] = []  # per Routes: [T, B] bool, sequence-major like Megatron's rows
        self._complete: list[bool] = []  # per Routes: every position recorded
        for r in self.routes if self.per_forward else [self.routes]:
            columns = self._columns(r, sites)
            T, B = r.seq_len, r.batch_size
            rows = routes_to_rows(r)  # unrecorded positions get valid ids (they route live anyway)
            self._rows.append({s.name: rows[columns[s.name]].reshape(T, B, -1) for s in sites})
            self._masks.append(r.mask.transpose(0, 1))
            self._complete.append(bool(r.mask.all()))  # once here, not a device sync per router call
        self._consumed = False

    def _columns(self, r: Routes, sites: list[_Site]) -> dict[str, int]:
        names = [s.name for s in sites]
        try:
            columns = _match_layers(names, r.layer_names, self.model)
        except ReplayError:
            if set(r.layer_names) & set(names) or len(r.layers) != len(sites):
                raise
            columns = {name: i for i, name in enumerate(names)}  # another engine's names: match by layer order
        for site in sites:
            held = r.layers[columns[site.name]]
            if (held.num_experts, held.top_k) != (site.info.num_experts, site.info.top_k):
                raise ReplayError(
                    f"routes layer {held.name!r} has E={held.num_experts}, K={held.top_k} but router "
                    f"{site.name!r} has E={site.info.num_experts}, K={site.info.top_k}"
                )
        return columns

    def _call_rows(self, site: _Site, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This call's rows [S_local * B, K] and mask [S_local * B] (None: all recorded), checked against the
        call's shape."""
        self._check_call(site)
        n = self._forwards - 1 if self.per_forward else 0
        if n >= len(self._rows):
            raise ReplayError(f"routes were given for {len(self._rows)} forwards but forward {n + 1} ran")
        S, B = hidden.shape[:2]
        _, size, rank = _tp(site)
        T, held_b = self._masks[n].shape
        if held_b != B or S * size != T:
            split = f" ({size} sequence-parallel slices of {S})" if size > 1 else ""
            which = f" (forward {n + 1})" if self.per_forward else ""
            raise ReplayError(
                f"routes{which} hold B={held_b} sequences of T={T} positions but router {site.name!r} got a batch "
                f"of {B} sequences of {S * size} positions{split}"
            )
        span = slice(rank * S, (rank + 1) * S)
        rows = self._rows[n][site.name][span].reshape(S * B, -1)
        return rows, None if self._complete[n] else self._masks[n][span].reshape(S * B)

    def _router_pre_hook(self, site: _Site) -> Any:
        forward, backward = self._action.REPLAY_FORWARD, self._action.REPLAY_BACKWARD

        def hook(module: nn.Module, args: Any) -> None:
            rr = module.router_replay
            site.used = False
            if _in_backward():  # activation recompute: the rows of the forward being recomputed, in order
                if not site.pending:
                    raise ReplayError(
                        f"router {site.name!r} is recomputed in the backward but no replayed forward awaits it: "
                        "run the forward inside the same `with replay_routes(...)`"
                    )
                if len(rr.replay_backward_list) != len(site.pending):
                    raise ReplayError(
                        f"router {site.name!r}: megatron's REPLAY_BACKWARD queue was changed from outside the context"
                    )
                rows, site.mask = site.pending.pop(0)
                if rows.shape[0] != args[0].shape[0] * args[0].shape[1]:
                    raise ReplayError(f"router {site.name!r}: the recompute's shape differs from its forward's")
                rr.set_router_replay_action(backward)
                return
            rows, site.mask = self._call_rows(site, args[0])
            rr.set_router_replay_action(forward)
            rr.set_target_indices(rows)  # also queues the rows for REPLAY_BACKWARD
            # Activation recompute runs the first forward of a checkpointed block without grad inside a forward
            # that has it: exactly the calls the backward will re-run.
            if self._grad_forward and not torch.is_grad_enabled():
                site.pending.append((rows, site.mask))
            else:  # this call is never recomputed: keep Megatron's backward queue in step with ours
                rr.replay_backward_list.pop()

        return hook

    def _after_router(self, site: _Site, hidden: torch.Tensor) -> None:
        self._consumed = True

    def _finish(self) -> None:
        waiting = sum(len(s.pending) for s in self.sites)
        if waiting:
            raise ReplayError(
                f"{waiting} replayed router calls still wait for their recompute: with activation recompute the "
                "backward re-runs the routers, so call loss.backward() inside `with replay_routes(...)`"
            )
        if not self._consumed:
            raise ReplayError("the routes were never replayed: no router ran inside `with replay_routes(...)`")


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


def replay_routes(model: nn.Module, routes: Routes | Sequence[Routes]) -> MegatronRouteReplayer:
    """Force every router of a megatron-core model to select the experts in `routes` (unrecorded positions route
    live), in the forward and in the recompute of the backward; the router still gets gradients.

    One `Routes` is used by every forward in the context; a list gives the n-th forward the n-th `Routes`
    (micro-batches run forward one after another, then backward in the same order, as Megatron's schedules do).

    Layers match by module path (or a dotted suffix of it); routes from another engine whose names match none of
    the model's map by layer order when the number of layers, experts and top-k agree. A batch or sequence length
    other than the routes' raises `ReplayError`.

    Example:
        >>> with replay_routes(gpt_model, routes):  # doctest: +SKIP
        ...     loss = gpt_model(tokens, position_ids, attention_mask, labels=labels).mean()
        ...     loss.backward()  # inside the context: activation recompute replays the same routes
        >>> with replay_routes(gpt_model, [routes_mb0, routes_mb1]):  # one Routes per micro-batch forward
        ...     losses = [gpt_model(*mb).mean() for mb in micro_batches]
        ...     for loss in losses:
        ...         loss.backward()
    """
    return MegatronRouteReplayer(model, routes)
