"""The one interception point: the top-k a router uses to select its experts.

While the MoE block that owns a router runs, a TorchFunctionMode sees every `topk`. The selecting top-k is the one
over the E router scores of each token (input [..., E] with N·E elements, N = tokens of the forward):

- record: its indices are what the experts will use;
- replay: it returns the recorded indices with values gathered from its own input (the live scores), so the family's
  own weight rule runs on the live router output and the router keeps its gradient; replaying a model's own routes
  is bit-exact. A group-limited top-k before it (DeepSeek-style `n_group` / `topk_group`) is steered to keep the
  groups of the recorded experts, or their scores would be masked to zero.

One hub per model holds the hooks for all active contexts, so that a recording nested in a replay sees the replayed
experts; it is stored on the model and removed with the last context.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from . import sparsemixer
from .discover import RouterSite, find_routers
from .steps import Step, StepTracker

_HUB_ATTR = "_moe_replay_hub"
_TOPK = {torch.topk, torch.Tensor.topk}


class ReplayError(ValueError):
    """Routes could not be applied to this model or this forward."""


@dataclass
class Plan:
    """The routes one router call must use: `indices` [N, K] int64, `mask` [N] bool (False routes live)."""

    indices: torch.Tensor
    mask: torch.Tensor
    num_experts: int
    top_k: int
    all_recorded: bool


class Recorder(Protocol):
    def record(self, layer: str, step: Step, indices: torch.Tensor, num_experts: int) -> None: ...


class Replayer(Protocol):
    def plan(self, layer: str, step: Step) -> Plan: ...


@dataclass
class _Call:
    site: int
    layer: str  # the router's name; `name#n` for its n-th extra call in one forward (looped layers)
    step: Step
    plan: Plan | None
    record: bool
    num_experts: int | None = None
    sparsemixer: bool = False
    replaced: int = 0
    seen: list[tuple[int, int, int, torch.Tensor]] = field(default_factory=list)  # (last dim, k, numel, indices)
    picks: dict[int, torch.Tensor] = field(default_factory=dict)  # sparsemixer: pick slot -> indices [N, 1]
    max_counts: list[int] = field(default_factory=lambda: [0, 0])


class _TopkMode(TorchFunctionMode):
    def __init__(self, hub: RouterHub, call: _Call) -> None:
        super().__init__()
        self.hub, self.call = hub, call

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
        kwargs = kwargs or {}
        if func in _TOPK:
            return self.hub._topk(self.call, func, args, kwargs)
        if self.call.sparsemixer and func in sparsemixer.MAX_FUNCS:
            return self.hub._max(self.call, func, args, kwargs)
        return func(*args, **kwargs)


class RouterHub:
    """Hooks on one model, shared by every active record/replay context on it."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.sites: list[RouterSite] = find_routers(model)
        self.tracker = StepTracker(model)
        self.recorders: list[Recorder] = []
        self.replayers: list[Replayer] = []
        self.pending: list[list[Plan]] = [[] for _ in self.sites]  # plans to reuse in checkpoint recomputes
        self._occurrence: list[tuple[Step | None, int]] = [(None, 0)] * len(self.sites)
        self._calls: list[_Call | None] = [None] * len(self.sites)
        self._undo: list[Any] = []

    # ---- lifetime ------------------------------------------------------------------------------------------
    @classmethod
    def attach(cls, model: nn.Module, handler: Recorder | Replayer, *, replay: bool) -> RouterHub:
        hub = model.__dict__.get(_HUB_ATTR)
        if hub is None:
            hub = cls(model)
            hub._install()
            model.__dict__[_HUB_ATTR] = hub
        (hub.replayers if replay else hub.recorders).append(handler)
        return hub

    def detach(self, handler: Recorder | Replayer) -> None:
        for group in (self.recorders, self.replayers):
            if any(h is handler for h in group):
                group[:] = [h for h in group if h is not handler]
        if not self.recorders and not self.replayers:
            self._uninstall()
            self.model.__dict__.pop(_HUB_ATTR, None)

    def _install(self) -> None:
        handle = self.model.register_forward_pre_hook(self._on_model_forward, with_kwargs=True)
        self._undo.append(handle.remove)
        for i, site in enumerate(self.sites):
            self._wrap_forward(i, site.scope, logits_index=None)
            self._wrap_forward(i, site.router, logits_index=site.logits_index)

    def _uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _wrap_forward(self, i: int, module: nn.Module, logits_index: int | None) -> None:
        """Intercept top-k calls while `module` runs. Both the router and its parent block are wrapped: the outer of the
        two that runs opens the interception (DBRX takes the top-k in the block, JetMoE's attention experts call the
        router from a method other than the block's forward)."""
        had_own = "forward" in module.__dict__
        previous = module.__dict__.get("forward")
        inner = module.forward

        def forward(*args: Any, **kwargs: Any) -> Any:
            call = self._calls[i]
            if call is not None:  # already inside the other wrapped module of this router
                out = inner(*args, **kwargs)
                if logits_index is not None:
                    call.num_experts = _num_scores(out, logits_index)
                return out
            call = self._begin(i)
            try:
                with _TopkMode(self, call):
                    out = inner(*args, **kwargs)
                if logits_index is not None:
                    call.num_experts = _num_scores(out, logits_index)
            finally:
                self._calls[i] = None
            self._end(call)
            return out

        module.forward = forward

        def undo() -> None:
            if had_own:
                module.forward = previous
            else:
                del module.forward

        self._undo.append(undo)

    # ---- hooks ---------------------------------------------------------------------------------------------
    def _on_model_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self.tracker.on_forward(args, kwargs)

    def _begin(self, i: int) -> _Call:
        step = self.tracker.current
        if step is None:
            raise ReplayError(
                f"router {self.sites[i].name!r} ran outside a forward of {type(self.model).__name__}: call the model "
                "that was given to record_routes / replay_routes"
            )
        recompute = torch._C._current_graph_task_id() != -1
        name = self.sites[i].name
        if not recompute:  # a router run again in the same forward (looped layers) is a layer of its own
            last, n = self._occurrence[i]
            n = n + 1 if last is step else 0
            self._occurrence[i] = (step, n)
            name = f"{name}#{n}" if n else name
        plan = None
        if self.replayers:
            if recompute:
                if not self.pending[i]:
                    raise ReplayError(
                        f"router {self.sites[i].name!r} was recomputed but no replayed forward is pending"
                    )
                plan = self.pending[i].pop()
            else:
                plan = self.replayers[-1].plan(name, step)
                if self.model.training and _checkpointing(self.model):
                    self.pending[i].append(plan)
        call = _Call(i, name, step, plan, record=bool(self.recorders) and not recompute)
        call.sparsemixer = type(self.sites[i].router).__name__ in sparsemixer.ROUTER_CLASSES
        self._calls[i] = call
        return call

    def _end(self, call: _Call) -> None:
        site = self.sites[call.site]
        if call.plan is not None:
            if call.num_experts is not None and call.num_experts != call.plan.num_experts:
                raise ReplayError(
                    f"router {call.layer!r} has E={call.num_experts} experts but the routes hold "
                    f"E={call.plan.num_experts} for it"
                )
            if call.replaced < (call.plan.top_k if call.sparsemixer else 1):
                raise ReplayError(
                    f"replay could not be applied at {call.layer!r} ({type(site.router).__name__}): no top-k with "
                    f"k={call.plan.top_k} over E={call.plan.num_experts} scores of each of the forward's "
                    f"{call.step.tokens} tokens was seen"
                )
        if not call.record:
            return
        E = call.num_experts
        picked = [s for s in call.seen if s[0] == E and s[2] == E * call.step.tokens]
        if call.picks:
            picked = [(E, len(call.picks), 0, torch.cat([call.picks[j] for j in sorted(call.picks)], -1))]
        if not picked:
            raise ReplayError(
                f"could not record {call.layer!r} ({type(site.router).__name__}): no top-k over its E={E} scores for "
                f"each of the forward's {call.step.tokens} tokens was seen (top-k calls: "
                f"{[(s[0], s[1], s[2]) for s in call.seen]})"
            )
        _, k, _, idx = picked[-1]
        idx = idx.reshape(call.step.batch, call.step.length, k)
        for rec in self.recorders:
            rec.record(call.layer, call.step, idx, E)

    # ---- the top-k ---------------------------------------------------------------------------------------------
    def _topk(self, call: _Call, func: Any, args: tuple, kwargs: dict) -> Any:
        x: torch.Tensor = args[0]
        k = int(args[1] if len(args) > 1 else kwargs["k"])
        dim = args[2] if len(args) > 2 else kwargs.get("dim", -1)
        last = dim in (-1, x.dim() - 1)
        plan, n = call.plan, call.step.tokens
        out = None
        if plan is not None and last:
            E = plan.num_experts
            if x.shape[-1] == E and k == plan.top_k and x.numel() == n * E:
                out = self._forced(func, args, kwargs, x, plan)
                call.replaced += 1
            elif x.shape[-1] < E and E % x.shape[-1] == 0 and x.numel() == n * x.shape[-1] and k <= x.shape[-1]:
                out = self._forced_groups(x, k, plan, call.layer)
        if out is None:
            out = func(*args, **kwargs)
        if call.record and last:
            call.seen.append((x.shape[-1], k, x.numel(), out[1]))
        return out

    def _max(self, call: _Call, func: Any, args: tuple, kwargs: dict) -> Any:
        x, dim, keepdim = sparsemixer.max_args(args, kwargs)
        n = call.step.tokens
        if dim not in (-1, x.dim() - 1) or x.numel() != n * x.shape[-1]:
            return func(*args, **kwargs)
        slot, is_pick = sparsemixer.slot_of(call.max_counts, keepdim, self.sites[call.site].router.training)
        plan = call.plan
        if slot is None or (plan is not None and (slot >= plan.top_k or x.shape[-1] != plan.num_experts)):
            return func(*args, **kwargs)
        if plan is not None:
            out = sparsemixer.forced_max(func, args, kwargs, plan.indices[:, slot], plan.mask, plan.all_recorded)
            call.replaced += is_pick
        else:
            out = func(*args, **kwargs)
        if call.record and is_pick:
            call.picks[slot] = out[1].reshape(n, 1)
        return out

    @staticmethod
    def _forced(func: Any, args: tuple, kwargs: dict, x: torch.Tensor, plan: Plan) -> Any:
        shape = (*x.shape[:-1], plan.top_k)
        idx = plan.indices.to(x.device).reshape(shape)
        if not plan.all_recorded:
            live = func(*args, **kwargs)[1]
            idx = torch.where(plan.mask.to(x.device).reshape(*x.shape[:-1], 1), idx, live)
        return torch.return_types.topk((x.gather(-1, idx), idx))

    @staticmethod
    def _forced_groups(x: torch.Tensor, k: int, plan: Plan, name: str) -> Any:
        """Group-limited routing: keep the groups that hold recorded experts, fill the rest live."""
        G = x.shape[-1]
        flat = x.reshape(-1, G)
        groups = plan.indices.to(x.device) // (plan.num_experts // G)
        need = torch.zeros(flat.shape, dtype=torch.bool, device=x.device).scatter_(-1, groups, True)
        need &= plan.mask.to(x.device)[:, None]
        if int(need.sum(-1).max()) > k:
            raise ReplayError(
                f"router {name!r} keeps topk_group={k} of {G} expert groups, but the routes use "
                f"{int(need.sum(-1).max())} groups for one token"
            )
        idx = torch.topk(flat.masked_fill(need, float("inf")), k, dim=-1).indices
        idx = idx.reshape(*x.shape[:-1], k)
        return torch.return_types.topk((x.gather(-1, idx), idx))


def _checkpointing(model: nn.Module) -> bool:
    """Whether activation checkpointing is on (its router calls will be recomputed in the backward)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if name in dir(type(model)):
            return bool(getattr(model, name))
    return False


def _num_scores(output: Any, index: int) -> int:
    """E: the last dim of the router logits, at `index` in the router's output (registered by the family)."""
    logits = output[index] if isinstance(output, tuple | list) else output
    return int(logits.shape[-1])
