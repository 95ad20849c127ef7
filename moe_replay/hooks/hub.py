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

import functools
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from . import sparsemixer
from .discover import RouterSite, find_routers
from .generation import check_generation, eos_token_ids
from .steps import Step, StepTracker

_HUB_ATTR = "_moe_replay_hub"
# Router classes whose selecting top-k was seen to run inside the router's own forward (a fact about the class's code,
# learned on its first call): their interception can skip the MoE block, whose experts run many ops.
_TOPK_IN_ROUTER: dict[type, bool] = {}
# Router classes (per training mode) that return the selecting top-k's own indices tensor as output element j: a
# recording without replay reads that output and skips the interception (a TorchFunctionMode costs a few percent of
# a decode step). Learned by identity (`output[j] is topk_indices`), never by equal values.
_OUTPUT_INDICES: dict[tuple[type, bool], int | None] = {}
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

    def on_generate(self, streams: Iterable[int], sequences: torch.Tensor, eos: list[int]) -> None: ...


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
    intercepting: bool = False
    router_out: Any = None
    outside_router: bool = False  # an intercepted top-k / max ran in the block, outside the router
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
            self.call.outside_router |= not self.hub._in_router[self.call.site]
            return self.hub._topk(self.call, func, args, kwargs)
        if self.call.sparsemixer and func in sparsemixer.MAX_FUNCS:
            self.call.outside_router |= not self.hub._in_router[self.call.site]
            return self.hub._max(self.call, func, args, kwargs)
        return func(*args, **kwargs)


class RouterHub:
    """Hooks on one model, shared by every active record/replay context on it."""

    def __init__(self, model: nn.Module) -> None:
        self.model = model
        self.sites: list[RouterSite] = find_routers(model)
        self.tracker = StepTracker()
        self.recorders: list[Recorder] = []
        self.replayers: list[Replayer] = []
        # plans of forwards whose router calls the backward will recompute (activation checkpointing), per router
        self.pending: list[list[tuple[Replayer, Step, Plan]]] = [[] for _ in self.sites]
        self._occurrence: list[tuple[Step | None, int]] = [(None, 0)] * len(self.sites)
        self._calls: list[_Call | None] = [None] * len(self.sites)
        self._undo: list[Callable[[], None]] = []
        self._generating = 0
        self._tracked: list[nn.Module] = []
        self._in_router = [0] * len(self.sites)  # router forwards on the stack, per router
        self._router_only = [_TOPK_IN_ROUTER.get(type(s.router), False) for s in self.sites]  # intercept in router only

    # ---- lifetime ------------------------------------------------------------------------------------------
    @classmethod
    def attach(cls, model: nn.Module, handler: Recorder | Replayer, *, replay: bool) -> RouterHub:
        hub = model.__dict__.get(_HUB_ATTR)
        if hub is None:
            hub = cls(model)
            for site in hub.sites:
                other = getattr(site.router.__dict__.get("forward"), _HUB_ATTR, None)
                if other is not None:
                    raise ReplayError(
                        f"router {site.name!r} is already hooked by a context opened on "
                        f"{type(other.model).__name__}; open every record/replay context of a model on the same module"
                    )
            hub._install()
            model.__dict__[_HUB_ATTR] = hub
        (hub.replayers if replay else hub.recorders).append(handler)
        return hub

    def detach(self, handler: Recorder | Replayer) -> None:
        for group in (self.recorders, self.replayers):
            if any(h is handler for h in group):
                group[:] = [h for h in group if h is not handler]
        for plans in self.pending:
            plans[:] = [p for p in plans if p[0] is not handler]
        if not self.recorders and not self.replayers:
            self._uninstall()
            self.model.__dict__.pop(_HUB_ATTR, None)

    def pending_for(self, handler: Replayer) -> int:
        """Replayed router calls still waiting for their recompute in the backward."""
        return sum(p[0] is handler for plans in self.pending for p in plans)

    def _install(self) -> None:
        self._tracked = self._tracked_modules()
        for module in self._tracked:
            self._patch(module, "forward", self._step_wrapper)
            if callable(getattr(module, "generate", None)):
                self._patch(module, "generate", self._generate_wrapper)
        for i, site in enumerate(self.sites):
            self._patch(site.scope, "forward", lambda inner, i=i: self._scope_wrapper(i, inner, None))
            self._patch(
                site.router, "forward", lambda inner, i=i, s=site: self._scope_wrapper(i, inner, s.logits_index)
            )

    def _uninstall(self) -> None:
        while self._undo:
            self._undo.pop()()

    def _tracked_modules(self) -> list[nn.Module]:
        """The model and every transformers model inside it that holds routers: their outermost forward is a step."""
        from transformers import PreTrainedModel

        names = [site.name for site in self.sites]
        found = [self.model]
        for prefix, module in self.model.named_modules():
            if prefix and isinstance(module, PreTrainedModel) and all(n.startswith(prefix + ".") for n in names):
                found.append(module)
        return found

    def _patch(self, module: nn.Module, attr: str, make: Callable[[Any], Any]) -> None:
        """Replace `module.<attr>` by `make(original)` on the instance; undone (in reverse order) on uninstall."""
        had_own = attr in module.__dict__
        previous = module.__dict__.get(attr)
        inner = getattr(module, attr)
        wrapper = functools.wraps(inner)(make(inner))
        setattr(wrapper, _HUB_ATTR, self)
        module.__dict__[attr] = wrapper

        def undo() -> None:
            if had_own:
                module.__dict__[attr] = previous
            else:
                module.__dict__.pop(attr, None)

        self._undo.append(undo)

    # ---- wrappers ------------------------------------------------------------------------------------------
    def _step_wrapper(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def forward(*args: Any, **kwargs: Any) -> Any:
            tracker = self.tracker
            if tracker.depth:  # an inner model called by the outer one: the same step
                return inner(*args, **kwargs)
            keep = any(m.training and _checkpointing(m) for m in self._tracked)
            tracker.begin(inner, args, kwargs, keep)
            tracker.depth += 1
            try:
                return inner(*args, **kwargs)
            finally:
                tracker.depth -= 1
                tracker.current = None

        return forward

    def _generate_wrapper(self, inner: Callable[..., Any]) -> Callable[..., Any]:
        def generate(*args: Any, **kwargs: Any) -> Any:
            if self._generating:
                return inner(*args, **kwargs)
            check_generation(self.model, args, kwargs)
            first = self.tracker.stream + 1
            self._generating += 1
            try:
                out = inner(*args, **kwargs)
            finally:
                self._generating -= 1
            sequences = out if isinstance(out, torch.Tensor) else getattr(out, "sequences", None)
            if isinstance(sequences, torch.Tensor):
                streams = range(first, self.tracker.stream + 1)
                for rec in self.recorders:
                    rec.on_generate(streams, sequences, eos_token_ids(self.model, kwargs))
            return out

        return generate

    def _scope_wrapper(self, i: int, inner: Callable[..., Any], logits_index: int | None) -> Callable[..., Any]:
        """Open router call `i` in whichever of the router and its MoE block runs first, and intercept top-k calls.

        Both are wrapped: DBRX takes the top-k in the block, outside the router; JetMoE's attention experts call the
        router from a method other than the block's forward. The first call intercepts in the whole block; when every
        top-k it saw ran inside the router, later calls intercept in the router alone (cheaper: the experts' ops then
        skip the Python-level TorchFunctionMode)."""
        is_router = logits_index is not None

        def forward(*args: Any, **kwargs: Any) -> Any:
            call = self._calls[i]
            opened = call is None
            if opened:
                call = self._begin(i)
                if call is None:  # a recompute of a forward that routed live
                    return inner(*args, **kwargs)
                self._calls[i] = call
            fast = call.plan is None and self._fast_record(i)
            intercept = not fast and not call.intercepting and (is_router or not self._router_only[i])
            self._in_router[i] += is_router
            try:
                if intercept:
                    call.intercepting = True
                    with _TopkMode(self, call):
                        out = inner(*args, **kwargs)
                else:
                    out = inner(*args, **kwargs)
                if is_router:
                    call.num_experts = _num_scores(out, logits_index)
                    call.router_out = out
            finally:
                self._in_router[i] -= is_router
                if intercept:
                    call.intercepting = False
                if opened:
                    self._calls[i] = None
            if opened:
                self._end(call)
            return out

        return forward

    def _begin(self, i: int) -> _Call | None:
        """Open one router call: which layer it is, which routes it must use, whether it is recorded."""
        site = self.sites[i]
        if torch._C._current_graph_task_id() != -1:  # a checkpoint recompute inside the backward
            if not self.pending[i]:
                return None  # its forward routed live: so does the recompute
            _, step, plan = self.pending[i].pop()  # the backward recomputes the latest forward first
            return _Call(i, site.name, step, plan, record=False, sparsemixer=_is_sparsemixer(site))
        step = self.tracker.current
        if step is None:
            raise ReplayError(
                f"router {site.name!r} ran outside a forward of {type(self.model).__name__}: call the model that was "
                "given to record_routes / replay_routes"
            )
        last, n = self._occurrence[i]  # a router run again in the same forward (looped layers) is a layer of its own
        n = n + 1 if last is step else 0
        self._occurrence[i] = (step, n)
        name = f"{site.name}#{n}" if n else site.name
        plan = None
        if self.replayers:
            replayer = self.replayers[-1]
            plan = replayer.plan(name, step)
            if step.keep:
                self.pending[i].append((replayer, step, plan))
        return _Call(i, name, step, plan, record=bool(self.recorders), sparsemixer=_is_sparsemixer(site))

    def _fast_record(self, i: int) -> bool:
        """Whether call `i` can be recorded from the router's output alone (see `_OUTPUT_INDICES`)."""
        router = self.sites[i].router
        return self._router_only[i] and _OUTPUT_INDICES.get((type(router), router.training)) is not None

    def _end(self, call: _Call) -> None:
        site = self.sites[call.site]
        if call.plan is None and call.record and not call.seen and call.router_out is not None:
            j = _OUTPUT_INDICES.get((type(site.router), site.router.training))
            if j is not None:  # recorded from the router's output: its element j is the top-k's indices
                out = _outputs(call.router_out)
                idx = out[j]
                indices = idx.reshape(call.step.batch, call.step.length, idx.shape[-1])
                for rec in self.recorders:
                    rec.record(call.layer, call.step, indices, call.num_experts)
                return
        if (call.seen or call.picks or call.replaced) and not self._router_only[call.site]:
            self._router_only[call.site] = _TOPK_IN_ROUTER[type(site.router)] = not call.outside_router
        if call.plan is not None:
            if call.num_experts is not None and call.num_experts != call.plan.num_experts:
                raise ReplayError(
                    f"router {call.layer!r} has E={call.num_experts} experts but the routes hold "
                    f"E={call.plan.num_experts} for it"
                )
            if call.replaced < (call.plan.top_k if call.sparsemixer else 1):
                raise ReplayError(
                    f"replay could not be applied at {call.layer!r} ({type(site.router).__name__}): the routes hold "
                    f"k={call.plan.top_k} of E={call.plan.num_experts} experts for each of the forward's "
                    f"{call.step.tokens} tokens, but the router's top-k calls were (E, k) = "
                    f"{[(e, k) for e, k, _, _ in call.seen]}"
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
        key = (type(site.router), site.router.training)
        if call.router_out is not None and key not in _OUTPUT_INDICES and not call.picks:
            out = _outputs(call.router_out)
            _OUTPUT_INDICES[key] = next((j for j, o in enumerate(out) if o is idx), None)
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
        if last and (call.record or call.plan is not None):
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


def _is_sparsemixer(site: RouterSite) -> bool:
    return type(site.router).__name__ in sparsemixer.ROUTER_CLASSES


def _checkpointing(model: nn.Module) -> bool:
    """Whether activation checkpointing is on (its router calls will be recomputed in the backward)."""
    for name in ("is_activation_checkpointing", "is_gradient_checkpointing"):
        if name in dir(type(model)):
            return bool(getattr(model, name))
    return False


def _outputs(output: Any) -> tuple | list:
    """A module's output as a sequence (a single tensor becomes a 1-tuple)."""
    return output if isinstance(output, tuple | list) else (output,)


def _num_scores(output: Any, index: int) -> int:
    """E: the last dim of the router logits, at `index` in the router's output (registered by the family)."""
    logits = output[index] if isinstance(output, tuple | list) else output
    return int(logits.shape[-1])
